"""What an SFT start offers RL: research.anneal.anneal's measurements of one SFT model of the testbed's chain task (
why RL cannot lift an annealed start). Each is a candidate cause, measured the same way on every start:

- sharpness: the top eigenvalue of the SFT loss's Hessian on gold solutions (power iteration, finite-difference
  Hessian-vector products), and what a random step of eta on every weight (sign +-1) costs in SFT loss and in greedy
  pass@1 on the validation problems;
- the policy gradient: grpo's gradient on 8 samples of PROMPTS train problems (T 0.6, top-p 0.9, as train.py), its
  size, how much its two halves (by prompt) agree, its cosine with the SFT direction (minus the gold loss's gradient
  on the same problems), and what a sign step of eta along it does to greedy pass@1 and to the gold loss (Adam's
  first step is such a step: lr x the sign of the gradient on every weight), and a step of the same length along
  the gradient itself (SGD's direction: "pgsgd"); and the gold loss along each direction to second order: its slope,
  its curvature, and the step (eta) at the quadratic's bottom;
- the groups: mean reward, the share of groups with mixed outcomes (the only ones grpo learns from), the mean
  per-prompt p (1 - p), and the policy's entropy and log-prob on its own samples.

Shapes: B = instances, R = response (or target) tokens, N = the model's parameters, flattened.
"""
import itertools
import math
import random
from types import SimpleNamespace

import torch

from data import encode_prompt, load_split
from engine import HFSampler
from grader import grade
from model import Scorer, load_model, load_tokenizer
from ppo import pad_episodes
from rollout import evaluate

GREEDY = SimpleNamespace(grader="chain", prompt_format="plain", eval_samples=1, eval_temperature=0.0, top_p=1.0,
                         max_new_tokens=64)  # rollout.evaluate's settings: greedy pass@1 (sft.py --stop-at's)
PROMPTS, GROUP, VALIDATION, GOLD = 128, 8, 200, 512
# A weight's move: one Adam step at the testbed's RL lr 5e-5 moves each weight by ~5e-5, an iteration's 8 by up to 4e-4.
# Random directions are far flatter (a step of 1e-3 barely moves the loss), so they are probed further out.
PG_ETAS, RANDOM_ETAS, DRAWS = (1e-4, 4e-4, 1e-3), (1e-3, 3e-3), 2
VERSION = 3  # probe.json of another version is measured again (2: the SGD-direction step; 3: the loss along each)


def group_stats(rewards: list[float], *, group: int) -> dict:
    """Mean reward, share of groups whose rewards are not all equal (grpo's advantages are 0 in the others), and the
    mean per-prompt p (1 - p) (p: the group's mean reward), of consecutive groups of `group` rewards."""
    groups = [rewards[a:a + group] for a in range(0, len(rewards), group)]
    means = [sum(g) / len(g) for g in groups]
    return {"reward": sum(rewards) / len(rewards), "mixed_groups": sum(len(set(g)) > 1 for g in groups) / len(groups),
            "p_one_minus_p": sum(p * (1 - p) for p in means) / len(means)}


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(a @ b / (a.norm() * b.norm()).clamp(min=1e-30))


def flat_grad(model, loss: torch.Tensor) -> torch.Tensor:
    """The gradient of `loss` over the model's parameters, flattened: (N,)."""
    grads = torch.autograd.grad(loss, [p for p in model.parameters()], allow_unused=True)
    return torch.cat([(g if g is not None else torch.zeros_like(p)).reshape(-1)
                      for g, p in zip(grads, model.parameters())])


def add_(model, direction: torch.Tensor, scale: float):
    """Move the weights by scale x direction (N,), in place."""
    with torch.no_grad():
        offset = 0
        for p in model.parameters():
            p.add_(direction[offset:offset + p.numel()].view_as(p), alpha=scale)
            offset += p.numel()


def token_logprobs(scorer, prompts: list[list[int]], responses: list[list[int]], *, pad_id: int, temperature: float,
                   micro: int = 128, with_entropy: bool = False) -> list[tuple]:
    """(log-probs (B, R), mask (B, R), entropy or None) per micro-batch of `micro` instances."""
    parts = []
    for a in range(0, len(prompts), micro):
        ids, attn, mask, P = pad_episodes(prompts[a:a + micro], responses[a:a + micro], pad_id=pad_id)
        logprobs, entropy, _, _ = scorer(ids, attn, response_start=P, temperature=temperature,
                                         with_entropy=with_entropy)  # (B, R)
        parts.append((logprobs, mask.float(), entropy))
    return parts


