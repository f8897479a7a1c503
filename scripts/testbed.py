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
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from runlog import read_metrics
from scripts.plot import mean_se, plot_bands, pm, summarize_grid, summary_markdown
from research.grid import ESTIMATORS, describe, record_machine, sft_stage, this_machine
from research.replication.replicate import summarize, table

ROOT = Path(__file__).resolve().parent.parent  # the repository root: train.py and sft.py run from there
TASK = ["--dataset", "chain", "--arith-ops", "4", "--prompt-format", "plain", "--threads", "1", "--max-new-tokens",
        "64"]
SFT_SETTINGS = [*TASK, "--model", "scratch", "--max-steps", "300", "--batch-size", "64", "--micro-batch-size", "64",
                "--lr", "3e-3", "--warmup-ratio", "0.33", "--no-lr-decay", "--max-length", "128", "--eval-size", "500",
                "--eval-samples", "1", "--eval-temperature", "0"]
# 300 steps of 64 at a constant 3e-3 after 100 warmup steps: greedy pass@1 ~0.54, first errors spread over the four
# lines. A run decayed to 0 over 300 steps reached ~0.48 but RL did not move it (research/testbed/README.md: the sweep).
ITERATIONS, EVAL_EVERY = 30, 3
THRESHOLD = 0.7  # pass@1 whose time to reach the summary reports (the SFT start: ~0.54)
OUT = "runs/testbed"  # the default output, ignored by git; the committed grid is written only when --out names it
# the committed 5-seed grids from this SFT recipe a newcomer's run is placed beside: every estimator, and the
# free-sample grid (vine-free and the separate critic)
REFERENCES = ("research/testbed/results/testbed", "research/free_samples/results/free-samples")
ARMS = {**ESTIMATORS, "vine-free": ["--estimator", "vine", "--free-samples", "topup"]}  # research/free_samples/README.md
DEFAULT = ["vine", "vine-free", "critic-separate", "grpo", "rloo"]  # the one command's arms, the longest first
SETTINGS = [*TASK, "--prompts-per-iter", "64", "--samples-per-prompt", "8", "--minibatch-size", "64",
            "--micro-batch-size", "32", "--epochs", "1", "--lr", "5e-5", "--value-lr", "1e-3", "--no-lr-decay",
            "--warmup-ratio", "0", "--kl-coef", "1e-4", "--eval-size", "500", "--eval-samples", "1",
            "--eval-temperature", "0", "--eval-every", str(EVAL_EVERY), "--save-every", str(EVAL_EVERY),
            "--iterations", str(ITERATIONS), "--sampler", "hf", "--dtype", "float32", "--gen-batch-size", "512"]


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


