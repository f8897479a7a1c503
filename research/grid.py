"""The grid plumbing the studies share: the testbed's recipe every grid builds on (TASK, SFT_SETTINGS, SETTINGS,
ARMS), the arms, the machine a run ran on, the SFT stage a grid starts from, and the runner (run_grid: the cells not
done, `jobs` at a time, each bound to its SFT model; run_state, done_runs) with a grid's command-line flags. Each
study's own driver (research/<study>/) builds its cells from these; research/readout.py and research/summary.py read
the finished runs out; scripts/testbed.py is the testbed's quick demo on top of them.
"""
import argparse
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from checkpoint import weights_sha256
from model import cpu_bf16_units, pick_dtype
from runlog import read_metrics

ROOT = Path(__file__).resolve().parent.parent  # the repository root: train.py and sft.py run from there

ESTIMATORS = {"vine": ["--estimator", "vine"],  # K = 9
              "vine-adaptive": ["--estimator", "vine", "--k-mode", "adaptive", "--k-ci", "0.45"],  # research/adaptive_k
              # the committed grids' critic arms ran a head on the policy's trunk (then the only critic): pinned, so
              # that they reproduce; the paper's separate critic is free_samples' critic-separate (docs/critic.md)
              "critic": ["--estimator", "critic", "--critic", "head"],
              # the paper's PPO, a separate critic network (its value lr: SETTINGS' --value-lr)
              "critic-separate": ["--estimator", "critic", "--critic", "separate"],
              "grpo": ["--estimator", "grpo"], "rloo": ["--estimator", "rloo"]}

# the testbed's recipe, which every grid of the studies builds on (scripts/testbed.py is its quick demo)
TASK = ["--dataset", "chain", "--arith-ops", "4", "--prompt-format", "plain", "--threads", "1", "--max-new-tokens",
        "64"]
SFT_SETTINGS = [*TASK, "--model", "scratch", "--max-steps", "300", "--batch-size", "64", "--micro-batch-size", "64",
                "--lr", "3e-3", "--warmup-ratio", "0.33", "--no-lr-decay", "--max-length", "128", "--eval-size", "500",
                "--eval-samples", "1", "--eval-temperature", "0"]
# 300 steps of 64 at a constant 3e-3 after 100 warmup steps: greedy pass@1 ~0.54, first errors spread over the four
# lines. A run decayed to 0 over 300 steps reached ~0.48 but RL did not move it (research/testbed/README.md: the sweep).
ITERATIONS, EVAL_EVERY = 30, 3
OUT = "runs/testbed"  # its default output, ignored by git; the committed grid is written only when --out names it
ARMS = {**ESTIMATORS, "vine-free": ["--estimator", "vine", "--free-samples", "topup"]}  # research/free_samples/README.md
SETTINGS = [*TASK, "--prompts-per-iter", "64", "--samples-per-prompt", "8", "--minibatch-size", "64",
            "--micro-batch-size", "32", "--epochs", "1", "--lr", "5e-5", "--value-lr", "1e-3", "--no-lr-decay",
            "--warmup-ratio", "0", "--kl-coef", "1e-4", "--eval-size", "500", "--eval-samples", "1",
            "--eval-temperature", "0", "--eval-every", str(EVAL_EVERY), "--save-every", str(EVAL_EVERY),
            "--iterations", str(ITERATIONS), "--sampler", "hf", "--dtype", "float32", "--gen-batch-size", "512"]


def this_machine() -> dict:
    """What a second of training buys: the CPU, its cores and torch's threads, its native bf16 units and the compute
    dtype that --dtype auto picks from them."""
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")),
               platform.processor() or platform.machine())
    return {"cpu": cpu, "cpus": os.cpu_count(), "threads": torch.get_num_threads(), "bf16_units": cpu_bf16_units(),
            "dtype": str(pick_dtype("auto", torch.device("cpu"))).removeprefix("torch."), "torch": torch.__version__}


def describe(machine: dict | None) -> str:
    if machine is None:
        return "machine not recorded"
    units = "+".join(machine["bf16_units"]) or "no bf16 units"
    sft = f", from SFT model {machine['sft_sha256'][:12]}" if "sft_sha256" in machine else ""
    return f"{machine['cpu']} ({units}), {machine['cpus']} CPUs, {machine['threads']} threads, {machine['dtype']}{sft}"


def record_machine(run_dir: Path, machine: dict, *, resuming: bool):
    """run_dir/machine.json: the machine (and runs at once) the run started on; a resume keeps it and appends its own
    under "resumes", so a run cut off and continued elsewhere, or beside other runs, says so."""
    path, latest = run_dir / "machine.json", run_dir / "latest"
    if resuming and path.exists():
        first = json.loads(path.read_text())
        at = latest.read_text().strip() if latest.exists() else None  # the checkpoint it goes on from
        machine = {**first, "resumes": first.get("resumes", []) + [{**machine, "from": at}]}
    path.write_text(json.dumps(machine) + "\n")


