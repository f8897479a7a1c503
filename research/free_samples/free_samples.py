"""Vines for less: the group's own rollouts as free samples of each state's value (--free-samples), on the testbed.

    python -m research.free_samples.free_samples --seeds 0,1,2,3,4     the grid (restartable: finished runs are skipped)
    python -m research.free_samples.free_samples --redraw              only the summary from the finished runs
    python -m research.free_samples.free_samples --values              Fig. 3 for the free-sample variants on the SFT model

Every arm is train.py with the testbed's settings (research/grid.py SETTINGS), from the testbed's SFT model
(--testbed/sft, made once if missing), seeds paired:
    vine        --estimator vine: K = 9 fresh vines at every state (the paper)
    vine-free   --estimator vine --free-samples topup: the responses of the same prompt that pass through a state are
                samples of its value (leave-one-out); fresh vines only where they fall short of K = 9
    grpo        --estimator grpo
Compared on three cost axes, paired with vine by seed: per iteration (mean pass@1 over the evaluations after 0), per
sampled token (rollout + vine tokens: what a GPU pays; pass@1 held between evaluations, averaged over the tokens up to
the costliest run's total) and per training wall-clock (the testbed summary). OUT/results.md, results.json,
curves.png. --values compares the value estimates themselves (values.estimate_values, as training calls it) against
a 256-vine truth on groups of 8 responses: K = 9 fresh, free + 9 fresh (add), free + top-up to 9 (topup).
"""
import argparse
from pathlib import Path

from research.free_samples.truth import sample_groups, true_values
from research.grid import ARMS as TESTBED_ARMS
from research.grid import OUT as TESTBED
from research.grid import SFT_SETTINGS, grid_arguments, grid_choices, sft_stage, truth_arguments, truth_choices
from research.readout import BATCH, area, mean_se, paired_cells, token_curve
from research.summary import arm_grid

OUT = "runs/free-samples"  # the default output, ignored by git (the committed grid: --out research/free_samples/results/free-samples)
ARMS = {"vine": ["--estimator", "vine"], "vine-free": TESTBED_ARMS["vine-free"],
        "grpo": ["--estimator", "grpo"],
        # added after the grid above: the paper's PPO (a separate critic; its value lr from
        # research/free_samples/results/free-samples/value-lr-sweep) and the head it replaces (testbed SETTINGS' value lr 1e-3)
        "critic-separate": ["--estimator", "critic", "--critic", "separate", "--value-lr", "1e-3"],
        "critic-head": ["--estimator", "critic", "--critic", "head"]}


