"""The PPO update: clipped surrogate + KL penalty to the frozen reference, epochs x minibatches.

    ratio = exp(logp - logp_old)
    loss  = mean over response tokens of  -min(ratio * A, clip(ratio, 1 - clip, 1 + clip) * A)  +  kl_coef * k3
    k3    = exp(logp_ref - logp) - (logp_ref - logp) - 1      (an unbiased, non-negative estimator of KL(pi || ref))

The KL term is in the loss, not the reward (paper: kl_coef = 1e-4). Log-probs use logits / sampling temperature.
Truncated importance sampling (--tis-cap C > 0; Yao et al. 2025) corrects for a sampler whose numbers differ from the
trainer's (bf16 sampling, vLLM kernels): each token's clipped surrogate is weighted by
    w = min(exp(logp_old - logp_sampler), C)        logp_old: the trainer's, before the update
and `sampler_mismatch` measures that gap every iteration. Both compare like with like: the sampler's log-prob is under
the distribution it drew from (softmax(logits / T) over the top-p nucleus), so the trainer's is taken under the same
(batch_logprobs' logprobs - log_mass), and the gap is the two engines' numerics alone. The ratio and the KL use the
full softmax(logits / T).
A minibatch whose mean ratio exceeds `max_ratio` (10) is skipped: its samples are too far off-policy to trust.
With a value head on the policy's trunk (`--critic head`, the ablation of the PPO baseline), vf_coef x the clipped
value loss is added (the paper's separate critic, `--critic separate`, is trained on its own: critic.py):
    value_loss = 0.5 * max((V - G)^2, (V_old + clip(V - V_old, -value_clip, value_clip) - G)^2)

train.py's section 6 is `policy_update`; `make_optimizer` builds AdamW and its schedule (lr_factor) for train.py
and sft.py alike.

Shapes: B = episodes, P = prompt columns (left-padded), R = response columns (right-padded), T = P + R.
"""
import math
from functools import partial

import torch
from tqdm import tqdm

import dist
from ablations.silent_groups import equal_minibatches, plain_steps


def ppo_loss(*, logprobs, old_logprobs, ref_logprobs, advantages, mask, clip: float, kl_coef: float,
             tis_weights=None):
    """Clipped PPO loss averaged over response tokens (mask == 1), plus kl_coef * k3 KL to the reference; with
    tis_weights (from `tis_weights`), each token's clipped surrogate is weighted by its own.

    All inputs (B, R). Returns (loss, stats) with stats approx_kl, clipfrac, kl_ref, ratio (token means, detached).
    """
    mask = mask.float()
    n = mask.sum().clamp(min=1)
    log_ratio = logprobs - old_logprobs  # (B, R)
    ratio = log_ratio.exp()  # (B, R)
    pg = -torch.min(ratio * advantages, ratio.clamp(1 - clip, 1 + clip) * advantages)  # (B, R)
    if tis_weights is not None:
        pg = pg * tis_weights
    ref_diff = ref_logprobs - logprobs  # (B, R)
    kl_ref = (ref_diff.exp() - ref_diff - 1).clamp(0, 10)  # (B, R) k3
    loss = ((pg + kl_coef * kl_ref) * mask).sum() / n
    with torch.no_grad():
        stats = {"approx_kl": (((ratio - 1) - log_ratio) * mask).sum() / n,  # k3 of KL(old || new)
                 "clipfrac": (((ratio - 1).abs() > clip).float() * mask).sum() / n,
                 "kl_ref": (kl_ref * mask).sum() / n,
                 "ratio": (ratio * mask).sum() / n}
    return loss, {k: v.item() for k, v in stats.items()}


def tis_weights(*, old_logprobs, sampler_logprobs, cap: float):
    """Truncated importance weights min(pi_old / pi_sampler, cap) per token (B, R): how much likelier the trainer's
    own numbers make each sampled token than the sampler's did, capped so one token cannot dominate."""
    return (old_logprobs - sampler_logprobs).exp().clamp(max=cap)