def sft_stage(out: Path, *, settings: list[str]) -> tuple[Path, str]:
    """The SFT model: sft.py with `settings` (a study's SFT recipe) into out/sft, once
    (resumed if it was cut off); returns its folder and the sha256 of its weights (what each cell records, and its
    block must share)."""
    sft_dir = out / "sft"
    decays = "--no-lr-decay" not in settings
    if (sft_dir / "metrics.jsonl").exists() and ended_decayed(sft_dir / "metrics.jsonl") not in (None, decays):
        raise SystemExit(f"error: {sft_dir}: its SFT lr {'did not decay' if decays else 'decayed'}, unlike the "
                         f"schedule asked for (--{'' if decays else 'no-'}sft-lr-decay); use another --out")
    if not (sft_dir / "config.json").exists():
        cmd = [sys.executable, "sft.py", *settings, "--out-dir", str(sft_dir),
               "--resume" if (sft_dir / "latest").exists() else "--overwrite"]
        print("$", " ".join(cmd), flush=True)
        if subprocess.run(cmd, cwd=ROOT).returncode != 0:
            raise SystemExit("error: the SFT stage failed; see its output above")
    digest = weights_sha256(sft_dir)  # what train.py records in each run's start.json
    (sft_dir / "model.sha256").write_text(digest + "\n")
    return sft_dir, digest


def ended_decayed(metrics: Path) -> bool | None:
    """Whether an SFT run's lr ended below its peak (decayed, fully or to a floor); None before its first step."""
    lrs = [r["lr"] for r in read_metrics(metrics) if "lr" in r]
    return None if not lrs else lrs[-1] < max(lrs)


def recorded_start(run_dir: Path) -> str | None:
    """The sha256 of the weights a run started from (train.py's OUT/start.json), or None if it records none."""
    path = run_dir / "start.json"
    return json.loads(path.read_text()).get("model_sha256") if path.exists() else None


def run_state(run_dir: Path, *, start: str | None = None) -> str:
    """"done": the metrics end with the last iteration's evaluation; "resume": cut off with a checkpoint; "fresh";
    with `start` (the SFT weights' sha256) also "other start": a run, done or cut off, that records another start or
    none, which a grid must not count as its own."""
    records = read_metrics(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").exists() else []
    done = bool(records) and records[-1].get("iteration") == ITERATIONS and "eval_accuracy" in records[-1]
    if (done or (run_dir / "latest").exists()) and start is not None and recorded_start(run_dir) != start:
        return "other start"
    return "done" if done else "resume" if (run_dir / "latest").exists() else "fresh"


def command(estimator: str, seed: int, *, out: Path, sft_dir: Path, extra: list[str],
            arms: dict[str, list[str]] = ESTIMATORS) -> list[str]:
    """train.py's command line for one cell; arms: each arm's flags (the estimators, or research.branching.branching's rules)."""
    run_dir = out / f"{estimator}-s{seed}"
    return [sys.executable, "train.py", *SETTINGS, *arms[estimator], "--model", str(sft_dir), "--seed",
            str(seed), "--out-dir", str(run_dir), "--resume" if run_state(run_dir) == "resume" else "--overwrite",
            *extra]


def run_cells(cells: list[tuple[str, int]], *, out: Path, sft_dir: Path, extra: list[str], jobs: int,
              machine: dict, arms: dict[str, list[str]] = ESTIMATORS) -> list[str]:
    """Run the cells (arm, seed) of one folder that are not done, `jobs` at a time (run_grid); returns the names of
    the cells run."""
    return [name for _, name in run_grid([(out, arm, seed) for arm, seed in cells], sft_dirs={out: sft_dir},
                                         extras={out: extra}, jobs=jobs, machine=machine, arms=arms)]


def run_grid(cells: list[tuple[Path, str, int]], *, sft_dirs: dict[Path, Path], extras: dict[Path, list[str]],
             jobs: int, machine: dict, arms: dict[str, list[str]] = ESTIMATORS,
             on_done: Callable[[Path], object] | None = None,
             folder_arms: dict[Path, dict[str, list[str]]] | None = None) -> list[tuple[Path, str]]:
    """Run the cells (folder, arm, seed) that are not done, in order, `jobs` at a time, each from its folder's SFT
    model (sft_dirs) with its folder's extra train.py flags (extras) and the arm's flags (arms, or the folder's own in
    folder_arms); each writes its output to its folder's log.txt. A cell made from another SFT model than its folder's
    is a one-line error, never reused, and nothing runs. on_done(run folder) is called as each run ends (the others go
    on). Returns the (folder, name) of the cells run."""
    starts = {out: sft_digest(sft_dir) for out, sft_dir in sft_dirs.items()}
    states = {(out, a, s): run_state(out / f"{a}-s{s}", start=starts[out]) for out, a, s in cells}
    for out in sft_dirs:
        if other := [f"{a}-s{s}" for (where, a, s), state in states.items() if where == out and state == "other start"]:
            raise SystemExit(f"error: {out}: {', '.join(other)} started from another model than {sft_dirs[out]} (sha256 "
                             f"{str(starts[out])[:12]}; see their start.json): pass a new --out, or move those runs away")
    todo, ran, running = [cell for cell in cells if states[cell] != "done"], [], []
    while todo or running:
        while todo and len(running) < jobs:
            out, arm, seed = todo.pop(0)
            run_dir = out / f"{arm}-s{seed}"
            run_dir.mkdir(parents=True, exist_ok=True)
            record_machine(run_dir, {**machine, "jobs": jobs}, resuming=states[(out, arm, seed)] == "resume")
            cmd = command(arm, seed, out=out, sft_dir=sft_dirs[out], extra=extras[out],
                          arms=(folder_arms or {}).get(out, arms))
            print("$", " ".join(cmd), flush=True)
            log = open(run_dir / "log.txt", "a")
            running.append((run_dir, subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT), log))
        time.sleep(1)
        for cell in [c for c in running if c[1].poll() is not None]:
            running.remove(cell)
            run_dir, process, log = cell
            log.close()
            if process.returncode != 0:
                raise SystemExit(f"error: {run_dir} failed; see {run_dir}/log.txt")
            print(f"{run_dir}: done", flush=True)
            ran.append((run_dir.parent, run_dir.name))
            if on_done:
                on_done(run_dir)
    return ran


