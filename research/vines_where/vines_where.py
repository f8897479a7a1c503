"""Vines where the group is silent, from the paper-regime grid's starts: do vines spent only in groups
without contrast beat the same samples spent as fresh responses?

    python -m research.vines_where.vines_where --arms vine-silent --seeds 0   first: vine-silent's seed 0 on both tasks
    python -m research.vines_where.vines_where --measure                       then: M per task from those runs (RESAMPLE)
    python -m research.vines_where.vines_where --seeds 0,1,2,3,4               the grid (restartable; --task hard: one task)
    python -m research.vines_where.vines_where --redraw                        results.md, results.json, curves.png

Arms, from each paper-regime task's SFT model (research.paper_regime.paper_regime, run first; its folder: --regime) with the same
recipe (research/grid.py SETTINGS at lr 5e-5):
    vine-silent    --vines-where silent: grpo's advantages in groups with contrast, VinePPO's (K = 9) in the others
    grpo-resample  --resample-silent M: grpo, and M fresh responses more to each silent group's prompt; M per task
                   (RESAMPLE) gives it vine-silent's sampled tokens an iteration, measured on vine-silent's seed 0
    vine, grpo     the paper-regime grid's runs of the same seeds, copied (the same start, checked by sha256); from
                   a start rebuilt on another CPU kind, run them first into --regime (`python -m research.paper_regime.paper_regime
                   --task hard --arms grpo,vine --seeds 0,1,2,3,4`; research/vines_where/README.md, amendment)
The read-out (research/paper_regime/regime_report.py, PAIRS below) pairs them by seed on three axes: per iteration, per sampled
token, per training wall-clock; and logs the silent groups, the share the vines found contrast in, the same for the
fresh responses. The design: research/vines_where/README.md.
"""
import argparse
import shutil
from pathlib import Path

import torch

from research.grid import SETTINGS, sft_digest
from research.paper_regime.recipe import ARMS as REGIME_ARMS
from research.paper_regime.recipe import (TASKS, adopt_runs, grid_choices, resample_count, resample_flags,
                                          run_evaluated)
from research.paper_regime.regime_report import report, start_shift
from runlog import read_metrics

OUT, REGIME = "runs/vines-where", "runs/paper-regime"  # defaults, outside git (committed: results/...)
# grpo-resample's fresh responses per silent group: resample_count on vine-silent's seed 0 of each task (--measure),
# from the starts rebuilt 2026-12-07 (research/vines_where/README.md): hard 41.7k vine tokens an iteration over 0.633 x 64 silent
# groups x 38.1 tokens a response -> 27; easy 48.5k over 0.803 x 64 x 37.9 -> 25
RESAMPLE: dict[str, int] = {"hard": 27, "easy": 25}
ARMS = {"vine-silent": ["--estimator", "vine", "--vines-where", "silent"],
        "grpo-resample": None}  # grpo, M fresh responses more to each silent group: resample_flags(RESAMPLE[task])
BASE = ("vine", "grpo")  # the paper-regime grid's arms, copied seed by seed
PAIRS = [("vine-silent", "grpo-resample"), ("vine-silent", "grpo"), ("vine-silent", "vine"),
         ("grpo-resample", "grpo")]


def grid_arms(task: str, arms: list[str]) -> dict[str, list[str]]:
    """The chosen arms' train.py flags on one task; grpo-resample only once its M is measured (RESAMPLE)."""
    if "grpo-resample" in arms and task not in RESAMPLE:
        raise SystemExit(f"error: grpo-resample on {task}: M is not measured yet (RESAMPLE); run `--arms vine-silent "
                         f"--seeds 0`, then `--measure`")
    return {a: ARMS[a] or resample_flags(RESAMPLE[task]) for a in arms}


def task_folder(out: Path, regime: Path, task: str, *, seeds: list[int]) -> Path:
    """out/<task>, bound to the paper-regime task's start: its sft/model.sha256 and plateau.json copied, and its
    finished and evaluated vine and grpo runs of these seeds (adopt_runs: a copy taken during the run's final
    evaluation would lack final.json for good). Returns the paper-regime SFT folder (the model)."""
    sft = regime / task / "sft"
    if not (start := sft_digest(sft)) or not (sft / "plateau.json").exists():
        raise SystemExit(f"error: {sft}: no SFT model with its plateau; run `python -m research.paper_regime.paper_regime --task "
                         f"{task}` first, or pass --regime")
    (out / task / "sft").mkdir(parents=True, exist_ok=True)
    for name in ("model.sha256", "plateau.json"):
        shutil.copy(sft / name, out / task / "sft" / name)
    adopt_runs(regime / task, out / task, names={a: a for a in BASE}, seeds=seeds, start=start, evaluated=True)
    return sft


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", default=",".join(TASKS), help=f"comma-separated, of {list(TASKS)}")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {list(ARMS)}")
    parser.add_argument("--seeds", default="0,1,2,3,4", help="comma-separated seeds, paired with the regime grid's")
    parser.add_argument("--jobs", type=int, default=2, help="runs at once, one thread each")
    parser.add_argument("--measure", action="store_true", help="run nothing: M per task from vine-silent-s0")
    parser.add_argument("--redraw", action="store_true", help="run nothing, summarize the finished runs")
    parser.add_argument("--regime", default=REGIME, help=f"the paper-regime grid's folder (default {REGIME})")
    parser.add_argument("--out", default=OUT, help=f"results folder (default {OUT}, outside git)")
    args = parser.parse_args()
    tasks, arms, seeds = grid_choices(parser, task=args.task, arms=args.arms, seeds=args.seeds, jobs=args.jobs,
                                      known_arms=ARMS)
    out, regime = Path(args.out), Path(args.regime)
    if args.measure:
        for task in tasks:
            run = out / task / "vine-silent-s0"
            if not (run / "metrics.jsonl").exists():
                raise SystemExit(f"error: {run}: no metrics; run `--arms vine-silent --seeds 0` first")
            print(f"{task}: M = {resample_count(read_metrics(run / 'metrics.jsonl'))}")
        return
    if not args.redraw:
        torch.set_num_threads(1)  # the final evaluations run here beside the other job
        flags = {out / task: grid_arms(task, arms) for task in tasks}  # first: an unmeasured M writes nothing
        sft_dirs = {out / task: task_folder(out, regime, task, seeds=seeds) for task in tasks}
        run_evaluated([(folder, arm, seed) for seed in seeds for folder in sft_dirs for arm in arms],
                      sft_dirs=sft_dirs, folder_arms=flags, jobs=args.jobs)
    tasks = [t for t in TASKS if (out / t / "sft" / "plateau.json").exists()]
    chosen = {t: {**{a: REGIME_ARMS[a] for a in BASE}, **grid_arms(t, [a for a in ARMS if ARMS[a] or t in RESAMPLE])}
              for t in tasks}
    text = report(out, settings=SETTINGS, arms=chosen, pairs=PAIRS)
    shifts = [f"**{t}.** " + start_shift({"A": regime / t, "B": out / t}, arms=list(BASE)) for t in tasks
              if (regime / t / "sft" / "plateau.json").exists()]  # the regime grid's start (A) against this one (B)
    if shifts:
        text += "\nThe start's effect: the same arms from the paper-regime grid's start (A) and this grid's (B).\n\n"
        text += "\n\n".join(shifts) + "\n"
        (out / "results.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
