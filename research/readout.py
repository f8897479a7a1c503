"""The read-out of finished runs that the studies share, from each run's metrics.jsonl alone (runlog.read_metrics), so
that a clean checkout redraws it: a run's curves (pass@1 against minutes or iterations, eval_curve; against tokens
sampled, token_curve), the statistics over seeds (held curves, mean +- SE, the area under pass@1 against time, paired
differences to a baseline: summarize_grid) and their tables, one row per run (summarize, table), and the
pictures (plot_runs: each run's curves, scripts/plot.py's; plot_bands: a grid's, mean +- SE over seeds).
"""
import math
from pathlib import Path

from runlog import read_metrics

# plot_runs' panels: each run's curves against iteration and against training wall-clock
PANELS = (("reward_mean", "train reward"), ("eval_accuracy", "test pass@1"), ("kl_ref", "KL to reference"),
          ("tokens_per_s", "sampled tokens / s"))
BATCH = 64 * 8  # responses an iteration (research/grid.py SETTINGS): token_curve's count for runs before sampled_tokens


def run_label(path: str) -> str:
    """The run's folder name, e.g. runs/arith-vine-k9-s0/metrics.jsonl -> arith-vine-k9-s0."""
    return Path(path).parent.name or path


def plot_runs(paths: list[str], out: str, labels: list[str] | None = None):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(2, len(PANELS), figsize=(4.2 * len(PANELS), 7), squeeze=False)
    for path, label in zip(paths, labels or [run_label(p) for p in paths]):
        records = read_metrics(path)
        for col, (key, title) in enumerate(PANELS):
            points = [(r["iteration"], r.get("train_seconds", 0.0) / 60, r[key]) for r in records if key in r]
            if not points:
                continue
            its, minutes, ys = zip(*points)
            axes[0][col].plot(its, ys, marker="o", markersize=3, label=label)
            axes[1][col].plot(minutes, ys, marker="o", markersize=3, label=label)
            axes[0][col].set_title(title)
    for col in range(len(PANELS)):
        axes[0][col].set_xlabel("iteration")
        axes[1][col].set_xlabel("training wall-clock (min)")
        for row in range(2):
            axes[row][col].grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def eval_curve(records: list[dict], x: str = "minutes") -> list[tuple[float, float]]:
    """(training minutes, pass@1) of every evaluation of a run, in order; x="iteration": (iteration, pass@1)."""
    return [(r.get("train_seconds", 0.0) / 60 if x == "minutes" else r["iteration"], r["eval_accuracy"])
            for r in records if "eval_accuracy" in r]


def token_curve(records: list[dict]) -> list[tuple[float, float]]:
    """(millions of tokens sampled so far, pass@1) at every evaluation: rollout + vine tokens of the iterations up to
    it (sampled_tokens; runs from before it was logged: response_length x BATCH + vine_tokens)."""
    out, total = [], 0.0
    for r in records:
        if r["iteration"] > 0:
            total += r["sampled_tokens"] if "sampled_tokens" in r else r["response_length"] * BATCH + r.get("vine_tokens", 0)
        if "eval_accuracy" in r:
            out.append((total / 1e6, r["eval_accuracy"]))
    return out


def reward_curve(records: list[dict], *, window: int = 5) -> list[tuple[float, float]]:
    """(train reward, test pass@1) at every evaluation after the first: the mean training reward of the `window`
    iterations up to it, against the pass@1 measured there (the paper's test-vs-train accuracy view)."""
    out, rewards = [], []
    for r in records:
        if "reward_mean" in r:
            rewards.append(r["reward_mean"])
        if "eval_accuracy" in r and rewards:
            out.append((sum(rewards[-window:]) / len(rewards[-window:]), r["eval_accuracy"]))
    return out


def held(curve: list[tuple[float, float]], t: float) -> float:
    """pass@1 at minute t: that of the last evaluation at or before t (the policy measured then)."""
    return next((a for m, a in reversed(curve) if m <= t + 1e-9), curve[0][1])


def mean_se(values: list[float]) -> tuple[float, float]:
    """Mean and standard error of the mean (sample standard deviation / sqrt(n); 0 for one value)."""
    n = len(values)
    mean = sum(values) / n
    return mean, (math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1) / n) if n > 1 else 0.0)


def pm(mean: float, se: float, n: int, *, signed: bool = False) -> str:
    """"0.714 ± 0.007" over n > 1 seeds; with one seed there is no spread to show: "0.714 ± –"."""
    text = f"{mean:+.3f}" if signed else f"{mean:.3f}"
    return f"{text} ± {se:.3f}" if n > 1 else f"{text} ± –"


def area(curve: list[tuple[float, float]], *, minutes: float) -> float:
    """Mean pass@1 over [0, minutes] of the held curve: the area under pass@1-vs-time divided by the time."""
    edges = [m for m, _ in curve if m < minutes] + [minutes]
    return sum(held(curve, a) * (b - a) for a, b in zip(edges, edges[1:])) / minutes


