"""The third start's read-out: the paper's K ablation on C, every gap measured on more than one start, and two of the
paper's claims over every committed hard- and easy-task run: test accuracy at matched train accuracy, and at matched
KL from the reference.

    python -m research.paper_regime.starts_report      starts.md, starts.json, generalisation.png, kl.png

Starts (folders of runs <arm>-s<seed> bound by start.json to the sft/model.sha256 beside them):
    A  research/paper_regime/results/paper-regime/<task>    the paper-regime grid's start
    B  research/vines_where/results/vines-where/<task>      the same recipe rebuilt on another CPU
    C  research/paper_regime/results/paper-regime/hard-c    the hard recipe with SFT seed 1 (third_start.py)
Every comparison is paired by seed (the same prompts in the same order), mean ± SE over seeds, '*' more than 2 SE
from 0. Two starts disagree on a gap where the difference of their means is more than 2 SE (the two SEs combined).
Generalisation and KL: at each evaluation (iterations 3, 6, ..., 30) a run's greedy test pass@1 beside its train
reward (reward_mean of that iteration: its 512 responses to train problems) or its kl_ref; a run's curve is binned
on that axis (BINS), and a pair's difference is the mean over the bins both runs reach.
"""
import json
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from research.grid import done_runs, sft_digest  # noqa: E402
from research.paper_regime.regime_report import AXES, PAPER_EVAL, gap_cell, pair_gap  # noqa: E402
from research.readout import mean_se  # noqa: E402

HERE = Path(__file__).resolve().parent
STARTS = {"hard": {"A": HERE / "results" / "paper-regime" / "hard",
                   "B": HERE.parent / "vines_where" / "results" / "vines-where" / "hard",
                   "C": HERE / "results" / "paper-regime" / "hard-c"},
          "easy": {"A": HERE / "results" / "paper-regime" / "easy",
                   "B": HERE.parent / "vines_where" / "results" / "vines-where" / "easy"}}
ARMS = ["vine", "vine-k3", "vine-k1", "vine-free", "critic", "grpo", "grpo-matched", "vine-silent", "grpo-resample"]
K_PAIRS = [("vine-k1", "critic"), ("vine", "vine-k3"), ("vine-k3", "vine-k1"), ("vine-k1", "grpo")]
GAPS = [("vine", "grpo"), ("vine", "critic"), ("vine", "grpo-matched"), ("vine-silent", "grpo-resample")]
BASELINES = ["critic", "grpo", "grpo-matched"]  # vine against each, at matched train reward and matched KL
BINS = {"reward": 0.05, "kl": 0.25}  # bin widths: train reward, log10 kl_ref


def load(folder: Path) -> dict[str, dict[int, list[dict]]]:
    """The finished runs of a start's folder made from its start: arm -> seed -> metrics."""
    if not (folder / "sft" / "model.sha256").exists():
        return {}
    return done_runs(folder, arms={arm: [] for arm in ARMS}, start=sft_digest(folder / "sft"))[0]


def paired(runs: dict, arm: str, base: str, axis: str) -> list[float]:
    """The seed-paired gaps arm − base on one axis (regime_report.pair_gap), over the seeds both have."""
    seeds = sorted(set(runs.get(arm, {})) & set(runs.get(base, {})))
    return [pair_gap(runs[arm][s], runs[base][s], axis=axis) for s in seeds]


def disagreement(gaps: dict[str, list[float]]) -> tuple[str, float, float] | None:
    """The pair of starts whose gaps differ most (in SEs): (their names, the difference, its combined SE)."""
    stats = {start: mean_se(values) for start, values in gaps.items() if len(values) > 1}
    pairs = [(a, b) for a in stats for b in stats if a < b]
    if not pairs:
        return None
    worst = max(pairs, key=lambda p: abs(stats[p[0]][0] - stats[p[1]][0]) / max(math.hypot(stats[p[0]][1],
                                                                                         stats[p[1]][1]), 1e-12))
    a, b = worst
    return f"{b} − {a}", stats[b][0] - stats[a][0], math.hypot(stats[a][1], stats[b][1])