def gold_loss(scorer, pairs: list[tuple[list, list]], *, pad_id: int) -> torch.Tensor:
    """sft.py's loss: each instance's mean target-token NLL, then the mean over instances."""
    parts = token_logprobs(scorer, [p for p, _ in pairs], [t for _, t in pairs], pad_id=pad_id, temperature=1.0)
    per_instance = torch.cat([-(lp * m).sum(1) / m.sum(1) for lp, m, _ in parts])  # (B,)
    return per_instance.mean()


def pg_loss(scorer, prompts, responses, advantages: list[float], *, pad_id: int) -> torch.Tensor:
    """Minus grpo's objective: sum over responses of advantage x log-prob of its tokens (at T 0.6), over all tokens."""
    parts = token_logprobs(scorer, prompts, responses, pad_id=pad_id, temperature=0.6)
    tokens = sum(float(m.sum()) for _, m, _ in parts)
    A = torch.tensor(advantages)  # (B,)
    total, a = 0.0, 0
    for lp, m, _ in parts:
        total = total - (A[a:a + len(lp), None] * lp * m).sum()
        a += len(lp)
    return total / tokens


def hvp(model, loss_fn, v: torch.Tensor, *, eps: float = 1e-2) -> torch.Tensor:
    """The Hessian of loss_fn() times the unit vector v (N,), from two gradients at +-eps v (the weights put back)."""
    add_(model, v, eps)
    plus = flat_grad(model, loss_fn())
    add_(model, v, -2 * eps)
    minus = flat_grad(model, loss_fn())
    add_(model, v, eps)
    return (plus - minus) / (2 * eps)  # (N,)


def top_eigenvalue(model, loss_fn, *, iters: int = 12, seed: int = 0) -> float:
    """The largest eigenvalue of loss_fn()'s Hessian, by power iteration."""
    v = torch.randn(sum(p.numel() for p in model.parameters()), generator=torch.Generator().manual_seed(seed))
    v, value = v / v.norm(), 0.0
    for _ in range(iters):
        hv = hvp(model, loss_fn, v)  # (N,)
        value = float(v @ hv)
        v = hv / hv.norm()
    return value


def along(model, loss_fn, direction: torch.Tensor) -> dict:
    """The loss along a direction (N,), to second order: its slope and curvature per unit length, and the step length
    (in the direction's own units, x its length) that the quadratic puts at the bottom (inf: no bottom)."""
    v = direction / direction.norm().clamp(min=1e-30)
    slope = float(flat_grad(model, loss_fn()) @ v)
    curvature = float(v @ hvp(model, loss_fn, v))
    best = -slope / curvature if curvature > 0 else math.inf
    return {"slope": slope, "curvature": curvature, "best_eta": best / float(direction.norm().clamp(min=1e-30))}