def cost_table(runs: dict[str, dict[int, list[dict]]], *, baseline: str = "vine") -> str:
    """Per arm (runs: arm -> seed -> metrics, grid.done_runs), mean +- SE over seeds and paired with `baseline` by
    seed: mean pass@1 over the evaluations after iteration 0 (per iteration), mean pass@1 over sampled tokens (up to
    the costliest run's total), and the cost of an iteration: tokens sampled, vines, free samples per state, seconds."""
    curves = {arm: {seed: token_curve(records) for seed, records in by_seed.items()} for arm, by_seed in runs.items()}
    budget = max((c[-1][0] for by_seed in curves.values() for c in by_seed.values()), default=0.0)
    per_it = {arm: {s: sum(a for _, a in c[1:]) / len(c[1:]) for s, c in by_seed.items()}
              for arm, by_seed in curves.items()}
    per_tok = {arm: {s: area(c, minutes=budget) for s, c in by_seed.items()} for arm, by_seed in curves.items()}
    lines = [f"| arm | seeds | mean pass@1 per iteration | paired − {baseline} | mean pass@1 over sampled tokens "
             f"(to {budget:.1f} M) | paired − {baseline} | M tokens / iteration | vines / iteration | free / state | "
             "train s / iteration (no eval) |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for arm, by_seed in runs.items():
        cells = [cell for table in (per_it, per_tok)
                 for cell in paired_cells(table[arm], table.get(baseline, {}), is_baseline=arm == baseline)]
        trained = [[r for r in records if r["iteration"] > 0] for records in by_seed.values()]
        cost = [mean_se([sum(f(r) for r in t) / len(t) for t in trained])[0] for f in (
            lambda r: r.get("sampled_tokens", r["response_length"] * BATCH + r.get("vine_tokens", 0)) / 1e6,
            lambda r: r.get("vines", 0), lambda r: r.get("free_per_state", 0),
            lambda r: r["seconds"] - r.get("seconds_eval", 0.0))]  # training only, as the wall-clock axis
        lines.append(f"| {arm} | {len(by_seed)} | " + " | ".join(cells) +
                     f" | {cost[0]:.3f} | {cost[1]:.0f} | {cost[2]:.2f} | {cost[3]:.1f} |")
    return "\n".join(lines)


def value_errors(model_dir: Path, *, prompts: int, truth: int, seed: int) -> str:
    """Fig. 3 for free samples: groups of 8 responses to `prompts` train problems from the model (sample_groups);
    each response's state values from values.estimate_values with K = 9 fresh vines (off), free + 9 fresh (add) and
    free + top-up to 9 (topup), against the mean of `truth` fresh vines per distinct state. Mean absolute error over
    (response, state) pairs (all, and states of intermediate truth), siblings (two states after one parent) ordered
    like the truth where it differs by >= 0.05, and the fresh vines each variant sampled."""
    from ablations.free_samples import estimate_values
    sampler, batch, keys = sample_groups(model_dir, prompts=prompts, seed=seed)
    true = true_values(sampler, batch, keys, truth=truth, seed=seed + 1)
    distinct = sorted(true)
    children = {}  # parent state -> the distinct next states after it, and a response holding each
    for i, ks in enumerate(keys):
        for a, b in zip(ks, ks[1:]):
            children.setdefault(a, {}).setdefault(b, (i, ks.index(b)))
    lines = [f"{prompts} prompts x 8 responses, {sum(map(len, keys))} (response, state) pairs, {len(distinct)} "
             f"distinct states ({sum(0 < v < 1 for v in true.values())} of intermediate truth), truth from {truth} "
             "vines each.",
             "", "| estimate | fresh vines | MAE, all | MAE, intermediate truth | siblings ordered right |",
             "| --- | --- | --- | --- | --- |"]
    for mode in ("off", "add", "topup"):
        values, stats = estimate_values(sampler=sampler, K=9, seed=seed + 2, free_samples=mode, **batch)
        errors = [(abs(values[i][j] - true[k]), 0 < true[k] < 1) for i, ks in enumerate(keys) for j, k in enumerate(ks)]
        right = [(values[a[0]][a[1]] - values[b[0]][b[1]]) * (true[ka] - true[kb]) > 0
                 for kids in children.values() for (ka, a), (kb, b) in zip(list(kids.items()), list(kids.items())[1:])
                 if abs(true[ka] - true[kb]) >= 0.05]
        middle = [e for e, mid in errors if mid]
        lines.append(f"| {mode} | {stats['vines']} | {sum(e for e, _ in errors) / len(errors):.3f} | "
                     f"{sum(middle) / max(len(middle), 1):.3f} | {sum(right)}/{len(right)} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    grid_arguments(parser, arm="arm", arms=ARMS, out=OUT)
    parser.add_argument("--testbed", default=TESTBED, help="the testbed's folder: its SFT model, in sft/ "
                        "(made there if missing)")
    parser.add_argument("--values", action="store_true", help="run nothing else: Fig. 3 for the free-sample "
                        "variants on the SFT model (--prompts groups of 8, --truth vines per state)")
    truth_arguments(parser, mode="values")  # --prompts, --truth
    args, extra = parser.parse_known_args()  # anything else goes to train.py
    arms, seeds = grid_choices(args, arm="arm", arms=ARMS)
    truth_choices(args)
    if args.values:
        text = value_errors(sft_stage(Path(args.testbed), settings=SFT_SETTINGS)[0], prompts=args.prompts,
                            truth=args.truth, seed=seeds[0])
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "values.md").write_text(text + "\n")
        return print(text)
    arm_grid(args, extra, arms=ARMS, chosen=arms, seeds=seeds, testbed=Path(args.testbed), baseline="vine",
             title="Three cost axes, paired with vine by seed (± SE over seeds)", table=cost_table)


if __name__ == "__main__":
    main()
