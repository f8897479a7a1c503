"""One-command laptop replication on `arith`: estimators x seeds, identical settings, the same training wall-clock.

    python -m research.replication.replicate --pipeline --budget 1200 --seeds 0,1,2,3      (the paper's pipeline: SFT, then RL)
    python -m research.replication.replicate --pipeline --no-sft-lr-decay --budget 900 --seeds 0,1,2,3   (SFT at a constant lr)
    python -m research.replication.replicate --budget 1200 --seeds 0,1,2 --out research/replication/results/replication      (one-operation arith, no SFT)

--pipeline is the paper's setting at laptop scale: the instruct model is first fine-tuned on the worked solutions of
PIPELINE_OPS-operation arith (sft.py with SFT_SETTINGS, once, into OUT/sft; the sha256 of its weights goes into every
cell's machine.json, so a block is only continued from the same SFT model), and every RL run starts from it (its
reference model too) on the same task, where what is left to learn is spread over the steps.

Runs train.py once per (estimator, seed) with identical settings but the estimator's own flags (ESTIMATORS), each
stopped after --budget seconds of training (evaluation excluded). Restartable run by run: a run whose final metrics
exist is skipped, one that was cut off resumes from its last checkpoint (written with each evaluation), so the grid
can be spread over several sittings. Each seed is a block run on one machine (recorded in each run's machine.json):
a budget of wall-clock buys different work on another CPU or dtype, so a seed begun on one machine is not continued
on another (start a new seed there), and estimators are compared within a block. Then summarizes every finished run
in --out (not only this invocation's) into it: curves.png and runs.png (research/readout.py), results.md
and results.json (one row per run, and the summary over seeds from readout.summarize_grid), and with --extras the
value-error diagnostic on a critic run (scripts/diagnose.py, with the adaptive-K rule of `vine-adaptive`) and the
credit-assignment picture of a VinePPO run (scripts/visualize.py), each on the first run of its estimator that still
has its checkpoint here. `--redraw` runs nothing and only summarizes, as a grid spread over sittings needs between them.
"""
import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from research.grid import ESTIMATORS, ROOT, describe, record_machine, sft_stage, this_machine
from research.readout import plot_bands, plot_runs, summarize, summarize_grid, summary_markdown, table
from runlog import read_metrics

SETTINGS = ["--dataset", "arith", "--prompts-per-iter", "4", "--samples-per-prompt", "4", "--max-new-tokens", "96",
            "--lr", "2e-5", "--no-lr-decay", "--value-lr", "1e-4", "--minibatch-size", "8", "--micro-batch-size", "8",
            "--eval-size", "200", "--eval-samples", "4", "--eval-every-seconds", "120", "--eval-every", "1000",
            "--save-every", "1000", "--iterations", "400", "--warmup-ratio", "0.005", "--sampler", "hf"]
# Evaluated (and checkpointed) every 2 minutes of training, so that every estimator is measured at the same times
# whatever its speed. --iterations only has to lie beyond what the budget allows; its warmup of 0.5% of 400 x 4
# optimizer steps is the 8 steps of the grid's first runs (3% of 60 x 4), which evaluated every 4 iterations instead.
PIPELINE_OPS = 4
SFT_SETTINGS = ["--dataset", "arith", "--arith-ops", str(PIPELINE_OPS), "--max-steps", "60", "--lr", "5e-5",
                "--batch-size", "16", "--eval-size", "200", "--eval-samples", "4", "--max-new-tokens", "128"]
# 60 steps of 16 at lr 5e-5 (3% warmup, linear decay): research/replication/pipeline.md has the calibration (pass@1 after SFT in the
# 25-60% band, first errors spread over the steps). RL on the same task, from the SFT'd model, with room for the
# longer worked solutions, and a cheaper evaluation with a smaller standard error than SETTINGS' 200 x 4 every 2
# minutes (which took 126 s after SFT, and had SE 0.031): all 500 test problems, one sample each (~100 s, SE ~0.022),
# every 5 minutes. And a smaller learning rate: the one-operation grid's 2e-5 wrecked the SFT model (its entropy is
# ~0.03 nats a token): pass@1 0.572 -> 0.192 after 4 vine iterations, kl_ref 0.41 by the 7th
# (research/replication/results/pipeline-lr2e-5/vine-s0). The paper's RL runs use 1e-6; 3e-6 here, for a 15-minute budget.
PIPELINE_SETTINGS = ["--arith-ops", str(PIPELINE_OPS), "--max-new-tokens", "128", "--eval-size", "500",
                     "--eval-samples", "1", "--eval-every-seconds", "300", "--lr", "3e-6"]


