"""The paper's regime on the testbed: RL from an SFT model trained to convergence, on an easy and a hard task.

    python -m research.paper_regime.paper_regime --calibrate        each task's SFT to convergence, then its plateau (restartable)
    python -m research.paper_regime.paper_regime --lift --seeds 0,1,2    does RL lift the converged start? (restartable)
    python -m research.paper_regime.paper_regime --seeds 0,1,2,3,4       the grid, both tasks (restartable; --task hard: one task)
    python -m research.paper_regime.paper_regime --redraw                the grid's results.md, results.json, curves.png

The paper starts RL from the best checkpoint of an SFT run trained to convergence, and RL still gains 3-10 points:
the model cannot master the task by imitation. On the testbed's chains it can (a tiny model reaches ~0.9-0.95 by
SFT alone, ../shared/notes/small-scale-rl.md), so each task here gets demonstrations that imitation cannot see past:
the testbed's 4-line chains, the SFT solutions written by a solver with a consistent bug (data.bugged_solution,
sft.py --chain-bug) on 70% of the lines it applies to, the answers (RL's reward) still the right ones:
    easy  --chain-bug borrow        a subtraction that needs a borrow done without it (32-17=25)
    hard  --chain-bug borrow-carry  that, and an addition that needs a carry done without it (38+25=53)
A model that imitates the solver perfectly is right on the problems where the bug never struck: greedy decoding takes
the bug wherever it applies (70% against 30%), sampling takes the right line now and then, so pass@k exceeds pass@1,
and RL has something to find that SFT cannot. Both tasks share the chains' length and cost; the hard one's bug
applies to more lines.

SFT (sft.py, into OUT/<task>/sft): a scratch model, 15 epochs over the 5,000 demonstrations, lr 3e-3 decayed linearly
to 0 after 5% warmup, greedy validation pass@1 on 200 problems every 100 steps, the best checkpoint kept
(--keep-best). The plateau (OUT/<task>/sft/plateau.json, OUT/calibration.md), in fp32: test pass@1 greedy and from 16
samples at T 0.35 (the paper's evaluation), and train pass@1 sampled at T 0.6 (RL's temperature: not memorised).

--lift (OUT/<task>/lift/<arm>-s<seed>): grpo and vine (K = 9) from each task's SFT model, the testbed's RL recipe
(research/grid.py SETTINGS: 30 iterations of 64 x 8, T 0.6, KL 1e-4, greedy pass@1 on the 500 test problems every
3 iterations) at two policy lrs, 5e-5 (the testbed's) and 2e-4, two runs at a time, one thread each. A setting lifts
the start if its mean pass@1 over iterations 3-30 is above the run's own iteration 0 by more than 2 SE over seeds.

The grid (OUT/<task>/<arm>-s<seed>): ARMS from each task's SFT model at lr 5e-5, the lift test's recipe, seeds
paired; grpo-matched is grpo given vine's sampled tokens (matched_samples: more responses to the same prompts, the
minibatch scaled so an iteration keeps its 8 optimizer steps). Each run's last policy is evaluated as the paper
(final_eval: 16 samples at T 0.35). The read-out: research/paper_regime/regime_report.py; the design: research/paper_regime/README.md.
"""
import argparse
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import torch

from checkpoint import weights_sha256
from data import load_split
from engine import HFSampler
from model import load_model, load_tokenizer
from research.grid import SETTINGS, TASK, done_runs, run_grid, run_state, sft_digest, sft_stage, this_machine
from research.paper_regime.regime_report import report
from research.readout import mean_se, pm
from rollout import evaluate

OUT = "runs/paper-regime"  # the default output, ignored by git (the committed runs: --out research/paper_regime/results/paper-regime)
TASKS = {"easy": ["--chain-bug", "borrow", "--chain-bug-rate", "0.7"],
         "hard": ["--chain-bug", "borrow-carry", "--chain-bug-rate", "0.7"]}
