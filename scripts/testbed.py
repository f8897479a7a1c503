"""The laptop testbed: a tiny model trained from scratch on the compact chain task, then RL with every estimator at
the paper's batch size, through the same train.py as the real runs.

    python -m scripts.testbed                        SFT, then one seed of each of DEFAULT's arms (18 min, 2 cores)
    python -m scripts.testbed --seeds 0,1,2,3,4      the grid (restartable: finished runs are skipped)
    python -m scripts.testbed --redraw               only the summary and the pictures from the finished runs
    python -m scripts.testbed --out research/testbed/results/testbed  the committed reference grid (default runs/testbed: outside git)

1. SFT (sft.py SFT_SETTINGS, once, into OUT/sft): a 1M-parameter Llama with a character tokenizer, from random
   weights, on `chain` (arith's problems written compactly: "13 *3 -3 -30 -4" -> "13*3=39\\n...\\n####2"), stopped
   while its pass@1 is moderate, so that RL has room above it.
2. RL (train.py SETTINGS + the estimator's flags) from that model, its reference too: 64 prompts x 8 samples an
   iteration (the paper's 512 episodes), the same number of iterations for every estimator, greedy pass@1 on the 500
   test problems every EVAL_EVERY iterations.
Each run is a folder OUT/<estimator>-s<seed> (metrics.jsonl; start.json, the sha256 of the SFT weights it started
from; its checkpoint, not committed, lets a cut run resume). A run counts as done only if it started from OUT/sft's
model: one made from another is a one-line error, never reused.
--jobs N runs N cells at once, each on one thread (the tiny model's ops are too small to share out): 2 on a 2-core
machine; each run's wall-clock is then measured beside one other run (recorded in machine.json).
Then OUT/results.md, results.json and curves.png over every finished run: pass@1 against iterations and against
training minutes (mean +- SE over seeds), test pass@1 against train reward, and the paired differences to vine;
printed after it, this invocation's runs and the committed reference grids (REFERENCES) beside them.
DEFAULT, the one command's arms: vine (K = 9), vine-free (free samples, topup), the paper's PPO (a separate critic),
grpo and rloo; any of ARMS by --estimators.
"""
import argparse
import time
from pathlib import Path

# the demo's command line: the recipe (TASK, SFT_SETTINGS, SETTINGS, ARMS) and the runner are the studies'
# research/grid.py, the summary research/summary.py
from research.grid import ARMS, OUT, SFT_SETTINGS, grid_arguments, grid_choices, run_cells, sft_stage, this_machine
from research.summary import summary
from runlog import read_metrics

DEFAULT = ["vine", "vine-free", "critic-separate", "grpo", "rloo"]  # the one command's arms, the longest first


def runs_table(folder: Path) -> str:
    """A markdown table of every run in `folder` (a sweep): its flags that differ from SETTINGS, pass@1 at each
    evaluation, end - start with the larger SE, train reward first and last 3 iterations, mean grad_cosine, final
    kl_ref, seconds an iteration."""
    lines = ["| run | flags | pass@1 at iterations | end - start | train reward (first 3 -> last 3) | "
             "grad_cosine (mean) | kl_ref (end) | s / it |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for run_dir in sorted(p for p in folder.iterdir() if (p / "metrics.jsonl").exists()):
        records = read_metrics(run_dir / "metrics.jsonl")
        evals = [r for r in records if "eval_accuracy" in r]
        trained = [r for r in records if r["iteration"] > 0]
        if len(evals) < 2 or len(trained) < 3:
            continue
        flags = (run_dir / "flags.txt").read_text().strip() if (run_dir / "flags.txt").exists() else ""
        cos = [r["grad_cosine"] for r in trained if "grad_cosine" in r]
        reward = [sum(r["reward_mean"] for r in part) / len(part) for part in (trained[:3], trained[-3:])]
        curve = " ".join(f"{r['iteration']}: {r['eval_accuracy']:.3f}" for r in evals)
        lines.append(f"| {run_dir.name} | `{flags}` | {curve} | "
                     f"{evals[-1]['eval_accuracy'] - evals[0]['eval_accuracy']:+.3f} ± "
                     f"{max(evals[0]['eval_se'], evals[-1]['eval_se']):.3f} | {reward[0]:.3f} -> {reward[1]:.3f} | "
                     f"{sum(cos) / max(len(cos), 1):.3f} | {trained[-1].get('kl_ref', 0):.2e} | "
                     f"{trained[-1]['train_seconds'] / len(trained):.1f} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    grid_arguments(parser, arm="estimator", arms=ARMS, out=OUT, default=DEFAULT)
    parser.add_argument("--table", default=None, help="run nothing: print a table of the runs in this folder (a sweep)")
    args, extra = parser.parse_known_args()  # anything else goes to train.py
    estimators, seeds = grid_choices(args, arm="estimator", arms=ARMS)
    if args.table:
        return print(runs_table(Path(args.table)))
    out, started, ran = Path(args.out), time.time(), []
    out.mkdir(parents=True, exist_ok=True)
    if not args.redraw:
        sft_dir, _ = sft_stage(out, settings=SFT_SETTINGS)  # once; resumed if it was cut off
        cells = [(e, s) for s in seeds for e in estimators]
        ran = run_cells(cells, out=out, sft_dir=sft_dir, extra=extra, jobs=args.jobs, machine=this_machine(), arms=ARMS)
    print("\n".join(summary(out, started=None if args.redraw else started, extra=extra, ran=ran, arms=ARMS)))


if __name__ == "__main__":
    main()