def variance_shares(finals: dict[str, list[float]]) -> tuple[float, float, float] | None:
    """One arm's final pass@1 over starts (start -> its seeds' values): the variance between starts and within them
    (between seeds), by one-way random-effects moments: within = the mean of the starts' sample variances, between =
    the variance of the start means less within / n (n: seeds per start, their harmonic mean), floored at 0. Returns
    (between, within, between's share) or None with fewer than two starts of two seeds."""
    groups = [v for v in finals.values() if len(v) > 1]
    if len(groups) < 2:
        return None
    means = [sum(v) / len(v) for v in groups]
    within = sum(sum((x - m) ** 2 for x in v) / (len(v) - 1) for v, m in zip(groups, means)) / len(groups)
    grand = sum(means) / len(means)
    n = len(groups) / sum(1 / len(v) for v in groups)
    between = max(0.0, sum((m - grand) ** 2 for m in means) / (len(means) - 1) - within / n)
    return between, within, between / (between + within) if between + within > 0 else 0.0


def binned(records: list[dict], *, axis: str) -> dict[int, float]:
    """A run's greedy test pass@1 at its evaluations after iteration 0, binned by the iteration's train reward
    (axis "reward") or log10 kl_ref ("kl"): bin index -> mean pass@1 of the evaluations in it."""
    bins = {}
    for r in records:
        if r["iteration"] == 0 or "eval_accuracy" not in r or ("reward_mean" if axis == "reward" else "kl_ref") not in r:
            continue
        x = r["reward_mean"] if axis == "reward" else math.log10(max(r["kl_ref"], 1e-12))
        bins.setdefault(math.floor(x / BINS[axis]), []).append(r["eval_accuracy"])
    return {b: sum(v) / len(v) for b, v in bins.items()}


def matched_gap(mine: list[dict], theirs: list[dict], *, axis: str) -> float | None:
    """Test pass@1 of one run minus another's at matched train reward or KL: the mean difference over the bins both
    runs reach (None if none)."""
    a, b = binned(mine, axis=axis), binned(theirs, axis=axis)
    common = sorted(set(a) & set(b))
    return sum(a[k] - b[k] for k in common) / len(common) if common else None


def matched_table(folders: dict[str, dict], *, axis: str) -> tuple[list[str], dict]:
    """Per start folder and baseline, vine − baseline at matched train reward or KL, paired by seed."""
    lines, out = [], {}
    for label, runs in folders.items():
        for base in BASELINES:
            seeds = sorted(set(runs.get("vine", {})) & set(runs.get(base, {})))
            gaps = [g for s in seeds if (g := matched_gap(runs["vine"][s], runs[base][s], axis=axis)) is not None]
            if gaps:
                out[f"{label}: vine − {base}"] = gaps
                lines.append(f"| {label} | vine − {base} | {gap_cell(gaps)} |")
    return lines, out


