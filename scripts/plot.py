"""Curves from one or more runs' metrics.jsonl: train reward, test accuracy, KL to the reference and tokens/s,
against iteration (top row) and against training wall-clock (bottom row): research/readout.py's plot_runs, which
also draws a grid's curves over seeds (mean +- SE).

    python -m scripts.plot runs/arith-vine-k9-s0/metrics.jsonl runs/arith-grpo-k9-s0/metrics.jsonl --out curves.png
"""
import argparse
from pathlib import Path

from research.readout import plot_runs


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