def sampler_mismatch(*, trainer_logprobs, sampler_logprobs, mask) -> dict:
    """How far the sampler's token log-probs are from the trainer's on the same tokens (all (B, R); tokens drawn from
    the sampler): mean |difference|, the k3 estimate of KL(sampler || trainer), and the fraction of tokens whose
    ratio pi_trainer / pi_sampler is outside [0.5, 2]."""
    mask = mask.float()
    n = mask.sum().clamp(min=1)
    log_ratio = trainer_logprobs - sampler_logprobs  # (B, R)
    k3 = log_ratio.exp() - 1 - log_ratio  # (B, R)
    return {"mismatch_abs_logp": ((log_ratio.abs() * mask).sum() / n).item(),
            "mismatch_kl": ((k3 * mask).sum() / n).item(),
            "mismatch_ratio_out": (((log_ratio.abs() > math.log(2)).float() * mask).sum() / n).item()}


def value_loss(*, values, old_values, returns, mask, value_clip: float):
    """Clipped value loss averaged over response tokens; all inputs (B, R). Returns (loss, stats)."""
    mask = mask.float()
    n = mask.sum().clamp(min=1)
    clipped = old_values + (values - old_values).clamp(-value_clip, value_clip)  # (B, R)
    loss = 0.5 * (torch.max((values - returns) ** 2, (clipped - returns) ** 2) * mask).sum() / n
    with torch.no_grad():
        clipfrac = (((values - old_values).abs() > value_clip).float() * mask).sum() / n
    return loss, {"value_loss": loss.item(), "value_clipfrac": clipfrac.item()}


def pad_episodes(prompts: list[list[int]], responses: list[list[int]], *, pad_id: int):
    """Left-pad prompts to P and right-pad responses to R. Returns input_ids, attention_mask (B, T), response_mask
    (B, R) and P."""
    P, R = max(map(len, prompts)), max(map(len, responses))
    ids = [[pad_id] * (P - len(p)) + p + r + [pad_id] * (R - len(r)) for p, r in zip(prompts, responses)]
    attn = [[0] * (P - len(p)) + [1] * (len(p) + len(r)) + [0] * (R - len(r)) for p, r in zip(prompts, responses)]
    resp = [[1] * len(r) + [0] * (R - len(r)) for r in responses]
    return torch.tensor(ids), torch.tensor(attn), torch.tensor(resp), P


def pad_rows(rows: list[torch.Tensor], width: int) -> torch.Tensor:
    """(B, width) from 1-D tensors of varying length, zero-padded on the right."""
    out = torch.zeros(len(rows), width)
    for i, row in enumerate(rows):
        out[i, :len(row)] = row
    return out


SEQUENCE_KEYS = ("input_ids", "attention_mask")  # (B, T); every other batch entry is per response token (B, R)


def trim(batch: dict, idx: torch.Tensor, P: int) -> tuple[dict, int]:
    """Rows `idx` of the batch, without the columns that are padding in every one of them; returns the new P too."""
    left = int((batch["attention_mask"][idx, :P].sum(0) == 0).sum())  # leading all-pad prompt columns
    R = int(batch["response_mask"][idx].sum(1).max())
    out = {k: v[idx, left:P + R] if k in SEQUENCE_KEYS else v[idx, :R] for k, v in batch.items()}
    return out, P - left


def micro_batches(n: int, *, size: int, generator: torch.Generator | None = None) -> list[torch.Tensor]:
    """A random partition of n episodes into groups of `size` (the last may be smaller), fixed for the iteration: the
    old, reference and new log-probs are all computed on these same groups, padded the same way. In bf16 a token
    scored in two differently padded groups moves by ~0.04 nats (the kernels round differently for different
    shapes); on the same group the forward pass repeats exactly, so the PPO ratio starts at exactly 1."""
    perm = torch.randperm(n, generator=generator)
    return [perm[i:i + size] for i in range(0, n, size)]


def batch_logprobs(scorer, batch: dict, P: int, *, groups: list[torch.Tensor], temperature: float,
                   top_p: float = 1.0):
    """Log-probs (B, R) of every response token under `scorer` (a model.Scorer, possibly wrapped by dist.wrap; no
    grad), micro-batch by micro-batch (`groups`, from micro_batches); its value head's predictions (B, R) when it
    has one (else None); and the log of the top-p nucleus mass at each position (B, R; 0 when top_p >= 1), so that
    logprobs - log_mass is each token's log-prob under the distribution the sampler drew it from."""
    scored = score_batch(scorer, batch, P, groups=groups, temperature=temperature, top_p=top_p)
    return scored["logprobs"], scored["values"], scored["log_mass"]