def summary(out: Path, *, started: float, extra: list[str], arms: dict[str, list[str]] = ESTIMATORS,
            baseline: str = "vine", sft_dir: Path | None = None, ran: list[str] = (),
            sft_settings: list[str] = SFT_SETTINGS) -> tuple[str, str]:
    """results.md, results.json and curves.png over every finished run in out made from sft_dir's model (made by
    sft.py with sft_settings; paired differences to `baseline`). Returns results.md's text and the table of `ran`, this invocation's
    runs, beside the reference grid (invocation_table; empty if it ran none)."""
    sft_dir = sft_dir or out / "sft"
    digest = sft_digest(sft_dir)
    runs, other = done_runs(out, arms=arms, start=digest)
    rows = [summarize(runs[arm][seed], arm, seed) for seed in sorted({s for by_seed in runs.values() for s in by_seed})
            for arm in arms if seed in runs.get(arm, {})]
    if not rows:
        raise SystemExit(f"error: no finished run in {out} to summarize")
    budget = max(r["train_minutes"] for r in rows) * 60  # the longest run: the time axis of the summary
    start = read_metrics(sft_dir / "metrics.jsonl")[-1] if (sft_dir / "metrics.jsonl").exists() else {}
    grid = summarize_grid(runs, budget=budget, threshold=THRESHOLD, baseline=baseline)
    plot_bands(runs, str(out / "curves.png"), budget=budget)
    machines = set()
    for r in rows:
        path = out / f"{r['estimator']}-s{r['seed']}" / "machine.json"
        if path.exists():
            machine = json.loads(path.read_text())
            machines.add(f"{describe(machine)}, {machine.get('jobs', 1)} run(s) at once")
    text = (f"SFT from scratch: `sft.py {' '.join(sft_settings)}`; its greedy pass@1 on the 500 test problems: "
            f"{start.get('eval_accuracy', float('nan')):.3f} ± {start.get('eval_se', float('nan')):.3f}, first wrong "
            f"line of the wrong answers: {start.get('first_wrong_line')}; sha256 {digest}.\n\n"
            f"RL: {ITERATIONS} iterations of 64 x 8 for every arm; settings `{' '.join(SETTINGS + extra)}`; arms: "
            + "; ".join(f"{name} `{' '.join(flags)}`" for name, flags in arms.items()) + ".\n"
            f"Machines: {'; '.join(sorted(machines))}.\n"
            + (f"Left out, made from another SFT model: {', '.join(other)}.\n" if other else "")
            + (f"This invocation: {(time.time() - started) / 60:.0f} min.\n\n" if started else "\n") +
            f"{summary_markdown(grid, threshold=THRESHOLD, baseline=baseline)}\n\n"
            "Pass@1 against iterations (± SE over "
            f"seeds):\n\n{iteration_table(runs, baseline=baseline)}\n\n"
            f"{signal_table(runs)}\n\nPer run:\n\n{table(rows)}\n")
    (out / "results.md").write_text(text)
    (out / "results.json").write_text(json.dumps({"sft": sft_settings, "sft_sha256": digest, "settings": SETTINGS + extra,
                                                  "runs": rows, "summary": grid}, indent=1))
    mine = [r for r in rows if f"{r['estimator']}-s{r['seed']}" in ran]
    return text, invocation_table(mine, out=out, digest=digest, start=start) if mine else ""


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


def paired_cells(by_seed: dict[int, float], base: dict[int, float], *, is_baseline: bool) -> list[str]:
    """Two table cells: the mean +- SE over seeds of `by_seed` (one value per seed), and its paired difference to
    `base` on the seeds both have (mean +- SE of the per-seed differences, and how many); "–" for the baseline."""
    paired = [v - base[seed] for seed, v in by_seed.items() if seed in base]
    return [pm(*mean_se(list(by_seed.values())), len(by_seed)), "–" if is_baseline or not paired else
            f"{pm(*mean_se(paired), len(paired), signed=True)} ({len(paired)})"]


