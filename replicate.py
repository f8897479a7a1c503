"""One-command laptop replication: VinePPO, PPO with a critic, and GRPO on `arith`, same seeds, same wall-clock.

    python replicate.py --budget 1200 --seeds 0 --out results/arith

Runs train.py once per (estimator, seed) with identical settings but --estimator, each stopped after --budget
seconds of training (evaluation excluded), then writes into --out: curves.png (plot.py), results.md and
results.json (the table: pass@1 before and after, best, iterations, minutes), and with --extras the value-error
diagnostic on the critic run (diagnose.py) and the credit-assignment picture of the VinePPO run (visualize.py).
"""
import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from plot import plot_runs, read_metrics

ESTIMATORS = ("vine", "critic", "grpo")
SETTINGS = ["--dataset", "arith", "--prompts-per-iter", "4", "--samples-per-prompt", "4", "--max-new-tokens", "96",
            "--lr", "2e-5", "--no-lr-decay", "--value-lr", "1e-4", "--minibatch-size", "8", "--micro-batch-size", "8",
            "--eval-size", "100", "--eval-samples", "4", "--eval-every", "4", "--save-every", "1000",
            "--iterations", "60", "--sampler", "hf"]  # 60 iterations: the budget ends every run first; 3% warmup


def run(estimator: str, seed: int, *, budget: float, out: Path, extra: list[str]) -> Path:
    run_dir = out / f"{estimator}-s{seed}"
    cmd = [sys.executable, "train.py", *SETTINGS, "--estimator", estimator, "--seed", str(seed),
           "--time-budget", str(budget), "--out-dir", str(run_dir), *extra]
    print("$", " ".join(cmd), flush=True)
    if subprocess.run(cmd, cwd=Path(__file__).parent).returncode != 0:
        raise SystemExit(f"error: the {estimator} run (seed {seed}) failed; see its output above")
    return run_dir


def summarize(run_dir: Path, estimator: str, seed: int) -> dict:
    records = read_metrics(run_dir / "metrics.jsonl")
    evals = [(r["iteration"], r["eval_accuracy"]) for r in records if "eval_accuracy" in r]
    trained = [r for r in records if r["iteration"] > 0]
    return {"estimator": estimator, "seed": seed, "iterations": trained[-1]["iteration"],
            "train_minutes": trained[-1]["train_seconds"] / 60, "start_pass1": evals[0][1], "final_pass1": evals[-1][1],
            "best_pass1": max(a for _, a in evals), "final_train_reward": sum(r["reward_mean"] for r in trained[-3:]) /
            len(trained[-3:]), "seconds_per_iteration": trained[-1]["train_seconds"] / len(trained)}


def table(rows: list[dict]) -> str:
    lines = ["| estimator | seed | iterations | train min | s / iteration | pass@1 start | pass@1 end | best | "
             "train reward (last 3) |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['estimator']} | {r['seed']} | {r['iterations']} | {r['train_minutes']:.1f} | "
                     f"{r['seconds_per_iteration']:.0f} | {r['start_pass1']:.3f} | {r['final_pass1']:.3f} | "
                     f"{r['best_pass1']:.3f} | {r['final_train_reward']:.3f} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", type=float, default=1200, help="training seconds per run")
    parser.add_argument("--seeds", default="0", help="comma-separated seeds")
    parser.add_argument("--estimators", default=",".join(ESTIMATORS))
    parser.add_argument("--out", default="results/arith")
    parser.add_argument("--extras", action=argparse.BooleanOptionalAction, default=True,
                        help="also run diagnose.py on the critic run and visualize.py on the vine run")
    args, extra = parser.parse_known_args()  # anything else goes to train.py
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started, rows, dirs = time.time(), [], []
    for seed in [int(s) for s in args.seeds.split(",")]:
        for estimator in args.estimators.split(","):
            run_dir = run(estimator, seed, budget=args.budget, out=out, extra=extra)
            dirs.append(run_dir)
            rows.append(summarize(run_dir, estimator, seed))
    plot_runs([str(d / "metrics.jsonl") for d in dirs], str(out / "curves.png"), [d.name for d in dirs])
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")),
               platform.processor() or platform.machine())
    machine = f"{cpu}, {os.cpu_count()} CPUs, torch {torch.__version__} with {torch.get_num_threads()} threads"
    text = (f"Budget {args.budget:.0f} s of training per run; settings: `{' '.join(SETTINGS + extra)}`.\n"
            f"Machine: {machine}. Total wall time {(time.time() - started) / 60:.0f} min.\n\n{table(rows)}\n")
    (out / "results.md").write_text(text)
    (out / "results.json").write_text(json.dumps({"budget": args.budget, "settings": SETTINGS + extra, "runs": rows},
                                                 indent=1))
    print(text)
    if args.extras:
        for estimator, script, flag, name in (("critic", "diagnose.py", "--checkpoint", "diagnostics"),
                                              ("vine", "visualize.py", "--model", "credit")):
            run_dir = next((d for d in dirs if d.name.startswith(estimator)), None)
            if run_dir is not None:
                ckpt = run_dir / (run_dir / "latest").read_text().strip()
                subprocess.run([sys.executable, script, flag, str(ckpt), "--out", str(out / name)],
                               cwd=Path(__file__).parent, check=True)


if __name__ == "__main__":
    main()