@torch.no_grad()
def score_batch(scorer, batch: dict, P: int, *, groups: list[torch.Tensor], temperature: float, top_p: float = 1.0,
                with_entropy: bool = False) -> dict:
    """batch_logprobs' pass, as a dict: logprobs, values (or None), log_mass, and with_entropy the policy's entropy
    (B, R) at every response position (of the temperature-scaled distribution; else None)."""
    device = next(scorer.parameters()).device
    shape = batch["response_mask"].shape
    out = {"logprobs": torch.zeros(shape), "values": None, "log_mass": torch.zeros(shape),
           "entropy": torch.zeros(shape) if with_entropy else None}
    for idx in groups:
        mb, p = trim(batch, idx, P)
        logp, entropy, v, mass = scorer(mb["input_ids"].to(device), mb["attention_mask"].to(device), response_start=p,
                                        temperature=temperature, top_p=top_p, with_entropy=with_entropy)
        out["logprobs"][idx, :logp.shape[1]] = logp.float().cpu()
        if mass is not None:
            out["log_mass"][idx, :mass.shape[1]] = mass.float().cpu()
        if with_entropy:
            out["entropy"][idx, :entropy.shape[1]] = entropy.float().cpu()
        if v is not None:
            out["values"] = torch.zeros(shape) if out["values"] is None else out["values"]
            out["values"][idx, :v.shape[1]] = v.float().cpu()
    return out