def iteration_table(runs: dict[str, dict[int, list[dict]]], *, baseline: str) -> str:
    """Per arm (runs: arm -> seed -> metrics, done_runs), pass@1 against iterations: the mean of its evaluations after
    iteration 0 (3, 6, ..., 30), mean +- SE over seeds, and paired with `baseline` on the same seed."""
    curves = {arm: {seed: sum(evals) / len(evals) for seed, records in by_seed.items()
                    for evals in [[r["eval_accuracy"] for r in records if "eval_accuracy" in r and r["iteration"] > 0]]}
              for arm, by_seed in runs.items()}
    lines = [f"| arm | seeds | mean pass@1, iterations {EVAL_EVERY}-{ITERATIONS} | paired − {baseline} |",
             "| --- | --- | --- | --- |"]
    for arm, by_seed in curves.items():
        cells = paired_cells(by_seed, curves.get(baseline, {}), is_baseline=arm == baseline)
        lines.append(f"| {arm} | {len(by_seed)} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


def invocation_table(rows: list[dict], *, out: Path, digest: str | None, start: dict) -> str:
    """What this invocation trained, for the person who ran it: each run's start, end and gain (± the SE of one
    evaluation: one seed has no spread over seeds), minutes and seconds an iteration; where the curves are; and the
    reference grids (REFERENCES, committed) beside it, saying whether they started from the same SFT model."""
    lines = ["This invocation's runs (± the SE of one evaluation of 500 problems):", "",
             "| run | pass@1 start | end | end − start | minutes | s / iteration |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        se = "–" if r["eval_se"] is None else f"{r['eval_se']:.3f}"
        lines.append(f"| {r['estimator']}-s{r['seed']} | {r['start_pass1']:.3f} | {r['final_pass1']:.3f} | "
                     f"{r['final_pass1'] - r['start_pass1']:+.3f} ± {se} | {r['wall_minutes']:.1f} | "
                     f"{r['seconds_per_iteration']:.1f} |")
    lines += ["", f"Curves: {out / 'curves.png'}; all runs in {out}: {out / 'results.md'}."]
    for name in REFERENCES:
        reference = ROOT / name
        if out.resolve() == reference.resolve() or not (reference / "results.json").exists():
            continue
        ref = json.loads((reference / "results.json").read_text())
        ref_digest = sft_digest(reference / "sft") or ref.get("sft_sha256")
        machine = json.loads(next(reference.glob("vine-s*/machine.json")).read_text())
        gains = ", ".join(f"{arm} {pm(s['gain'], s['gain_se'], s['seeds'], signed=True)}"
                          for arm, s in ref["summary"].items())
        sft_metrics = reference / "sft" / "metrics.jsonl"
        ref_start = read_metrics(sft_metrics)[-1].get("eval_accuracy", float("nan")) if sft_metrics.exists() else None
        same = "the same SFT model as yours" if ref_digest == digest else (
            f"another SFT model ({str(ref_digest)[:12]}"
            + (f", its SFT evaluation {ref_start:.3f}" if ref_start is not None else "")
            + f"; yours {str(digest)[:12]}, {start.get('eval_accuracy', float('nan')):.3f}): SFT from scratch lands "
            "elsewhere on another CPU, so compare gains, not pass@1")
        lines.append(f"Reference grid ({name}, {max(s['seeds'] for s in ref['summary'].values())} seeds on "
                     f"{describe(machine)}) started from {same}; its end − start, mean ± SE over seeds: {gains}.")
    return "\n".join(lines)


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


def grid_arguments(parser: argparse.ArgumentParser, *, arm: str, arms: dict[str, list[str]], out: str,
                   default: list[str] | None = None):
    """The flags of a testbed grid (this one, research.branching.branching's): --seeds, --<arm>s (which arms; default: `default`,
    else all), --jobs, --out, --redraw; anything else goes to train.py."""
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


def arm_grid(args, extra: list[str], *, arms: dict[str, list[str]], chosen: list[str], seeds: list[int],
             testbed: Path, baseline: str, title: str, table) -> None:
    """A grid of arms from the testbed's SFT model (testbed/sft, made there if missing): run the chosen (arm, seed)
    cells into --out unless --redraw, then write --out/results.md (the summary, then `title` and `table(runs)`) and
    print it."""
    out, started, ran, sft_dir = Path(args.out), time.time(), [], testbed / "sft"
    out.mkdir(parents=True, exist_ok=True)
    if not args.redraw:
        sft_dir, _ = sft_stage(testbed, settings=SFT_SETTINGS)
        ran = run_cells([(a, s) for s in seeds for a in chosen], out=out, sft_dir=sft_dir, extra=extra,
                        jobs=args.jobs, machine=this_machine(), arms=arms)
    text, mine = summary(out, started=None if args.redraw else started, extra=extra, arms=arms, baseline=baseline,
                         sft_dir=sft_dir, ran=ran)
    runs, _ = done_runs(out, arms=arms, start=sft_digest(sft_dir))
    text += f"\n{title}:\n\n{table(runs)}\n"
    (out / "results.md").write_text(text)
    print(text + "\n" + mine)


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
