"""The read-out of the paper-regime grid (research.paper_regime.paper_regime): the paper's table at laptop scale, the paired gaps
between estimators on three cost axes, the silent groups, and the curves.

Each task folder holds the runs <arm>-s<seed> (metrics.jsonl, start.json, final.json) and sft/ (model.sha256,
plateau.json). Every comparison is paired by seed (the same prompts drawn in the same order):
    per iteration       mean greedy pass@1 over the evaluations after iteration 0 (3, 6, ..., 30)
    per sampled token   mean greedy pass@1, held between evaluations, over the tokens both runs of the pair sampled
                        (rollout + vine tokens: what a GPU pays); nothing is extrapolated past the cheaper run's end
    per wall-clock      the same over the training seconds both ran (evaluation excluded)
A difference is called where its mean is more than 2 SE (over seeds) from 0.
"""
import json
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from research.grid import done_runs, sft_digest  # noqa: E402
from research.readout import area, eval_curve, held, mean_se, pm, token_curve  # noqa: E402
from runlog import read_metrics  # noqa: E402

AXES = {"iteration": "per iteration", "tokens": "per sampled token", "minutes": "per wall-clock"}
PAIRS = [("vine", "critic"), ("vine", "grpo"), ("vine", "grpo-matched"), ("vine-free", "vine")]
PAPER_EVAL, GREEDY = "test T 0.35 x 16", "test greedy"  # final.json / plateau.json keys


def axis_curve(records: list[dict], axis: str) -> list[tuple[float, float]]:
    """(x, greedy pass@1) at every evaluation of a run; x: the iteration, millions of sampled tokens so far, or
    training minutes so far."""
    return token_curve(records) if axis == "tokens" else eval_curve(records, x=axis)


def iteration_mean(records: list[dict]) -> float:
    """A run's mean greedy pass@1 over its evaluations after iteration 0 (the per-iteration axis)."""
    trained = axis_curve(records, "iteration")[1:]
    return sum(a for _, a in trained) / len(trained)


def pair_gap(records: list[dict], base: list[dict], *, axis: str) -> float:
    """A run's pass@1 minus another's (same seed) on one axis: per iteration the difference of the means over the
    evaluations after 0; per token or minute the difference of the held curves' means up to the shorter run's end."""
    if axis == "iteration":
        return iteration_mean(records) - iteration_mean(base)
    mine, theirs = axis_curve(records, axis), axis_curve(base, axis)
    budget = min(mine[-1][0], theirs[-1][0])
    return area(mine, minutes=budget) - area(theirs, minutes=budget)


def gap_cell(values: list[float]) -> str:
    """mean ± SE (n), with '*' where the mean is more than 2 SE from 0."""
    if not values:
        return "–"
    mean, se = mean_se(values)
    return f"{pm(mean, se, len(values), signed=True)} ({len(values)}){' *' if len(values) > 1 and abs(mean) > 2 * se else ''}"


def task_summary(task_dir: Path, *, arms: dict[str, list[str]], pairs: list[tuple[str, str]] = PAIRS) -> dict:
    """One task's numbers: the plateau, per arm the final evaluations by seed and the silent-group shares (for
    --resample-silent before its fresh responses), and per pair (arm, base) and axis the paired gaps by seed."""
    runs, _ = done_runs(task_dir, arms=arms, start=sft_digest(task_dir / "sft"))
    finals = {arm: {seed: json.loads(p.read_text()) for seed in by_seed
                    if (p := task_dir / f"{arm}-s{seed}" / "final.json").exists()} for arm, by_seed in runs.items()}
    out = {"plateau": json.loads((task_dir / "sft" / "plateau.json").read_text()), "arms": {}, "gaps": {},
           "sft_validation": sft_validation(task_dir / "sft")}
    for arm, by_seed in runs.items():
        trained = {s: [r for r in records if r["iteration"] > 0] for s, records in by_seed.items()}
        per_seed = {s: {"final_paper": finals[arm][s][PAPER_EVAL][0] if s in finals[arm] else None,
                        "final_greedy": finals[arm][s][GREEDY][0] if s in finals[arm] else None,
                        "mean_greedy": iteration_mean(by_seed[s]),
                        "silent": sum(silent_share(r) for r in t) / len(t),
                        "silent_first": silent_share(t[0]),
                        "silent_found": sum(r.get("resample_found_frac", r.get("silent_found_frac", 0.0))
                                            for r in t) / len(t),
                        # with --resample-silent a group its fresh responses gave contrast has every response
                        # credited (0/1 rewards, not all equal: none is at the group's mean)
                        "silent_credited": sum(r.get("resample_found_frac", r.get("silent_credited_frac", 0.0))
                                               for r in t) / len(t),
                        "tokens": sum(r["sampled_tokens"] for r in t) / len(t) / 1e6,
                        "seconds": t[-1]["train_seconds"] / len(t)} for s, t in trained.items()}
        out["arms"][arm] = per_seed
    for arm, base in pairs:
        if arm in runs and base in runs:
            seeds = sorted(set(runs[arm]) & set(runs[base]))
            out["gaps"][f"{arm} − {base}"] = {axis: {s: pair_gap(runs[arm][s], runs[base][s], axis=axis) for s in seeds}
                                              for axis in AXES}
    return out