def minibatch_groups(groups: list[torch.Tensor], minibatch_size: int, *, steps: int = 0) -> list[list[torch.Tensor]]:
    """Consecutive micro-batch `groups` (micro_batches) bundled into minibatches of minibatch_size episodes; steps > 0
    (a batch that --resample-silent grew): exactly `steps` near-equal ones (ablations/silent_groups.py)."""
    if steps > 0:
        return equal_minibatches(groups, steps=steps)
    per = max(1, minibatch_size // len(groups[0]))
    return [groups[i:i + per] for i in range(0, len(groups), per)]


def minibatch_tokens(batch: dict, minibatch: list[torch.Tensor]) -> float:
    """Response tokens in a minibatch over all ranks (at least 1): what its loss is a token mean over."""
    local = sum(batch["response_mask"][idx].sum() for idx in minibatch)
    return dist.all_sum(torch.tensor([float(local)]))[0].clamp(min=1).item()


def ppo_update(scorer, optimizer, scheduler, batch: dict, P: int, *, groups: list[torch.Tensor], epochs: int,
               minibatch_size: int, clip: float, kl_coef: float, temperature: float, max_grad_norm: float = 1.0,
               max_ratio: float = 10.0, vf_coef: float = 0.1, value_clip: float = 0.2,
               generator: torch.Generator | None = None, minibatches_per_epoch: int = 0) -> dict:
    """Epochs x minibatches of clipped PPO steps, with gradient accumulation over micro-batches. `scorer` is a
    model.Scorer (the policy, the value head if any, the compute dtype), or that Scorer wrapped for data parallelism
    (dist.wrap): forward and backward compute in its dtype (autocast) while the weights and AdamW's state stay fp32.
    A minibatch is minibatch_size / (micro-batch size) consecutive `groups` (micro_batches); each epoch takes the
    minibatches in a new random order (their members stay: see micro_batches); minibatches_per_epoch > 0: exactly
    that many minibatches an epoch, of near-equal size (minibatch_groups), for a batch that --resample-silent grew.
    Under torchrun each rank passes its own episodes and minibatch_size / world: the loss is normalised by the
    minibatch's token count over all ranks, and the gradients summed over ranks (DDP averages, so the loss is scaled
    by the world size); N ranks x B / N episodes take the step 1 rank x B episodes would. Stats are global too.

    batch: input_ids, attention_mask (B, T); response_mask, old_logprobs, ref_logprobs, advantages (B, R); with a
    value head also old_values and returns (B, R); optionally tis_weights (B, R). Returns mean stats over the
    optimizer steps taken, and `skipped`.
    """
    device = next(scorer.parameters()).device
    scorer.train()
    minibatches = minibatch_groups(groups, minibatch_size, steps=minibatches_per_epoch)
    totals, steps, skipped, first_half = {}, 0, 0, None
    params = [p for group in optimizer.param_groups for p in group["params"]]
    bar = tqdm(total=epochs * len(minibatches), desc="ppo", leave=False, disable=dist.rank() > 0)
    for _ in range(epochs):
        for m in torch.randperm(len(minibatches), generator=generator).tolist():
            bar.update()
            halves = steps == 0 and skipped == 0 and len(minibatches[m]) >= 2 and not dist.active()  # grad_cosine
            n_tokens, acc = minibatch_tokens(batch, minibatches[m]), {}
            for j, idx in enumerate(minibatches[m]):
                mb, p = trim(batch, idx, P)
                mb = {k: v.to(device) for k, v in mb.items()}
                with dist.sync_gradients(scorer, j == len(minibatches[m]) - 1):  # all-reduce on the last backward
                    logp, entropy, values, _ = scorer(mb["input_ids"], mb["attention_mask"], response_start=p,
                                                   temperature=temperature, with_entropy=True)
                    loss, stats = ppo_loss(logprobs=logp, old_logprobs=mb["old_logprobs"],
                                           ref_logprobs=mb["ref_logprobs"], advantages=mb["advantages"],
                                           mask=mb["response_mask"], clip=clip, kl_coef=kl_coef,
                                           tis_weights=mb.get("tis_weights"))
                    if values is not None:
                        v_loss, v_stats = value_loss(values=values, old_values=mb["old_values"], returns=mb["returns"],
                                                     mask=mb["response_mask"], value_clip=value_clip)
                        loss = loss + vf_coef * v_loss
                        stats.update(v_stats)
                    weight = mb["response_mask"].sum().item() / n_tokens  # token-mean over the global minibatch
                    (loss * weight * dist.world()).backward()
                if halves and j == len(minibatches[m]) // 2 - 1:  # the first half of the first step's micro-batches
                    first_half = flat_grad(params)
                stats["entropy"] = ((entropy * mb["response_mask"]).sum() / mb["response_mask"].sum().clamp(min=1)).item()
                stats["loss"] = loss.item()
                for k, v in stats.items():
                    acc[k] = acc.get(k, 0.0) + v * weight
            acc = dict(zip(acc, dist.all_sum(torch.tensor(list(acc.values()))).tolist()))  # global token means
            if acc["ratio"] > max_ratio or not math.isfinite(acc["loss"]):
                optimizer.zero_grad(set_to_none=True)
                skipped += 1
                continue
            if halves:
                acc["grad_cosine"] = half_cosine(first_half, flat_grad(params))
            acc["grad_norm"] = torch.nn.utils.clip_grad_norm_(params, max_grad_norm).item()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            steps += 1
            for k, v in acc.items():
                totals[k] = totals.get(k, 0.0) + v
    bar.close()
    out = {k: v / max(steps, 1) for k, v in totals.items() if k != "grad_cosine"}
    if "grad_cosine" in totals:
        out["grad_cosine"] = totals["grad_cosine"]  # of the first step only
    out.update(optimizer_steps=steps, skipped=skipped)
    return out


def flat_grad(params) -> torch.Tensor:
    """All parameters' gradients as one fp32 vector (zeros where a parameter has none)."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().float().flatten()
                      for p in params])


def half_cosine(first: torch.Tensor, both: torch.Tensor) -> float:
    """The cosine between the gradient of the first half of a minibatch (`first`) and of its second half (`both` -
    `first`): near 1 when the two halves agree on the direction (signal), near 0 when each follows its own samples
    (noise). train.py logs it for the first optimizer step of every iteration as grad_cosine."""
    second = both - first
    return (first @ second / (first.norm() * second.norm()).clamp(min=1e-30)).item()


def lr_factor(step: int, *, warmup: int, total: int, decay: bool = True, decay_steps: int = 0,
              floor: float = 0.0) -> float:
    """Linear warmup to 1 over `warmup` steps, then linear decay to `floor` at `total` (or constant 1 without decay).
    decay_steps > 0: constant 1 until the last decay_steps steps, which decay (warmup-stable-decay)."""
    if step < warmup:
        return (step + 1) / warmup
    span = decay_steps or total - warmup
    if not decay or step < total - span:
        return 1.0
    return floor + (1 - floor) * max(0.0, (total - step) / max(1, span))


def policy_optimizer(policy, value_head, cfg):
    """train.py's AdamW and schedule: the policy at --lr and, with --critic head, the head on its trunk at --value-lr
    (a separate critic has its own: critic.open_critic)."""
    groups = [{"params": policy.parameters(), "lr": cfg.lr}]
    if value_head is not None:
        groups.append({"params": value_head.parameters(), "lr": cfg.value_lr})
    return make_optimizer(groups, weight_decay=cfg.weight_decay, total_steps=cfg.total_steps,
                          warmup_ratio=cfg.warmup_ratio, decay=cfg.lr_decay)


def make_optimizer(param_groups: list[dict], *, weight_decay: float, total_steps: int, warmup_ratio: float,
                   decay: bool = True, decay_steps: int = 0, floor: float = 0.0):
    """AdamW (fused: one kernel for all parameters, bench/adamw.py) over fp32 master weights, and its schedule:
    warmup over warmup_ratio x total_steps optimizer steps, then linear decay to `floor` x lr (over the last
    decay_steps steps if > 0), or constant without decay."""
    optimizer = torch.optim.AdamW(param_groups, weight_decay=weight_decay, fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, partial(lr_factor, warmup=math.ceil(warmup_ratio * total_steps), total=total_steps, decay=decay,
                           decay_steps=decay_steps, floor=floor))
    return optimizer, scheduler


def policy_update(scorer, reference_scorer, optimizer, scheduler, batch: dict, P: int, *, groups: list[torch.Tensor],
                  sampler_logprobs: list[list[float]], cfg) -> dict:
    """train.py's section 6: the log-probs of the sampling policy (unless the critic's pass left them in `batch`) and
    of the reference, then the clipped updates (ppo_update). The sampler computed its own log-probs of the same
    tokens: their gap is measured (mismatch_*) and, with --tis-cap, corrected. With a critic's values in `batch`,
    value_error: the token mean |V - return| before the update. Returns the update's stats and these, means over all
    ranks. (A separate critic, --critic separate, is trained after this: critic.critic_update.)"""
    if "old_logprobs" not in batch:
        batch["old_logprobs"], _, batch["log_mass"] = batch_logprobs(scorer, batch, P, groups=groups,
                                                                     temperature=cfg.temperature, top_p=cfg.top_p)
    log_mass = batch.pop("log_mass")  # (B, R)
    batch["ref_logprobs"], _, _ = batch_logprobs(reference_scorer, batch, P, groups=groups, temperature=cfg.temperature)
    mask = batch["response_mask"]  # (B, R)
    sampled = pad_rows([torch.tensor(lps) for lps in sampler_logprobs], mask.shape[1])  # (B, R) the sampler's
    trainer_sampled = batch["old_logprobs"] - log_mass  # (B, R) under the distribution sampled from, as the sampler's
    mismatch = dist.weighted_mean(sampler_mismatch(trainer_logprobs=trainer_sampled, sampler_logprobs=sampled,
                                                   mask=mask), weight=mask.sum().item())  # token means, all ranks
    if cfg.tis_cap > 0:
        batch["tis_weights"] = tis_weights(old_logprobs=trainer_sampled, sampler_logprobs=sampled, cap=cfg.tis_cap)
    if "returns" in batch:  # the critic's (either kind's) error on these fresh samples, before any update on them
        error = ((batch["old_values"] - batch["returns"]).abs() * mask).sum().item() / max(mask.sum().item(), 1)
        mismatch["value_error"] = dist.weighted_mean({"e": error}, weight=mask.sum().item())["e"]
    minibatch, plain = cfg.minibatch_size // dist.world(), cfg.prompts_per_iter * cfg.samples_per_prompt // dist.world()
    steps = 0  # the paper: minibatches of minibatch_size
    if batch["response_mask"].shape[0] > plain:  # --resample-silent grew the batch: the plain batch's steps
        steps = plain_steps(episodes=plain, minibatch=minibatch, micro=cfg.micro_batch_size)
    stats = ppo_update(scorer, optimizer, scheduler, batch, P, groups=groups, epochs=cfg.epochs,
                       minibatch_size=minibatch, minibatches_per_epoch=steps,
                       clip=cfg.clip, kl_coef=cfg.kl_coef, temperature=cfg.temperature,
                       max_grad_norm=cfg.max_grad_norm, vf_coef=cfg.vf_coef, value_clip=cfg.value_clip)
    return {**stats, **mismatch}
