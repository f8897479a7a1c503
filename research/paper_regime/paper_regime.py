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
(final_eval: 16 samples at T 0.35). The recipe the paper-regime grids share: research/paper_regime/recipe.py; the
read-out: research/paper_regime/regime_report.py; the design: research/paper_regime/README.md.
"""
import argparse
from pathlib import Path

import torch

from research.grid import SETTINGS, done_runs, run_grid, sft_digest, this_machine
from research.paper_regime.recipe import (ARMS, SFT_SETTINGS, TASKS, adopt_runs, calibrate, grid_choices, matched_flags,
                                          run_evaluated, start_stage)
from research.paper_regime.regime_report import report
from research.readout import mean_se, pm

OUT = "runs/paper-regime"  # the default output, ignored by git (the committed runs: --out research/paper_regime/results/paper-regime)
LIFT_ARMS = {f"{estimator}-lr{lr}": ["--estimator", estimator, "--lr", lr]
             for estimator in ("grpo", "vine") for lr in ("5e-5", "2e-4")}
ADOPTED = {"grpo": "grpo-lr5e-5", "vine": "vine-lr5e-5"}  # grid arms whose command a lift arm already ran
# grpo-matched's responses per prompt: matched_samples on the lift test's seed-0 runs at lr 5e-5 (vine's and grpo's
# mean sampled tokens an iteration: easy 85.0k / 19.5k -> 34.9; hard 95.2k / 19.6k -> 38.8)
MATCHED = {"easy": 36, "hard": 40}


def grid_arms(task: str) -> dict[str, list[str]]:
    """The grid's arms on one task: ARMS with grpo-matched's flags for that task's MATCHED samples."""
    return {arm: flags or matched_flags(MATCHED[task]) for arm, flags in ARMS.items()}


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


def adopt_lift_runs(task_dir: Path, *, seeds: list[int]) -> list[str]:
    """The lift test's finished runs whose command a grid arm repeats (ADOPTED: the same train.py flags and start),
    copied into the grid's task folder (adopt_runs)."""
    return adopt_runs(task_dir / "lift", task_dir, names=ADOPTED, seeds=seeds, start=sft_digest(task_dir / "sft"))


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
