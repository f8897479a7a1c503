"""Curves from one or more runs' metrics.jsonl: train reward, test accuracy, KL to the reference and tokens/s,
against iteration (top row) and against training wall-clock (bottom row).

    python plot.py runs/arith-vine-k9-s0/metrics.jsonl runs/arith-grpo-k9-s0/metrics.jsonl --out curves.png
"""
import argparse
import json
from pathlib import Path

PANELS = (("reward_mean", "train reward"), ("eval_accuracy", "test pass@1"), ("kl_ref", "KL to reference"),
          ("tokens_per_s", "sampled tokens / s"))


def read_metrics(path: str) -> list[dict]:
    records = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            raise SystemExit(f"error: {path}:{number}: not a JSON line") from None
    return records


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


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("metrics", nargs="+", help="metrics.jsonl files")
    parser.add_argument("--out", default="curves.png", help="PNG to write")
    parser.add_argument("--labels", default=None, help="comma-separated legend labels (default: run folder names)")
    args = parser.parse_args()
    for path in args.metrics:
        if not Path(path).is_file():
            raise SystemExit(f"error: {path}: no such metrics file")
    labels = args.labels.split(",") if args.labels else None
    if labels and len(labels) != len(args.metrics):
        raise SystemExit(f"error: --labels has {len(labels)} names for {len(args.metrics)} files")
    print(plot_runs(args.metrics, args.out, labels))


if __name__ == "__main__":
    main()