STARTS = {**TASKS, "hard-c": [*TASKS["hard"], "--seed", "1"]}  # SFT flags of every start; C: the hard task, SFT seed 1
SHIPPED = Path(__file__).resolve().parent / "results" / "paper-regime"  # the starts committed: <task>/sft, weights
START_FILES = ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "model.sha256", "plateau.json", "metrics.jsonl")
SFT_SETTINGS = [*TASK, "--model", "scratch", "--epochs", "15", "--batch-size", "64", "--micro-batch-size", "64",
                "--lr", "3e-3", "--warmup-ratio", "0.05", "--max-length", "128", "--eval-size", "500",
                "--eval-samples", "1", "--eval-temperature", "0", "--keep-best", "--stop-every", "100",
                "--stop-size", "200"]
LIFT_ARMS = {f"{estimator}-lr{lr}": ["--estimator", estimator, "--lr", lr]
             for estimator in ("grpo", "vine") for lr in ("5e-5", "2e-4")}
PROMPTS, SAMPLES, MINIBATCH = 64, 8, 64  # SETTINGS' batch: 64 prompts x 8 responses, 8 optimizer steps an iteration


def matched_samples(*, vine_tokens: float, grpo_tokens: float, multiple: int = 4) -> int:
    """Responses per prompt that give grpo vine's sampled tokens an iteration: SAMPLES scaled by vine's tokens over
    grpo's (each an iteration's mean), to the nearest multiple of `multiple` (so that the minibatch, MINIBATCH / SAMPLES
    x this, splits into SETTINGS' micro-batches of 32)."""
    return max(multiple, multiple * round(SAMPLES * vine_tokens / grpo_tokens / multiple))