def sft_validation(sft_dir: Path, *, every: int = 200) -> list[tuple[int, float, float]]:
    """The SFT run's path to its plateau: (step, greedy validation pass@1, lr) every `every` steps and at its last
    check, from sft/metrics.jsonl (empty where it is not committed)."""
    path = sft_dir / "metrics.jsonl"
    checks = [r for r in read_metrics(path) if "validation_accuracy" in r] if path.exists() else []
    return [(r["iteration"], r["validation_accuracy"], r["lr"]) for r in checks
            if r["iteration"] % every == 0 or r is checks[-1]]


def silent_share(record: dict) -> float:
    """An iteration's share of groups without contrast as sampled: before --resample-silent's fresh responses."""
    return record.get("silent_before_frac", record["silent_frac"])


def over_seeds(per_seed: dict, key: str) -> tuple[float, float, int]:
    """Mean, SE and count over the seeds that have `key`."""
    values = [v[key] for v in per_seed.values() if v.get(key) is not None]
    return (*mean_se(values), len(values)) if values else (math.nan, math.nan, 0)


def markdown(summaries: dict[str, dict]) -> str:
    """results.md's tables from task_summary's numbers (summaries: task -> numbers)."""
    arms = list(dict.fromkeys(arm for s in summaries.values() for arm in s["arms"]))  # every task's, in order
    lines = ["The paper's table at laptop scale: test pass@1 from 16 samples per problem at T 0.35 (the paper's "
             "evaluation) of each run's last policy, mean ± SE over seeds; the SFT plateau ± SE over the 500 problems; "
             "'*': above the plateau by more than 2 SE over seeds. Greedy beside it.\n",
             "| task | SFT plateau | " + " | ".join(arms) + " |", "| --- " * (2 + len(arms)) + "|"]
    for task, s in summaries.items():
        plateau = s["plateau"][PAPER_EVAL]
        cells = []
        for per_seed in (s["arms"].get(arm) for arm in arms):
            if not per_seed:  # an arm with no finished run on this task
                cells.append("–")
                continue
            mean, se, n = over_seeds(per_seed, "final_paper")
            greedy = over_seeds(per_seed, "final_greedy")
            star = " *" if n > 1 and mean - plateau[0] > 2 * se else ""
            cells.append(f"{pm(mean, se, n)}{star} (greedy {greedy[0]:.3f})")
        lines.append(f"| {task} | {plateau[0]:.3f} ± {plateau[1]:.3f} (greedy {s['plateau'][GREEDY][0]:.3f}) | "
                     + " | ".join(cells) + " |")
    lines += ["", "Paired gaps in greedy pass@1 (mean ± SE over seeds, (seeds); '*': more than 2 SE from 0):", "",
              "| task | gap | " + " | ".join(AXES.values()) + " |", "| --- " * (2 + len(AXES)) + "|"]
    for task, s in summaries.items():
        for name, by_axis in s["gaps"].items():
            lines.append(f"| {task} | {name} | " + " | ".join(gap_cell(list(by_axis[a].values())) for a in AXES) + " |")
    if len(summaries) == 2:
        (easy, e), (hard, h) = summaries.items()
        lines += ["", f"Does a gap grow from {easy} to {hard}? ({hard} − {easy}, ± the two SEs combined; '*': more than "
                  f"2 SE from 0):", "",
                  "| gap | " + " | ".join(AXES.values()) + " |", "| --- " * (1 + len(AXES)) + "|"]
        for name in [n for n in e["gaps"] if n in h["gaps"]]:
            cells = []
            for axis in AXES:
                (me, se_e), (mh, se_h) = (mean_se(list(x["gaps"][name][axis].values())) for x in (e, h))
                star = " *" if abs(mh - me) > 2 * math.hypot(se_e, se_h) else ""
                cells.append(f"{mh - me:+.3f} ± {math.hypot(se_e, se_h):.3f}{star}")
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    paths = {task: s["sft_validation"] for task, s in summaries.items() if s.get("sft_validation")}
    if paths:
        steps = list(dict.fromkeys(step for path in paths.values() for step, _, _ in path))
        lines += ["", "The SFT start's path: greedy validation pass@1 (200 problems) at each step, lr beside it:", "",
                  "| task | " + " | ".join(map(str, steps)) + " |", "| --- " * (1 + len(steps)) + "|"]
        for task, path in paths.items():
            at = {step: f"{acc:.3f} ({lr:.1e})" for step, acc, lr in path}
            lines.append(f"| {task} | " + " | ".join(at.get(step, "–") for step in steps) + " |")
    lines += ["", "Per iteration (mean over iterations 1-30, then over seeds): groups without contrast (all right or all "
              "wrong) as sampled, at iteration 1, the share of them given contrast (a response with a nonzero "
              "advantage: vines, a critic, or with --resample-silent the fresh responses) and of their responses "
              "credited; the cost.", "",
              "| task | arm | silent groups | at iteration 1 | silent groups given contrast | silent responses credited | "
              "M tokens / iteration | train s / iteration (no eval) |", "| --- " * 8 + "|"]
    for task, s in summaries.items():
        for arm, per_seed in s["arms"].items():
            cells = [f"{over_seeds(per_seed, k)[0]:.{d}f}" for k, d in
                     (("silent", 2), ("silent_first", 2), ("silent_found", 2), ("silent_credited", 2), ("tokens", 3),
                      ("seconds", 1))]
            lines.append(f"| {task} | {arm} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def start_shift(starts: dict[str, Path], *, arms: list[str]) -> str:
    """How much the SFT start moves each arm: for two task folders of the same recipe built from different starts
    (starts: label -> folder; the second minus the first), per arm the seed-paired difference of the mean greedy
    pass@1 over iterations 1-30 and of the final 16 x T 0.35 pass@1 (mean ± SE over the seeds both hold), beside
    each start's plateau."""
    first, second = starts
    runs = {label: done_runs(d, arms={arm: [] for arm in arms}, start=sft_digest(d / "sft"))[0]
            for label, d in starts.items()}
    plateaus = {label: json.loads((d / "sft" / "plateau.json").read_text())[PAPER_EVAL] for label, d in starts.items()}
    shift = plateaus[second][0] - plateaus[first][0]
    lines = [f"Start {second} − start {first} (same recipe, SFT rebuilt; plateau 16 × T 0.35: {first} "
             f"{plateaus[first][0]:.3f}, {second} {plateaus[second][0]:.3f}, {shift:+.3f}), paired by seed:", "", "| arm | seeds | mean greedy pass@1, iterations 1-30 | final 16 × T 0.35 |",
             "| --- | --- | --- | --- |"]
    for arm in arms:
        seeds = sorted(set(runs[first].get(arm, {})) & set(runs[second].get(arm, {})))
        if not seeds:
            continue
        mean = {label: {s: iteration_mean(runs[label][arm][s]) for s in seeds} for label in starts}
        final = {label: {s: json.loads((d / f"{arm}-s{s}" / "final.json").read_text())[PAPER_EVAL][0] for s in seeds}
                 for label, d in starts.items()}
        cells = [gap_cell([x[second][s] - x[first][s] for s in seeds]) for x in (mean, final)]
        lines.append(f"| {arm} | {len(seeds)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_curves(task_dirs: dict[str, Path], *, arms: dict[str, dict[str, list[str]]], path: Path):
    """curves.png: per task (rows), greedy pass@1 against iterations, sampled tokens and training minutes (columns),
    mean ± SE over seeds, each arm drawn up to its shortest seed's end."""
    fig, axes = plt.subplots(len(task_dirs), len(AXES), figsize=(5 * len(AXES), 3.6 * len(task_dirs)), squeeze=False)
    for row, (task, task_dir) in enumerate(task_dirs.items()):
        runs, _ = done_runs(task_dir, arms=arms[task], start=sft_digest(task_dir / "sft"))
        for col, (axis, label) in enumerate(AXES.items()):
            ax = axes[row][col]
            for arm, by_seed in runs.items():
                curves = [axis_curve(records, axis) for records in by_seed.values()]
                end = min(c[-1][0] for c in curves)
                xs = [end * i / 100 for i in range(101)]
                stats = [mean_se([held(c, x) for c in curves]) for x in xs]
                ax.plot(xs, [m for m, _ in stats], label=f"{arm} ({len(curves)})")
                ax.fill_between(xs, [m - e for m, e in stats], [m + e for m, e in stats], alpha=0.2)
            ax.set_xlabel({"iteration": "iteration", "tokens": "M sampled tokens", "minutes": "training minutes"}[axis])
            ax.set_ylabel("greedy test pass@1")
            ax.set_title(f"{task}: {label}")
            ax.grid(alpha=0.3)
        axes[row][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(out: Path, *, arms: dict[str, dict[str, list[str]]], settings: list[str],
           pairs: list[tuple[str, str]] = PAIRS) -> str:
    """out/results.md, results.json and curves.png over the finished runs of each task's folder (arms: task -> its
    arms' train.py flags; pairs: the gaps (arm, base) to draw); returns results.md's text."""
    if not arms:
        raise SystemExit(f"error: {out}: no task folder with an SFT plateau (<task>/sft/plateau.json): nothing to "
                         f"summarise")
    task_dirs = {task: out / task for task in arms}
    summaries = {task: task_summary(d, arms=arms[task], pairs=pairs) for task, d in task_dirs.items()}
    text = (f"RL settings: `{' '.join(settings)}`; arms per task: "
            + "; ".join(f"{task}: " + ", ".join(f"{name} `{' '.join(flags)}`" for name, flags in by_arm.items())
                        for task, by_arm in arms.items()) + ".\n\n" + markdown(summaries) + "\n")
    (out / "results.md").write_text(text)
    (out / "results.json").write_text(json.dumps({"settings": settings, "arms": arms, "tasks": {
        task: {**s, "sft_sha256": sft_digest(task_dirs[task] / "sft")} for task, s in summaries.items()}}, indent=1))
    plot_curves(task_dirs, arms=arms, path=out / "curves.png")
    return text