def probe(model_dir: str, *, seed: int) -> dict:
    """Every measurement of the module's docstring on the SFT model in model_dir."""
    torch.manual_seed(seed)
    tokenizer = load_tokenizer(model_dir)
    model = load_model(model_dir, device=torch.device("cpu"), dtype=torch.float32)
    scorer, pad = Scorer(model), tokenizer.pad_token_id
    sampler = HFSampler(model, tokenizer, dtype=torch.float32, batch_size=512)
    validation = load_split("chain", "validation", arith_ops=4)[:VALIDATION]

    def val_pass() -> float:
        sampler.sync(model)
        return evaluate(sampler, tokenizer, validation, GREEDY, seed=seed)[0]

    def encode(e):
        return encode_prompt(e["question"], grader="chain", tokenizer=tokenizer, prompt_format="plain")

    def gold_pair(e) -> tuple[list, list]:  # (prompt ids, target ids): sft.py's target, the solution then EOS
        return encode(e), tokenizer(e["solution"], add_special_tokens=False).input_ids + [tokenizer.eos_token_id]

    def after_step(direction: torch.Tensor, eta: float) -> tuple[float, float]:
        """The change in gold loss and in greedy validation pass@1 after a step of eta x direction (then undone)."""
        add_(model, direction, eta)
        with torch.no_grad():
            loss = float(gold_loss(scorer, gold, pad_id=pad)) - out["gold_loss"]
        passed = val_pass() - out["val_pass"]
        add_(model, direction, -eta)
        return loss, passed

    gold = [gold_pair(e) for e in load_split("chain", "validation", arith_ops=4)[VALIDATION:VALIDATION + GOLD]]
    loss_fn = lambda: gold_loss(scorer, gold[:256], pad_id=pad)  # noqa: E731
    out = {"val_pass": val_pass()}
    loss = gold_loss(scorer, gold, pad_id=pad)
    out["gold_loss"], out["gold_grad_norm"] = float(loss.detach()), float(flat_grad(model, loss).norm())
    out["sharpness"] = top_eigenvalue(model, loss_fn, seed=seed)
    n = sum(p.numel() for p in model.parameters())
    generator = torch.Generator().manual_seed(seed)
    for eta in RANDOM_ETAS:
        losses, passes = [], []
        for _ in range(DRAWS):
            direction = torch.randint(0, 2, (n,), generator=generator).float() * 2 - 1  # (N,) +-1
            loss, passed = after_step(direction, eta)
            losses.append(loss)
            passes.append(passed)
        out[f"random_{eta:g}_loss"], out[f"random_{eta:g}_pass"] = sum(losses) / DRAWS, sum(passes) / DRAWS
    # the groups and grpo's gradient on them
    examples = random.Random(seed).sample(load_split("chain", "train", arith_ops=4), PROMPTS)
    prompts = [encode(e) for e in examples]
    sampler.sync(model)
    groups = sampler.sample(prompts, n=GROUP, temperature=0.6, top_p=0.9, max_new_tokens=64, seed=seed)
    rows = [(p, s, e) for p, g, e in zip(prompts, groups, examples) for s in g]
    rewards = [grade(s.text, e["answer"], grader="chain", truncated=not s.finished) for _, s, e in rows]
    out.update(group_stats(rewards, group=GROUP))
    means = [sum(rewards[a:a + GROUP]) / GROUP for a in range(0, len(rewards), GROUP)]
    advantages = [r - means[i // GROUP] for i, r in enumerate(rewards)]
    responses = [s.token_ids for _, s, _ in rows]
    with torch.no_grad():
        parts = token_logprobs(scorer, [p for p, _, _ in rows], responses, pad_id=pad, temperature=1.0,
                               with_entropy=True)
        tokens = sum(float(m.sum()) for _, m, _ in parts)
        out["entropy"] = sum(float((e * m).sum()) for _, m, e in parts) / tokens
        out["sample_logprob"] = sum(float((lp * m).sum()) for lp, m, _ in parts) / tokens
    half = len(rows) // 2
    gradients = [-flat_grad(model, pg_loss(scorer, [p for p, _, _ in rows[a:b]], responses[a:b], advantages[a:b],
                                           pad_id=pad)) for a, b in ((0, half), (half, len(rows)))]  # ascent on J
    pg = (gradients[0] + gradients[1]) / 2  # (N,)
    sft_direction = -flat_grad(model, gold_loss(scorer, [gold_pair(e) for e in examples], pad_id=pad))
    out.update(pg_norm=float(pg.norm()), pg_half_cosine=cosine(*gradients), pg_sft_cosine=cosine(pg, sft_direction))
    # (N,) each: Adam's first step, and SGD's direction scaled to the same length
    steps = {"pg": torch.sign(pg), "pgsgd": pg * math.sqrt(n) / pg.norm().clamp(min=1e-30)}
    for kind, direction in steps.items():  # the gold loss along each, to second order
        out.update({f"{kind}_{k}": v for k, v in along(model, loss_fn, direction).items()})
    for (kind, direction), eta in itertools.product(steps.items(), PG_ETAS):
        out[f"{kind}_{eta:g}_loss"], out[f"{kind}_{eta:g}_pass"] = after_step(direction, eta)
    return {"version": VERSION, **{k: (round(v, 6) if isinstance(v, float) and math.isfinite(v) else v)
                                   for k, v in out.items()}}