def sft_digest(sft_dir: Path) -> str | None:
    """The SFT model's sha256 (model.sha256, which sft_stage writes and the grids commit), or None."""
    path = sft_dir / "model.sha256"
    return path.read_text().strip() if path.exists() else None


def done_runs(out: Path, *, arms: dict[str, list[str]], start: str | None) -> tuple[dict[str, dict[int, list[dict]]],
                                                                                 list[str]]:
    """The metrics of every finished run in out made from `start` (the SFT weights' sha256; None: any), by arm and
    seed, arms in order; and the names of the runs, done or cut off, made from another start (run_state)."""
    runs, other = {}, []
    for arm in arms:
        for run_dir in sorted(out.glob(f"{arm}-s*"), key=lambda p: p.name):
            name, _, seed = run_dir.name.rpartition("-s")
            if name != arm or not seed.isdigit() or not run_dir.is_dir():
                continue
            state = run_state(run_dir, start=start)
            if state == "done":
                runs.setdefault(arm, {})[int(seed)] = read_metrics(run_dir / "metrics.jsonl")
            other += [run_dir.name] if state == "other start" else []
    return runs, sorted(other, key=lambda name: (int(name.rpartition("-s")[2]), list(arms).index(
        name.rpartition("-s")[0])))


def grid_arguments(parser: argparse.ArgumentParser, *, arm: str, arms: dict[str, list[str]], out: str,
                   default: list[str] | None = None):
    """The flags of a testbed grid (scripts/testbed.py's, research.branching.branching's): --seeds, --<arm>s (which
    arms; default: `default`, else all), --jobs, --out, --redraw; anything else goes to train.py."""
    parser.add_argument("--seeds", default="0", help="comma-separated seeds (default 0)")
    parser.add_argument(f"--{arm}s", default=",".join(default or arms),
                        help=f"comma-separated, of {list(arms)} (default {','.join(default or arms)})")
    parser.add_argument("--jobs", type=int, default=2, help="runs at once, one thread each (default 2)")
    parser.add_argument("--out", default=out, help=f"results folder (default {out}, outside git; the committed grid "
                        "is written only when --out names it)")
    parser.add_argument("--redraw", action="store_true", help="run nothing: summarize the finished runs")


def truth_arguments(parser: argparse.ArgumentParser, *, mode: str):
    """The flags of a value diagnosis against a many-vine truth (research.credit.credit --diagnose, research.free_samples.free_samples
    --values): --prompts (groups of 8 responses) and --truth (vines per state); check them with truth_choices."""
    parser.add_argument("--prompts", type=int, default=24, help=f"--{mode}: train problems, 8 responses each")
    parser.add_argument("--truth", type=int, default=256, help=f"--{mode}: vines per state for the true value")


def truth_choices(args):
    """truth_arguments' values, each at least 1, or a one-line error."""
    for name in ("prompts", "truth"):
        if getattr(args, name) < 1:
            raise SystemExit(f"error: --{name} must be at least 1 (got {getattr(args, name)})")


def grid_choices(args, *, arm: str, arms: dict[str, list[str]]) -> tuple[list[str], list[int]]:
    """The arms and seeds grid_arguments' flags chose; a bad value is a one-line error."""
    chosen = getattr(args, f"{arm}s").split(",")
    if unknown := [a for a in chosen if a not in arms]:
        raise SystemExit(f"error: --{arm}s: unknown {unknown} (choose from {list(arms)})")
    if not all(s.strip().isdigit() for s in args.seeds.split(",")):
        raise SystemExit(f"error: --seeds: expected comma-separated non-negative integers, got {args.seeds!r}")
    if args.jobs < 1:
        raise SystemExit(f"error: --jobs must be at least 1 (got {args.jobs})")
    return chosen, [int(s) for s in args.seeds.split(",")]