def time_to(curve: list[tuple[float, float]], threshold: float) -> float | None:
    """Training minutes of the first evaluation at or above `threshold`, or None if none was."""
    return next((m for m, a in curve if a >= threshold), None)


def summarize_grid(runs: dict[str, dict[int, list[dict]]], *, budget: float, threshold: float,
                   baseline: str = "vine") -> dict[str, dict]:
    """Per estimator, over its seeds' metrics (runs: estimator -> seed -> records): final pass@1 (mean, SE), its change
    from the run's own first evaluation (gain: final - start, mean, SE), best, mean pass@1 over the budget (area),
    minutes to reach `threshold` (mean over the seeds that did; how many did), KL to the reference at the end, seconds
    per iteration, seeds that collapsed (ended below half their starting pass@1), and the paired differences to `baseline` over the seeds both have: final and area minus the baseline's on the
    same seed (mean, SE), which cancels what a seed shares: its machine and its draw of prompts."""
    out, base = {}, {seed: eval_curve(records) for seed, records in runs.get(baseline, {}).items()}
    for name, seeds in runs.items():
        curves = {seed: eval_curve(records) for seed, records in seeds.items()}
        last = [[r for r in records if "kl_ref" in r][-1] for records in seeds.values()]
        reached = [t for t in (time_to(c, threshold) for c in curves.values()) if t is not None]
        final = mean_se([c[-1][1] for c in curves.values()])
        gain = mean_se([c[-1][1] - c[0][1] for c in curves.values()])
        area_of = {seed: area(c, minutes=budget / 60) for seed, c in curves.items()}
        areas = mean_se(list(area_of.values()))
        area_gain = mean_se([area_of[s] - c[0][1] for s, c in curves.items()])
        paired = [seed for seed in curves if seed in base]
        final_diff = mean_se([curves[s][-1][1] - base[s][-1][1] for s in paired]) if paired else (None, None)
        area_diff = mean_se([area_of[s] - area(base[s], minutes=budget / 60)
                             for s in paired]) if paired else (None, None)
        out[name] = {"seeds": len(seeds), "final": final[0], "final_se": final[1], "gain": gain[0], "gain_se": gain[1],
                     "best": mean_se([max(a for _, a in c) for c in curves.values()])[0],
                     "area": areas[0], "area_se": areas[1], "area_gain": area_gain[0], "area_gain_se": area_gain[1],
                     "minutes_to_threshold": sum(reached) / len(reached) if reached else None, "reached": len(reached),
                     "kl_ref": mean_se([r["kl_ref"] for r in last])[0],
                     "seconds_per_iteration": mean_se([r["train_seconds"] / r["iteration"] for r in last])[0],
                     "collapsed": sum(c[-1][1] < c[0][1] / 2 for c in curves.values()),
                     "paired": len(paired), "final_vs_baseline": final_diff[0], "final_vs_baseline_se": final_diff[1],
                     "area_vs_baseline": area_diff[0], "area_vs_baseline_se": area_diff[1]}
    return out