def run_state(run_dir: Path, *, budget: float) -> str:
    """"done": the run's metrics end with a final evaluation at or past the budget (or at the last iteration), which
    a clean checkout of the committed metrics alone shows; "resume": cut off, but a checkpoint exists; "fresh":
    nothing usable (start over, --overwrite)."""
    records = read_metrics(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").exists() else []
    last = records[-1] if records else {}
    iterations = int(SETTINGS[SETTINGS.index("--iterations") + 1])
    if "eval_accuracy" in last and (last.get("train_seconds", 0) >= budget or last.get("iteration") == iterations):
        return "done"
    return "resume" if (run_dir / "latest").exists() else "fresh"


def seed_machine(out: Path, seed: int) -> dict | None:
    """The machine a seed's block of runs is on: the one recorded by its first run (machine.json), else None."""
    recorded = sorted(out.glob(f"*-s{seed}/machine.json"))
    first = json.loads(recorded[0].read_text()) if recorded else None
    return {k: v for k, v in first.items() if k != "resumes"} if first else None


def block_seeds(out: Path) -> list[int]:
    """The seeds that have a block of runs in out (a cell folder with its machine.json)."""
    names = [p.parent.name.rsplit("-s", 1)[-1] for p in out.glob("*-s*/machine.json")]
    return sorted({int(n) for n in names if n.isdigit()})


def cell_dir(out: Path, estimator: str, seed: int) -> Path:
    """The folder of one cell of the grid: one estimator at one seed."""
    return out / f"{estimator}-s{seed}"


def run(name: str, seed: int, *, budget: float, out: Path, extra: list[str], machine: dict) -> Path | None:
    """Runs (or resumes) one cell of the grid; None when the cell belongs to a block on another machine (or, in the
    pipeline, from another SFT model)."""
    run_dir = cell_dir(out, name, seed)
    state = run_state(run_dir, budget=budget)
    if state == "done":
        print(f"{run_dir}: finished earlier, skipped", flush=True)
        return run_dir
    block = seed_machine(out, seed)
    if block is not None and block != machine:  # a wall-clock budget buys different work on another machine
        print(f"{run_dir}: not run here: seed {seed}'s runs are on {describe(block)}, this is {describe(machine)} "
              f"(start a new seed here instead)", flush=True)
        return None
    cmd = [sys.executable, "train.py", *SETTINGS, *ESTIMATORS[name], "--seed", str(seed), "--time-budget", str(budget),
           "--out-dir", str(run_dir), "--resume" if state == "resume" else "--overwrite", *extra]
    print("$", " ".join(cmd), flush=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    record_machine(run_dir, machine, resuming=state == "resume")
    if subprocess.run(cmd, cwd=ROOT).returncode != 0:
        raise SystemExit(f"error: the {name} run (seed {seed}) failed; see its output above")
    return run_dir


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", type=float, default=1200, help="training seconds per run")
    parser.add_argument("--seeds", default="0", help="comma-separated seeds")
    parser.add_argument("--estimators", default=None, help=f"comma-separated, of {list(ESTIMATORS)} (default: all; "
                                                           "with --pipeline vine,critic,grpo)")
    parser.add_argument("--pipeline", action="store_true",
                        help=f"SFT first, then RL from the SFT'd model on {PIPELINE_OPS}-operation arith (default "
                             "--out research/replication/results/pipeline, --estimators vine,critic,grpo)")
    parser.add_argument("--sft-lr-decay", action=argparse.BooleanOptionalAction, default=True,
                        help="--pipeline: the SFT stage's lr decays linearly to 0, sft.py's default; "
                             "--no-sft-lr-decay keeps it constant, the start RL can move (research/anneal/README.md; "
                             "default --out research/replication/results/pipeline-constant-lr)")
    parser.add_argument("--out", default=None, help="results folder (default research/replication/results/replication; with --pipeline "
                                                    "research/replication/results/pipeline)")
    parser.add_argument("--threshold", type=float, default=None, help="pass@1 whose time to reach is reported "
                        "(default 0.35; with --pipeline 0.65, three SEs above the SFT model's ~0.58)")
    parser.add_argument("--extras", action=argparse.BooleanOptionalAction, default=True,
                        help="also run scripts/diagnose.py on the critic run and scripts/visualize.py on the vine run")
    parser.add_argument("--redraw", action="store_true",
                        help="run nothing (no --extras either): only summarize and plot the finished runs in "
                             "--out")
    args, extra = parser.parse_known_args()  # anything else goes to train.py
    pipeline_out = "research/replication/results/pipeline" if args.sft_lr_decay else "research/replication/results/pipeline-constant-lr"
    out = Path(args.out or (pipeline_out if args.pipeline else "research/replication/results/replication"))
    sft_settings = SFT_SETTINGS + ([] if args.sft_lr_decay else ["--no-lr-decay"])
    args.threshold = args.threshold if args.threshold is not None else (0.65 if args.pipeline else 0.35)
    args.estimators = args.estimators or ("vine,critic,grpo" if args.pipeline else ",".join(ESTIMATORS))
    unknown = [e for e in args.estimators.split(",") if e not in ESTIMATORS]
    if unknown:
        raise SystemExit(f"error: --estimators: unknown {unknown} (choose from {list(ESTIMATORS)})")
    if not all(s.strip().isdigit() for s in args.seeds.split(",")):
        raise SystemExit(f"error: --seeds: expected comma-separated non-negative integers, got {args.seeds!r}")
    out.mkdir(parents=True, exist_ok=True)
    started, rows, dirs, runs = time.time(), [], [], {}  # runs: estimator -> seed -> its metrics
    machine, machines = this_machine(), {}  # machines: seed -> the machine its block ran on
    seeds = [int(s) for s in args.seeds.split(",")]
    if args.pipeline and not args.redraw:
        sft_dir, machine["sft_sha256"] = sft_stage(out, settings=sft_settings)
        extra = [*PIPELINE_SETTINGS, "--model", str(sft_dir), *extra]
    elif args.pipeline:
        extra = [*PIPELINE_SETTINGS, "--model", str(out / "sft"), *extra]
    for seed in [] if args.redraw else seeds:
        for estimator in args.estimators.split(","):
            run(estimator, seed, budget=args.budget, out=out, extra=extra, machine=machine)
    for seed in sorted(set(seeds) | set(block_seeds(out))):  # the summary: every finished run in --out
        for estimator in ESTIMATORS:
            run_dir = cell_dir(out, estimator, seed)
            if run_state(run_dir, budget=args.budget) != "done":
                continue
            machines[seed] = seed_machine(out, seed)
            records = read_metrics(run_dir / "metrics.jsonl")
            dirs.append(run_dir)
            rows.append(summarize(records, estimator, seed))
            runs.setdefault(estimator, {})[seed] = records
    if not rows:
        raise SystemExit("error: no finished run to summarize (runs of another machine's block are not run here)")
    summary = summarize_grid(runs, budget=args.budget, threshold=args.threshold)
    plot_bands(runs, str(out / "curves.png"), budget=args.budget)
    plot_runs([str(d / "metrics.jsonl") for d in dirs], str(out / "runs.png"), [d.name for d in dirs])
    blocks = "; ".join(f"seed {seed}: {describe(m)}" for seed, m in machines.items())
    text = sft_summary(out / "sft", settings=sft_settings) if args.pipeline else ""
    text += (f"Budget {args.budget:.0f} s of training per run; settings: `{' '.join(SETTINGS + extra)}`.\n"
            f"Each seed's runs share one machine (machine.json in each run's folder): {blocks}.\n"
            f"Compute of the grid: {sum(r['wall_minutes'] for r in rows):.0f} min of wall time summed over its runs "
            f"(their own clocks, evaluations included), {sum(r['train_minutes'] for r in rows):.0f} min of it "
            f"training; this invocation {(time.time() - started) / 60:.0f} min.\n\n"
            f"{summary_markdown(summary, threshold=args.threshold)}\n\nPer run:\n\n{table(rows)}\n")
    (out / "results.md").write_text(text)
    (out / "results.json").write_text(json.dumps({"budget": args.budget, "settings": SETTINGS + extra, "runs": rows,
                                                  "summary": summary}, indent=1))
    print(text)
    if args.extras and not args.redraw:  # --redraw runs nothing, the diagnostics neither
        adaptive = ESTIMATORS["vine-adaptive"]
        rule = f"adaptive:{adaptive[adaptive.index('--k-ci') + 1]}"  # the grid's adaptive-K point in the diagnostic
        for estimator, script, flag, options in (
                ("critic", "scripts.diagnose", "--checkpoint", ["--rules", rule, "--out", str(out / "diagnostics")]),
                ("vine", "scripts.visualize", "--model", ["--out", str(out / "credit")])):
            ckpt = latest_checkpoint([cell_dir(out, estimator, seed) for seed in runs.get(estimator, {})])
            if ckpt is None:  # checkpoints are not committed: a clean checkout only has the metrics
                print(f"--extras: no {estimator} run with a checkpoint here; {script} skipped", flush=True)
                continue
            subprocess.run([sys.executable, "-m", script, flag, str(ckpt), *options], cwd=ROOT, check=True)


def sft_summary(sft_dir: Path, *, settings: list[str] = SFT_SETTINGS) -> str:
    """A line on the pipeline's SFT stage from its metrics.jsonl: steps, minutes, pass@1 before and after, and where
    the wrong samples' first wrong line fell."""
    if not (sft_dir / "metrics.jsonl").exists():
        return "SFT stage: no metrics here.\n"
    records = read_metrics(sft_dir / "metrics.jsonl")
    evals = [r for r in records if "eval_accuracy" in r]
    last = records[-1]
    return (f"SFT stage (`sft.py {' '.join(settings)}`): {last['iteration']} steps, "
            f"{last.get('train_seconds', 0) / 60:.1f} min of training; pass@1 {evals[0]['eval_accuracy']:.3f} before, "
            f"{evals[-1]['eval_accuracy']:.3f} after; first wrong line of the wrong samples "
            f"{last.get('first_wrong_line', {})}.\n")


def latest_checkpoint(run_dirs: list[Path]) -> Path | None:
    """The final checkpoint of the first of run_dirs that still has one (its `latest` file names it), else None."""
    for run_dir in run_dirs:
        if (run_dir / "latest").exists():
            return run_dir / (run_dir / "latest").read_text().strip()
    return None


if __name__ == "__main__":
    main()