def plot_matched(folders: dict[str, dict], *, axis: str, path: Path):
    """Test pass@1 against train reward (or kl_ref), per start folder (panels) and arm: every evaluation of every
    seed, the bins' means drawn as a line."""
    fig, axes = plt.subplots(1, len(folders), figsize=(5 * len(folders), 3.8), squeeze=False)
    for ax, (label, runs) in zip(axes[0], folders.items()):
        for arm, by_seed in runs.items():
            merged = {}
            for records in by_seed.values():
                for b, v in binned(records, axis=axis).items():
                    merged.setdefault(b, []).append(v)
            xs = sorted(merged)
            centre = [(b + 0.5) * BINS[axis] for b in xs]
            ax.plot([10 ** c for c in centre] if axis == "kl" else centre, [sum(merged[b]) / len(merged[b]) for b in xs],
                    marker=".", label=f"{arm} ({len(by_seed)})")
        ax.set_xscale("log" if axis == "kl" else "linear")
        ax.set_xlabel("train reward (iteration's mean)" if axis == "reward" else "KL from the reference (kl_ref)")
        ax.set_ylabel("greedy test pass@1")
        ax.set_title(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(out: Path, starts: dict[str, dict[str, Path]] = STARTS) -> str:
    """starts.md, starts.json, generalisation.png and kl.png over the finished runs of every start's folder."""
    runs = {task: {label: load(folder) for label, folder in by_start.items()} for task, by_start in starts.items()}
    lines, data = ["# The third start's read-out", ""], {"k": {}, "across": {}, "variance": {}}
    c = runs.get("hard", {}).get("C", {})
    lines += ["## K on start C (hard task)", "", "| gap | " + " | ".join(AXES.values()) + " |",
              "| --- " * (1 + len(AXES)) + "|"]
    for arm, base in K_PAIRS:
        gaps = {axis: paired(c, arm, base, axis) for axis in AXES}
        data["k"][f"{arm} − {base}"] = gaps
        lines.append(f"| {arm} − {base} | " + " | ".join(gap_cell(gaps[a]) for a in AXES) + " |")
    fig3 = starts.get("hard", {}).get("C", Path("-")) / "diagnostics-critic" / "value_error.json"
    if fig3.exists():  # scripts.diagnose on C's critic-s0: each estimator's error against 256-continuation truth
        summary = json.loads(fig3.read_text())["summary"]
        data["fig3"] = summary
        lines += ["", "Fig. 3 on C (scripts.diagnose on critic-s0's last checkpoint; MAE of V against the truth, "
                  "sibling pairs ordered right):", "", "| estimator | MAE | expected MAE (binomial) | siblings right |",
                  "| --- | --- | --- | --- |"]
        lines += [f"| {name} | {v['mae']:.3f} | {v['expected_mae']:.3f} | {v['ranking_accuracy']:.2f} |"
                  if "expected_mae" in v else f"| {name} | {v['mae']:.3f} | – | {v['ranking_accuracy']:.2f} |"
                  for name, v in summary.items()]
    lines += ["", "## Every gap on every start that has both arms", "",
              "| task | gap | axis | " + " | ".join(["A", "B", "C"]) + " | largest disagreement (± SE) |",
              "| --- " * 7 + "|"]
    for task, by_start in runs.items():
        for arm, base in GAPS:
            for axis in AXES:
                gaps = {label: paired(r, arm, base, axis) for label, r in by_start.items()}
                gaps = {label: g for label, g in gaps.items() if g}
                if len(gaps) < 2:
                    continue
                worst = disagreement(gaps)
                cell = "–" if worst is None else (f"{worst[0]}: {worst[1]:+.3f} ± {worst[2]:.3f}"
                                                  f"{' *' if abs(worst[1]) > 2 * worst[2] else ''}")
                data["across"][f"{task}: {arm} − {base} ({axis})"] = gaps
                lines.append(f"| {task} | {arm} − {base} | {AXES[axis]} | "
                             + " | ".join(gap_cell(gaps.get(label, [])) for label in ("A", "B", "C")) + f" | {cell} |")
    lines += ["", "## The final pass@1 (16 × T 0.35): between starts or between seeds?", "",
              "| task | arm | starts (seeds) | between starts (var) | between seeds (var) | share between starts |",
              "| --- " * 6 + "|"]
    for task, by_start in runs.items():
        for arm in ARMS:
            finals = {label: [json.loads((starts[task][label] / f"{arm}-s{s}" / "final.json").read_text())[PAPER_EVAL][0]
                              for s in r.get(arm, {}) if (starts[task][label] / f"{arm}-s{s}" / "final.json").exists()]
                      for label, r in by_start.items()}
            shares = variance_shares(finals)
            if shares:
                data["variance"][f"{task}: {arm}"] = {"finals": finals, "between": shares[0], "within": shares[1]}
                counts = ", ".join(f"{label} {len(v)}" for label, v in finals.items() if v)
                lines.append(f"| {task} | {arm} | {counts} | {shares[0]:.2e} | {shares[1]:.2e} | {shares[2]:.2f} |")
    folders = {f"{task} {label}": r for task, by_start in runs.items() for label, r in by_start.items() if r}
    for axis, title, name in (("reward", "at matched train reward (bins of 0.05)", "generalisation"),
                              ("kl", "at matched KL from the reference (bins of 0.25 in log10 kl_ref)", "kl")):
        table, data[name] = matched_table(folders, axis=axis)
        lines += ["", f"## Greedy test pass@1, vine − baseline {title}, paired by seed", "", f"![{name}]({name}.png)",
                  "", "| start | gap | mean ± SE (seeds) |", "| --- | --- | --- |", *table]
        plot_matched(folders, axis=axis, path=out / f"{name}.png")
    text = "\n".join(lines) + "\n"
    (out / "starts.md").write_text(text)
    (out / "starts.json").write_text(json.dumps(data, indent=1))
    return text


if __name__ == "__main__":
    print(report(HERE / "results" / "paper-regime"))