def summary_markdown(summary: dict[str, dict], *, threshold: float, baseline: str = "vine") -> str:
    lines = [f"| estimator | seeds | final pass@1 (mean ± SE) | final − start (± SE) | best (mean) | mean pass@1 over "
             f"time (± SE) | mean over time − start (± SE) | minutes to {threshold} (seeds that got there) | KL to ref at end | train s / iteration (no eval) | collapsed | final − {baseline}, "
             f"same seeds (± SE) | mean over time − {baseline} (± SE) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, s in summary.items():
        reach = f"{s['minutes_to_threshold']:.1f} ({s['reached']}/{s['seeds']})" if s["reached"] else f"never (0/{s['seeds']})"
        vs = ["–", "–"] if name == baseline or not s["paired"] else [
            f"{pm(s[k], s[k + '_se'], s['paired'], signed=True)} ({s['paired']})"
            for k in ("final_vs_baseline", "area_vs_baseline")]
        n = s["seeds"]
        lines.append(f"| {name} | {n} | {pm(s['final'], s['final_se'], n)} | "
                     f"{pm(s['gain'], s['gain_se'], n, signed=True)} | {s['best']:.3f} | "
                     f"{pm(s['area'], s['area_se'], n)} | {pm(s['area_gain'], s['area_gain_se'], n, signed=True)} | {reach} | {s['kl_ref']:.2e} | "
                     f"{s['seconds_per_iteration']:.0f} | {s['collapsed']} | {vs[0]} | {vs[1]} |")
    return "\n".join(lines)


def bands(runs: dict[str, dict[int, list[dict]]], *, budget: float, points: int = 201,
          x: str = "minutes") -> dict[str, list[tuple]]:
    """Per estimator, (x, mean, SE) over seeds of the held pass@1 curves, on one grid of training minutes (or of
    iterations, x="iteration"). Runs stop at the first iteration past the budget: on minutes the grid ends at the last
    final evaluation; on iterations each estimator's band ends where its shortest seed does."""
    curves_of = {name: [eval_curve(records, x) for records in seeds.values()] for name, seeds in runs.items()}
    out = {}
    for name, curves in curves_of.items():
        end = (max([budget / 60] + [c[-1][0] for cs in curves_of.values() for c in cs]) if x == "minutes"
               else min(c[-1][0] for c in curves))
        grid = [end * i / (points - 1) for i in range(points)]
        out[name] = [(t, *mean_se([held(c, t) for c in curves])) for t in grid]
    return out


def plot_bands(runs: dict[str, dict[int, list[dict]]], out: str, *, budget: float):
    """Three panels: test pass@1 against iterations and against training minutes (per estimator the mean over seeds
    of the held curves, +- one standard error), and test pass@1 against train reward (every evaluation of every
    seed; reward_curve)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for col, x in enumerate(("iteration", "minutes")):
        for name, band in bands(runs, budget=budget, x=x).items():
            grid, mean, se = zip(*band)
            line, = axes[col].plot(grid, mean, label=f"{name} ({len(runs[name])} seeds)")
            axes[col].fill_between(grid, [m - e for m, e in zip(mean, se)], [m + e for m, e in zip(mean, se)],
                                   alpha=0.2, color=line.get_color())
    for name, seeds in runs.items():
        points = [p for records in seeds.values() for p in reward_curve(records)]
        if points:
            axes[2].scatter(*zip(*points), s=10, alpha=0.6, label=name)
    for ax, label in zip(axes, ("iteration", "training wall-clock (min)", "train reward (mean of the last 5 "
                                                                         "iterations)")):
        ax.set_xlabel(label)
        ax.set_ylabel("test pass@1" + (" (mean ± SE over seeds)" if ax is not axes[2] else ""))
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def summarize(records: list[dict], estimator: str, seed: int) -> dict:
    """One row of the per-run table from a run's metrics. wall_minutes is the run's own clock (training and
    evaluations), so a --redraw reports the same figure as the invocation that ran it."""
    evals = [(r["iteration"], r["eval_accuracy"]) for r in records if "eval_accuracy" in r]
    trained = [r for r in records if r["iteration"] > 0]
    ses = [r["eval_se"] for r in records if "eval_se" in r]
    return {"estimator": estimator, "seed": seed, "iterations": trained[-1]["iteration"],
            "train_minutes": trained[-1]["train_seconds"] / 60,
            "wall_minutes": sum(r.get("seconds", r.get("seconds_eval", 0)) for r in records) / 60,
            "start_pass1": evals[0][1], "final_pass1": evals[-1][1], "best_pass1": max(a for _, a in evals),
            "eval_se": max(ses, default=None),
            "final_train_reward": sum(r["reward_mean"] for r in trained[-3:]) / len(trained[-3:]),
            "seconds_per_iteration": trained[-1]["train_seconds"] / len(trained)}


def table(rows: list[dict]) -> str:
    lines = ["| estimator | seed | iterations | train min | train s / iteration | pass@1 start | pass@1 end | best | "
             "largest SE of one evaluation | train reward (last 3) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        se = "–" if r.get("eval_se") is None else f"{r['eval_se']:.3f}"
        lines.append(f"| {r['estimator']} | {r['seed']} | {r['iterations']} | {r['train_minutes']:.1f} | "
                     f"{r['seconds_per_iteration']:.0f} | {r['start_pass1']:.3f} | {r['final_pass1']:.3f} | "
                     f"{r['best_pass1']:.3f} | {se} | {r['final_train_reward']:.3f} |")
    return "\n".join(lines)


def paired_cells(by_seed: dict[int, float], base: dict[int, float], *, is_baseline: bool) -> list[str]:
    """Two table cells: the mean +- SE over seeds of `by_seed` (one value per seed), and its paired difference to
    `base` on the seeds both have (mean +- SE of the per-seed differences, and how many); "–" for the baseline."""
    paired = [v - base[seed] for seed, v in by_seed.items() if seed in base]
    return [pm(*mean_se(list(by_seed.values())), len(by_seed)), "–" if is_baseline or not paired else
            f"{pm(*mean_se(paired), len(paired), signed=True)} ({len(paired)})"]


def signal_table(runs: dict[str, dict[int, list[dict]]]) -> str:
    """Per estimator: grad_cosine (the agreement of the two halves of the first minibatch's gradient) and the train
    reward of the first and last 3 iterations, each the mean over iterations, then mean +- SE over seeds."""
    lines = ["| estimator | grad_cosine | train reward, first 3 iterations | train reward, last 3 |",
             "| --- | --- | --- | --- |"]
    for name, seeds in runs.items():
        trained = [[r for r in records if r["iteration"] > 0] for records in seeds.values()]
        cos = mean_se([sum(r.get("grad_cosine", 0.0) for r in t) / len(t) for t in trained])
        first = mean_se([sum(r["reward_mean"] for r in t[:3]) / 3 for t in trained])
        last = mean_se([sum(r["reward_mean"] for r in t[-3:]) / 3 for t in trained])
        n = len(trained)
        lines.append(f"| {name} | {pm(*cos, n)} | {pm(*first, n)} | {pm(*last, n)} |")
    return "\n".join(lines)