def matched_flags(samples_per_prompt: int) -> list[str]:
    """grpo-matched's train.py flags: samples_per_prompt responses to each of the same 64 prompts, the minibatch
    scaled with them, so that an iteration still takes PROMPTS x SAMPLES / MINIBATCH = 8 optimizer steps."""
    return ["--estimator", "grpo", "--samples-per-prompt", str(samples_per_prompt),
            "--minibatch-size", str(MINIBATCH * samples_per_prompt // SAMPLES)]


# grpo-matched's responses per prompt: matched_samples on the lift test's seed-0 runs at lr 5e-5 (vine's and grpo's
# mean sampled tokens an iteration: easy 85.0k / 19.5k -> 34.9; hard 95.2k / 19.6k -> 38.8)
MATCHED = {"easy": 36, "hard": 40}
ARMS = {"vine": ["--estimator", "vine"],  # K = 9 fresh vines at every state (the paper)
        "vine-free": ["--estimator", "vine", "--free-samples", "topup"],  # the group's responses count toward K
        "critic": ["--estimator", "critic", "--critic", "separate", "--value-lr", "1e-3"],  # the paper's PPO
        "grpo": ["--estimator", "grpo"],
        "grpo-matched": None}  # grpo given vine's sampled tokens: matched_flags(MATCHED[task])


def grid_arms(task: str) -> dict[str, list[str]]:
    """The grid's arms on one task: ARMS with grpo-matched's flags for that task's MATCHED samples."""
    return {arm: flags or matched_flags(MATCHED[task]) for arm, flags in ARMS.items()}


ADOPTED = {"grpo": "grpo-lr5e-5", "vine": "vine-lr5e-5"}  # grid arms whose command a lift arm already ran
# (evaluation temperature, samples per problem, split, problems): the plateau's three measurements
PLATEAU = {"test greedy": (0.0, 1, "test", 500), "test T 0.35 x 16": (0.35, 16, "test", 500),
           "train T 0.6 x 4": (0.6, 4, "train", 500)}


def plateau(model_dir: Path, *, seed: int = 0) -> dict:
    """PLATEAU's pass@1 (± SE over problems) of the model in model_dir, fp32, top-p 0.9, up to 64 new tokens."""
    tokenizer = load_tokenizer(str(model_dir))
    sampler = HFSampler(load_model(str(model_dir), device=torch.device("cpu"), dtype=torch.float32, frozen=True),
                        tokenizer, dtype=torch.float32, batch_size=512)
    result = {}
    for name, (temperature, samples, split, problems) in PLATEAU.items():
        cfg = SimpleNamespace(grader="number", prompt_format="plain", eval_samples=samples,
                              eval_temperature=temperature, top_p=0.9, max_new_tokens=64)
        examples = load_split("chain", split, arith_ops=4)[:problems]
        result[name] = evaluate(sampler, tokenizer, examples, cfg, seed=seed)
    return result


def start_stage(out: Path, task: str, *, rebuild: bool = False) -> tuple[Path, str]:
    """The task's SFT start in out/<task>/sft and its weights' sha256: the committed one (SHIPPED/<task>/sft) copied
    in when its weights match its model.sha256 (an SFT does not rebuild bit for bit on another CPU kind), else, or with
    `rebuild`, made by sft.py (sft_stage: once, resumed if cut off)."""
    sft_dir, shipped = out / task / "sft", SHIPPED / task / "sft"
    if not rebuild and not (sft_dir / "config.json").exists() and (shipped / "model.safetensors").exists():
        if (digest := weights_sha256(shipped)) != sft_digest(shipped):
            raise SystemExit(f"error: {shipped}: its weights' sha256 {digest[:12]}… is not its model.sha256 "
                             f"{str(sft_digest(shipped))[:12]}…; restore it from git, or pass --rebuild-start")
        sft_dir.mkdir(parents=True, exist_ok=True)
        for name in START_FILES:
            if (shipped / name).exists() and not (sft_dir / name).exists():
                shutil.copy(shipped / name, sft_dir / name)
    return sft_stage(out / task, settings=SFT_SETTINGS + STARTS[task])


def calibrate(out: Path, *, tasks: list[str] = list(TASKS), rebuild: bool = False) -> str:
    """Each task's SFT (made once, resumed if cut off) and its plateau (measured once): calibration.md's table."""
    lines = ["| task | SFT demonstrations | best step (validation greedy pass@1) | "
             + " | ".join(PLATEAU) + " | sha256 |", "| --- " * (4 + len(PLATEAU)) + "|"]
    for task in tasks:
        flags = STARTS[task]
        sft_dir, digest = start_stage(out, task, rebuild=rebuild)
        measured = sft_dir / "plateau.json"
        if not measured.exists():
            measured.write_text(json.dumps({"sha256": digest, **plateau(sft_dir)}, indent=1))
        result = json.loads(measured.read_text())
        if result["sha256"] != digest:
            raise SystemExit(f"error: {measured}: measured on another model ({result['sha256'][:12]}…, now "
                             f"{digest[:12]}…); delete it to measure again")
        records = [json.loads(line) for line in (sft_dir / "metrics.jsonl").read_text().splitlines()]
        best = max((r for r in records if "validation_accuracy" in r), key=lambda r: r["validation_accuracy"])
        cells = [f"{result[name][0]:.3f} ± {result[name][1]:.3f}" for name in PLATEAU]
        lines.append(f"| {task} | `{' '.join(flags)}` | {best['iteration']} ({best['validation_accuracy']:.3f}) | "
                     + " | ".join(cells) + f" | {digest[:12]}… |")
    return "\n".join(lines)


def lift(out: Path, *, seeds: list[int], jobs: int, redraw: bool) -> str:
    """--lift: LIFT_ARMS from each task's SFT model (made first if missing), then lift.md's table: per task and arm,
    over seeds, the mean greedy pass@1 over iterations 3-30 and at 30, each minus the run's iteration 0."""
    folders = {out / task / "lift": out / task / "sft" for task in TASKS}
    if not redraw:
        for task in TASKS:
            start_stage(out, task)
        run_grid([(folder, arm, seed) for seed in seeds for folder in folders for arm in LIFT_ARMS],
                 sft_dirs=folders, extras={folder: [] for folder in folders}, jobs=jobs, machine=this_machine(),
                 arms=LIFT_ARMS)
    lines = ["| task | arm | seeds | pass@1 at 0 | mean pass@1, iterations 3-30 − 0 | at 30 − 0 | lifted (> 2 SE) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for folder, sft_dir in folders.items():
        runs, _ = done_runs(folder, arms=LIFT_ARMS, start=sft_digest(sft_dir))
        for arm, by_seed in runs.items():
            evals = [[r["eval_accuracy"] for r in records if "eval_accuracy" in r] for records in by_seed.values()]
            start = mean_se([e[0] for e in evals])
            over = mean_se([sum(e[1:]) / len(e[1:]) - e[0] for e in evals])
            end = mean_se([e[-1] - e[0] for e in evals])
            lifted = "yes" if len(evals) > 1 and over[0] > 2 * over[1] else "no"
            lines.append(f"| {folder.parent.name} | {arm} | {len(evals)} | {pm(*start, len(evals))} | "
                         f"{pm(*over, len(evals), signed=True)} | {pm(*end, len(evals), signed=True)} | {lifted} |")
    return "\n".join(lines)


def adopt_runs(source: Path, target: Path, *, names: dict[str, str], seeds: list[int], start: str,
               evaluated: bool = False) -> list[str]:
    """Copy into target the finished runs of source made from `start` (the SFT sha256) whose command a target arm
    repeats (names: target arm -> source arm), for the seeds asked whose target folder is still empty; with
    `evaluated`, only those whose final.json is written (a target that never runs the arm itself); returns the names
    copied."""
    copied = []
    for arm, source_arm in names.items():
        for seed in seeds:
            run, copy = source / f"{source_arm}-s{seed}", target / f"{arm}-s{seed}"
            ready = run_state(run, start=start) == "done" and (not evaluated or (run / "final.json").exists())
            if ready and not copy.exists():
                shutil.copytree(run, copy)
                copied.append(copy.name)
    return copied


def adopt_lift_runs(task_dir: Path, *, seeds: list[int]) -> list[str]:
    """The lift test's finished runs whose command a grid arm repeats (ADOPTED: the same train.py flags and start),
    copied into the grid's task folder (adopt_runs)."""
    return adopt_runs(task_dir / "lift", task_dir, names=ADOPTED, seeds=seeds, start=sft_digest(task_dir / "sft"))


def final_eval(run_dir: Path) -> dict:
    """run_dir/final.json, measured once: the run's last checkpoint evaluated as the plateau (PLATEAU: the paper's 16
    samples at T 0.35 beside greedy, and train at T 0.6), with the checkpoint's name and weights' sha256."""
    path = run_dir / "final.json"
    if not path.exists():
        if not (run_dir / "latest").exists():
            raise SystemExit(f"error: {run_dir}: no final.json and no checkpoint to measure it on")
        checkpoint = run_dir / (run_dir / "latest").read_text().split()[0]
        path.write_text(json.dumps({"checkpoint": checkpoint.name, "sha256": weights_sha256(checkpoint),
                                    **plateau(checkpoint)}, indent=1))
    return json.loads(path.read_text())


def grid(out: Path, *, tasks: list[str], arms: list[str], seeds: list[int], jobs: int) -> list[Path]:
    """The grid: grid_arms (those chosen) from each task's SFT model (made first if missing), seed by seed, `jobs` at a
    time; the lift test's runs that a grid arm repeats are copied, not rerun (adopt_lift_runs); every finished run's
    last policy evaluated (final_eval). Returns the cells' folders."""
    folders = {out / task: start_stage(out, task)[0] for task in tasks}
    for folder in folders:
        adopt_lift_runs(folder, seeds=seeds)
    cells = [(folder, arm, seed) for seed in seeds for folder in folders for arm in arms]
    run_evaluated(cells, sft_dirs=folders, folder_arms={folder: grid_arms(folder.name) for folder in folders},
                  jobs=jobs)
    return [folder / f"{arm}-s{seed}" for folder, arm, seed in cells]


def run_evaluated(cells: list[tuple[Path, str, int]], *, sft_dirs: dict[Path, Path],
                  folder_arms: dict[Path, dict[str, list[str]]], jobs: int):
    """run_grid's cells (folder, arm, seed), each from its folder's SFT model (sft_dirs) with its folder's arms, and
    every finished run's last policy evaluated (final_eval): those done by an earlier invocation (or copied) first,
    the others as they end."""
    for folder, arm, seed in cells:
        if run_state(folder / f"{arm}-s{seed}", start=sft_digest(sft_dirs[folder])) == "done":
            final_eval(folder / f"{arm}-s{seed}")
    run_grid(cells, sft_dirs=sft_dirs, extras={folder: [] for folder in sft_dirs}, jobs=jobs, machine=this_machine(),
             folder_arms=folder_arms, on_done=final_eval)


def grid_choices(parser: argparse.ArgumentParser, *, task: str, arms: str, seeds: str, jobs: int,
                 known_arms: dict) -> tuple[list[str], list[str], list[int]]:
    """--task, --arms and --seeds as lists, or one line naming the bad value (and --jobs below 1)."""
    tasks, chosen = task.split(","), arms.split(",")
    if not all(x.strip().isdigit() for x in seeds.split(",")) or jobs < 1:
        parser.error(f"--seeds takes comma-separated non-negative integers and --jobs at least 1 (got {seeds!r}, "
                     f"{jobs})")
    if bad := [t for t in tasks if t not in TASKS] + [a for a in chosen if a not in known_arms]:
        parser.error(f"--task / --arms: unknown {bad} (tasks {list(TASKS)}, arms {list(known_arms)})")
    return tasks, chosen, [int(x) for x in seeds.split(",")]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calibrate", action="store_true", help="each task's SFT to convergence and its plateau")
    parser.add_argument("--lift", action="store_true", help="grpo and vine at two lrs from each task's SFT model")
    parser.add_argument("--task", default="easy,hard", help=f"the grid: comma-separated, of {list(TASKS)}")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"the grid: comma-separated, of {list(ARMS)}")
    parser.add_argument("--seeds", default=None, help="comma-separated seeds (the grid: 0,1,2,3,4; --lift: 0,1,2)")
    parser.add_argument("--jobs", type=int, default=2, help="runs at once, one thread each")
    parser.add_argument("--redraw", action="store_true", help="run nothing, summarize the finished runs")
    parser.add_argument("--out", default=OUT, help=f"results folder (default {OUT}, outside git)")
    args = parser.parse_args()
    tasks, arms, seeds = grid_choices(parser, task=args.task, arms=args.arms, jobs=args.jobs, known_arms=ARMS,
                                      seeds=args.seeds or ("0,1,2" if args.lift else "0,1,2,3,4"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.calibrate:
        text = (f"SFT: `sft.py {' '.join(SFT_SETTINGS)}` plus each task's flags; plateau in fp32, top-p 0.9, 500 "
                f"problems each.\n\n{calibrate(out)}\n")
        (out / "calibration.md").write_text(text)
        return print(text)
    if args.lift:
        text = lift(out, seeds=seeds, jobs=args.jobs, redraw=args.redraw)
        (out / "lift.md").write_text(text + "\n")
        return print(text)
    if not args.redraw:
        torch.set_num_threads(1)  # the final evaluations run here beside the other job
        grid(out, tasks=tasks, arms=arms, seeds=seeds, jobs=args.jobs)
    tasks = [t for t in TASKS if (out / t / "sft" / "plateau.json").exists()]
    print(report(out, settings=SETTINGS, arms={t: {a: f for a, f in grid_arms(t).items() if a in arms} for t in tasks}))


if __name__ == "__main__":
    main()
