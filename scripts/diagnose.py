"""Value-prediction error (the paper's Fig. 3): how close are VinePPO's K-sample MC values, and a PPO critic's
predictions, to the true value of a state under the same policy?

    python -m scripts.diagnose --checkpoint runs/arith-critic-k9-s0/ckpt-000020 --dataset arith --pairs 10

1. From test problems, sample a response with the checkpoint's policy, cut it at a step boundary (the parent state)
   and sample two continuations from there; the state after each one's first step is a *sibling*: two candidate
   next steps from the same parent. --screen N keeps only pairs with a state of intermediate value (its N
   screening continuations disagree), for a confident policy whose states are mostly worth 0 or 1. Steps are
   train.py's --step-split (default auto: the text rule), so each branching rule gets its own states.
2. Ground truth: V = mean reward of --ground-truth (256) continuations from each state.
3. Estimates: VinePPO with K in --ks (1, 3, 9), from fresh continuations; and, for a `--estimator critic` run's
   checkpoint, the critic's prediction: its critic/ folder (`--critic separate`, the paper's separate network) or
   its value_head.pt (`--critic head`, a head on the policy's trunk).
4. Report each estimator's mean absolute error (the MC one also in expectation: E|Binomial(K, V)/K - V|) and how
   often it orders the two siblings of a pair like the ground truth does (pairs whose true values differ by at least
   0.05). Writes value_error.json and value_error.png into --out.
"""
import argparse
import json
import math
import random
from functools import partial
from pathlib import Path

import torch

from ablations.adaptive_k import round_sizes
from ablations.branching import token_entropies
from ablations.critic_head import open_value_head
from critic import load_critic
from config import step_split_problem
from data import encode_prompt, load_split
from engine import HFSampler
from model import load_model, load_tokenizer, pick_dtype
from values import mc_rollouts, step_token_starts


def branch_starts(sample, context: list[int], *, tokenizer, dataset: str, split: str, model,
                  temperature: float) -> list[int]:
    """values.step_token_starts of a sampled piece (a response, or a continuation after `context`), with the
    sampler's log-probs and, for entropy:F, the policy's entropies."""
    entropies = token_entropies(model, context, sample.token_ids, temperature=temperature) \
        if split.startswith("entropy:") and sample.token_ids else None
    return step_token_starts(sample.token_ids, sample.text, tokenizer=tokenizer, task=dataset, split=split,
                             logprobs=sample.logprobs, entropies=entropies)


def sibling_states(sampler, tokenizer, examples, *, dataset: str, pairs: int, max_new_tokens: int, temperature: float,
                   top_p: float, seed: int, screen: int = 0, chunk: int = 16,
                   prompt_format: str = "chat", split: str = "auto") -> list[dict]:
    """Pairs of sibling states [{"prompt", "prefix", "answer", "pair"}], two per pair, from sampled responses, drawn
    `chunk` test problems at a time (one sampler call for their responses, one for the two continuations of each
    parent). With screen > 0, a pair is kept only if, of `screen` more continuations of each of its states, one
    state's are neither all right nor all wrong: it has an intermediate value. The screen's samples are not used
    again (the true values and the estimates come from fresh ones). split: where steps start (--step-split)."""
    cut = partial(branch_starts, tokenizer=tokenizer, dataset=dataset, split=split, temperature=temperature,
                  model=sampler.model if split.startswith("entropy:") else None)  # only entropy asks the model
    rng, states = random.Random(seed), []
    for c0 in range(0, len(examples), chunk):
        if len(states) >= 2 * pairs:
            break
        part = examples[c0:c0 + chunk]
        prompts = [encode_prompt(e["question"], grader=dataset, tokenizer=tokenizer, prompt_format=prompt_format)
                   for e in part]
        responses = sampler.sample(prompts, n=1, temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens,
                                   seed=seed + c0)
        parents = []  # (example, prompt, parent tokens): each response cut at one of its step boundaries
        for example, prompt, [response] in zip(part, prompts, responses):
            starts = cut(response, prompt)
            if len(starts) >= 2:
                parents.append((example, prompt, response.token_ids[:rng.choice(starts[:-1])]))
        continuations = sampler.sample_prefixes(
            [prompt + parent for _, prompt, parent in parents], [len(q) + len(p) for _, q, p in parents], n=2,
            temperature=temperature, top_p=top_p, max_new_tokens=[max_new_tokens - len(p) for _, _, p in parents],
            seed=seed + 10_000 + c0) if parents else []
        found = []  # (example, prompt, parent, [first step of each continuation])
        for (example, prompt, parent), pair in zip(parents, continuations):
            firsts = []
            for c in pair:
                c_starts = cut(c, prompt + parent)
                if len(c_starts) >= 2:
                    firsts.append(c.token_ids[:c_starts[1]])
            if len(firsts) == 2 and firsts[0] != firsts[1]:
                found.append((example, prompt, parent, firsts))
        if screen and found:
            sequences = [prompt + parent + first for _, prompt, parent, firsts in found for first in firsts]
            scores, _ = mc_rollouts(sampler=sampler, sequences=sequences, prefix_lens=[len(q) for q in sequences],
                                    prompt_lens=[len(prompt) for _, prompt, _, firsts in found for _ in firsts],
                                    answers=[e["answer"] for e, _, _, firsts in found for _ in firsts],
                                    grader=dataset, K=screen, temperature=temperature, top_p=top_p,
                                    max_new_tokens=max_new_tokens, seed=seed + 20_000 + c0)
            found = [f for i, f in enumerate(found) if any(0 < sum(v) < len(v) for v in scores[2 * i:2 * i + 2])]
        for example, prompt, parent, firsts in found[:pairs - len(states) // 2]:
            for first in firsts:
                states.append({"prompt": prompt, "prefix": parent + first, "answer": example["answer"],
                               "pair": len(states) // 2})
    return states


def expected_mc_error(value: float, K: int) -> float:
    """E|X/K - v| for X ~ Binomial(K, v): the mean absolute error of a K-sample MC value."""
    return sum(math.comb(K, x) * value ** x * (1 - value) ** (K - x) * abs(x / K - value) for x in range(K + 1))


@torch.no_grad()
def critic_values(model, value_head, states: list[dict]) -> list[float]:
    """The value head's V of each state: its prediction at the state's last token."""
    out = []
    for s in states:
        ids = torch.tensor([s["prompt"] + s["prefix"]])
        hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state[0, -1]
        out.append(value_head(hidden).item())
    return out


@torch.no_grad()
def separate_critic_values(critic, states: list[dict]) -> list[float]:
    """A separate critic's (critic.Critic) V of each state: its head on its own trunk's last hidden state."""
    out = []
    for s in states:
        ids = torch.tensor([s["prompt"] + s["prefix"]])
        hidden = critic.trunk(input_ids=ids, use_cache=False).last_hidden_state[0, -1]
        out.append(critic.head(hidden.float()).item())
    return out


def ranking_accuracy(estimates: list[float], truth: list[float], *, margin: float = 0.05) -> float | None:
    """Share of sibling pairs (consecutive states) ordered like the truth; ties count half. None if no pair."""
    scores = []
    for a in range(0, len(truth) - 1, 2):
        if abs(truth[a] - truth[a + 1]) >= margin:
            diff = (estimates[a] - estimates[a + 1]) * (truth[a] - truth[a + 1])
            scores.append(1.0 if diff > 0 else 0.5 if estimates[a] == estimates[a + 1] else 0.0)
    return sum(scores) / len(scores) if scores else None


def simulate_rule(pool: list[list[float]], *, k_mode: str, K: int, k_round: int = 3, k_max: int = 27,
                  k_ci: float = 0.5) -> list[list[float]]:
    """The rewards a vine-count rule (values.round_sizes) would see: each state's vines are read, in order, from its
    pool of fresh i.i.d. vine rewards, so every rule is measured on the same draws."""
    seen = [[] for _ in pool]
    while any(sizes := round_sizes(seen, k_mode=k_mode, K=K, k_round=k_round, k_max=k_max, k_ci=k_ci)):
        for r, p, n in zip(seen, pool, sizes):
            if len(r) + n > len(p):
                raise SystemExit(f"error: --pool {len(p)} is too small for {k_mode} (a state wants {len(r) + n})")
            r += p[len(r):len(r) + n]
    return seen


def rule_summary(seen: list[list[float]], truth: list[float]) -> dict:
    """V's MAE and bias, the MAE of sibling differences V(a) - V(b) (one next step's advantage over the other),
    sibling ranking accuracy, and vines per state."""
    est = [sum(r) / len(r) for r in seen]
    pairs = range(0, len(truth) - 1, 2)
    return {"mae": sum(abs(e - t) for e, t in zip(est, truth)) / len(truth),
            "bias": sum(e - t for e, t in zip(est, truth)) / len(truth),
            "advantage_mae": sum(abs((est[a] - est[a + 1]) - (truth[a] - truth[a + 1])) for a in pairs) / len(pairs),
            "ranking_accuracy": ranking_accuracy(est, truth), "vines_per_state": sum(map(len, seen)) / len(seen)}


def rule_knobs(rule: str) -> dict:
    """'fixed:9' -> k_mode fixed, K 9; 'adaptive:0.5' -> k_ci 0.5 (K 9 unused); 'budget:9'; 'official'."""
    mode, _, arg = rule.partition(":")
    return {"k_mode": mode, "K": 9, **({"k_ci": float(arg)} if mode == "adaptive" else {"K": int(arg)} if arg else {})}


def simulated_rules(truth: list[float], rules: list[str], *, repeats: int, pool: int, seed: int = 0) -> dict:
    """Each rule's summary averaged over `repeats` fresh pools of Bernoulli(V) vines, V = each state's measured true
    value: the expected errors of the rule on states like these, without the noise of one draw of vines."""
    rng, sums = random.Random(seed), {rule: {} for rule in rules}
    for _ in range(repeats):
        pools = [[float(rng.random() < v) for _ in range(pool)] for v in truth]
        for rule in rules:
            for k, v in rule_summary(simulate_rule(pools, **rule_knobs(rule)), truth).items():
                if v is not None:
                    sums[rule][k] = sums[rule].get(k, 0.0) + v / repeats
    return sums


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="a ckpt-* folder of train.py (or any model spec)")
    parser.add_argument("--dataset", default="arith", choices=["gsm8k", "math", "arith", "chain"])
    parser.add_argument("--prompt-format", default="chat", choices=["chat", "sft", "plain"],
                        help="as train.py's (plain for the testbed's from-scratch model)")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--arith-ops", type=int, default=1)
    parser.add_argument("--arith-max", type=int, default=20)
    parser.add_argument("--pairs", type=int, default=10, help="sibling pairs (states = 2 x pairs)")
    parser.add_argument("--screen", type=int, default=0, help="keep only pairs one of whose states has an "
                        "intermediate value in this many screening continuations (0: keep every pair)")
    parser.add_argument("--ground-truth", type=int, default=256, help="continuations per state for the true value")
    parser.add_argument("--ks", default="1,3,9", help="K values of the MC estimates")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="diagnostics")
    parser.add_argument("--rules", default="", help="vine-count rules to compare on one pool of fresh vines, e.g. "
                        "fixed:9,adaptive:0.5,budget:9,official (adaptive:CI uses --k-round 3, --k-max 27)")
    parser.add_argument("--step-split", default="auto", help="where a step starts, as train.py's --step-split (auto, "
                        "tokens:N, lowprob:P, entropy:F): the parents' cuts and the siblings' first steps")
    parser.add_argument("--pool", type=int, default=45, help="fresh vines per state that the rules draw from")
    parser.add_argument("--repeats", type=int, default=1000, help="simulated draws for the rules' expected errors")
    args = parser.parse_args()
    for name in ("pairs", "ground_truth", "max_new_tokens", "pool", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1 (got {getattr(args, name)})")
    if problem := step_split_problem(args.step_split):
        parser.error(f"--step-split {args.step_split!r}: {problem}")
    if args.screen < 0:
        parser.error(f"--screen must be 0 (off) or above (got {args.screen})")
    ks = sorted(int(k) for k in args.ks.split(","))
    tokenizer = load_tokenizer(args.checkpoint)
    model = load_model(args.checkpoint, device=torch.device("cpu"), dtype=torch.float32, frozen=True)
    sampler = HFSampler(model, tokenizer, dtype=pick_dtype("auto", torch.device("cpu")))  # bf16 where native
    examples = load_split(args.dataset, "test", data_dir=args.data_dir, arith_ops=args.arith_ops,
                          arith_max=args.arith_max)
    states = sibling_states(sampler, tokenizer, examples, dataset=args.dataset, prompt_format=args.prompt_format,
                            pairs=args.pairs,
                            max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                            seed=args.seed, screen=args.screen, split=args.step_split)
    rollout = dict(sampler=sampler, sequences=[s["prompt"] + s["prefix"] for s in states],
                   prefix_lens=[len(s["prompt"]) + len(s["prefix"]) for s in states],
                   prompt_lens=[len(s["prompt"]) for s in states], answers=[s["answer"] for s in states],
                   grader=args.dataset, temperature=args.temperature, top_p=args.top_p,
                   max_new_tokens=args.max_new_tokens)
    truth_scores, _ = mc_rollouts(K=args.ground_truth, seed=args.seed + 1, **rollout)
    mc_scores, _ = mc_rollouts(K=max(ks), seed=args.seed + 2, **rollout)  # fresh samples, independent of the truth
    truth = [sum(s) / len(s) for s in truth_scores]
    estimates = {f"vine K={k}": [sum(s[:k]) / k for s in mc_scores] for k in ks}
    critic_kind = None
    if (Path(args.checkpoint) / "critic").is_dir():  # --critic separate: its own network, loaded without code
        critic = load_critic(str(Path(args.checkpoint) / "critic"), device=torch.device("cpu"), dtype=torch.float32)
        critic_kind, estimates["critic"] = "separate", separate_critic_values(critic, states)
    elif (Path(args.checkpoint) / "value_head.pt").exists():  # --critic head
        head = open_value_head(model, source=Path(args.checkpoint))  # without running code, as train.py's resume
        critic_kind, estimates["critic"] = "head", critic_values(model, head, states)
    summary = {name: {"mae": sum(abs(e - t) for e, t in zip(est, truth)) / len(truth),
                      "ranking_accuracy": ranking_accuracy(est, truth)} for name, est in estimates.items()}
    for k in ks:
        summary[f"vine K={k}"]["expected_mae"] = sum(expected_mc_error(t, k) for t in truth) / len(truth)
    if args.rules:
        pool, _ = mc_rollouts(K=args.pool, seed=args.seed + 3, **rollout)  # independent of truth and of mc_scores
        for rule in args.rules.split(","):
            summary[f"rule {rule}"] = rule_summary(simulate_rule(pool, **rule_knobs(rule)), truth)
        expected = simulated_rules(truth, args.rules.split(","), repeats=args.repeats, pool=args.pool, seed=args.seed)
        summary.update({f"rule {rule} (expected)": row for rule, row in expected.items()})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"checkpoint": args.checkpoint, "critic": critic_kind, "step_split": args.step_split,
              "states": len(states), "ground_truth_samples": args.ground_truth,
              "summary": summary, "per_state": [{"pair": s["pair"], "truth": t, **{n: e[i] for n, e in estimates.items()}}
                                                for i, (s, t) in enumerate(zip(states, truth))]}
    (out / "value_error.json").write_text(json.dumps(report, indent=1))
    title = f"{len(states)} states (--step-split {args.step_split}), truth = {args.ground_truth} samples"
    plot_summary({n: r for n, r in summary.items() if not n.endswith("(expected)")}, out / "value_error.png",
                 title=title)  # with each rule's error on its one draw of vines
    if args.rules:
        plot_rules({n: r for n, r in summary.items() if n.endswith("(expected)")}, out / "rules.png",
                   title=f"{title}; each rule's expected error over {args.repeats} simulated draws")
    for name, row in summary.items():
        rank = "n/a" if row["ranking_accuracy"] is None else f"{row['ranking_accuracy']:.2f}"
        extra = f" (expected {row['expected_mae']:.3f})" if "expected_mae" in row else ""
        extra += "".join(f"  {k} {row[k]:.3f}" for k in ("advantage_mae", "bias", "vines_per_state") if k in row)
        print(f"{name:10s} MAE {row['mae']:.3f}{extra}  sibling ranking accuracy {rank}")
    print(f"wrote {out / 'value_error.json'} and {out / 'value_error.png'}")


def plot_summary(summary: dict, path: Path, *, title: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(summary)
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    colours = ["#c0504d" if n == "critic" else "#4c9a5b" for n in names]  # critic red, MC estimates green
    left.bar(names, [summary[n]["mae"] for n in names], color=colours)
    left.set_title("mean absolute error of V (lower is better)")
    right.bar(names, [summary[n]["ranking_accuracy"] or 0 for n in names], color="#5b7bb4")
    right.axhline(0.5, color="gray", linestyle="--", linewidth=1)
    right.set_title("sibling steps ranked right (higher is better)")
    right.set_ylim(0, 1)
    for axis in (left, right):
        axis.tick_params(axis="x", labelrotation=25, labelsize=8)  # long names ("rule adaptive:0.45") overlap flat
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_rules(summary: dict, path: Path, *, title: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    for ax, key in zip(axes, ("advantage_mae", "mae")):
        for name, row in summary.items():
            ax.scatter(row["vines_per_state"], row[key], color="#4c9a5b" if "fixed" in name else "#c0504d")
            ax.annotate(name.removeprefix("rule ").removesuffix(" (expected)"), (row["vines_per_state"], row[key]),
                        fontsize=7)
        ax.set_xlabel("vines per state")
        ax.set_title({"advantage_mae": "MAE of sibling difference V(a) - V(b)", "mae": "MAE of V"}[key])
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
