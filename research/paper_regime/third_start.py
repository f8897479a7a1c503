"""A third SFT start (C) on the paper-regime hard task: the paper's K ablation, the corrected silent-group arms, and
every gap of the earlier grids measured again from another start.

    python -m research.paper_regime.third_start --calibrate          C's SFT (the committed one if its digest matches) and plateau
    python -m research.paper_regime.third_start --seeds 0,1,2,3,4    the grid, seed by seed (restartable)
    python -m research.paper_regime.third_start --arms vine --seeds 0 --out runs/check    one cell, from the committed start

C is the hard task's recipe (research.paper_regime.recipe: SFT_SETTINGS + the borrow-carry bug) with SFT seed 1 instead of 0
(STARTS["hard-c"]); its weights are committed in research/paper_regime/results/paper-regime/hard-c/sft beside their sha256, so a cell reruns
on any CPU (recipe.start_stage). Arms (the paper-regime recipe, research/grid.py SETTINGS at lr 5e-5):
    vine, vine-k3, vine-k1     VinePPO with K = 9 (the paper), 3 and 1 fresh vines a state
    critic                     the paper's PPO: a separate critic (value lr 1e-3)
    grpo                       and grpo-matched: grpo given vine's sampled tokens on C (matched_samples)
    vine-silent                vines where the group's other responses agree (corrected rule), grpo's elsewhere
    grpo-resample              grpo and M fresh responses to each silent group (exact steps), M spending
                               vine-silent's vine tokens on C (recipe.resample_count)
Seed 0 of vine, grpo and vine-silent runs first: grpo-matched's responses per prompt and grpo-resample's M are
measured from those three runs (MEASURED.json in the task folder) before either runs. Then every arm, seed by seed.
Each finished run's last policy is evaluated as the paper (recipe.final_eval). The design: research/paper_regime/README.md,
"A third start".
"""
import argparse
import json
from pathlib import Path

import torch

from research.paper_regime.recipe import ARMS as REGIME_ARMS
from research.paper_regime.recipe import (SFT_SETTINGS, STARTS, calibrate, grid_choices, matched_flags, matched_samples,
                                          resample_count, resample_flags, run_evaluated, start_stage)
from research.paper_regime.regime_report import sft_validation
from runlog import read_metrics

OUT, TASK = "runs/paper-regime", "hard-c"  # default output, outside git (committed: --out research/paper_regime/results/paper-regime)
ARMS = {"vine": REGIME_ARMS["vine"], "vine-k3": ["--estimator", "vine", "--k", "3"],
        "vine-k1": ["--estimator", "vine", "--k", "1"], "critic": REGIME_ARMS["critic"], "grpo": REGIME_ARMS["grpo"],
        "grpo-matched": None,  # matched_flags(MEASURED["samples_per_prompt"])
        "vine-silent": ["--estimator", "vine", "--vines-where", "silent"],
        "grpo-resample": None}  # resample_flags(MEASURED["resample_silent"])
MEASURING = ("vine", "grpo", "vine-silent")  # their seed 0 sets the two measured arms


def measure(task_dir: Path) -> dict:
    """MEASURED.json, written once from seed 0 of MEASURING: grpo-matched's responses per prompt (vine's mean sampled
    tokens an iteration over grpo's) and grpo-resample's M (vine-silent's vine tokens over its silent groups' fresh
    response tokens)."""
    path = task_dir / "MEASURED.json"
    if not path.exists():
        if missing := [arm for arm in MEASURING if not (task_dir / f"{arm}-s0" / "final.json").exists()]:
            raise SystemExit(f"error: {task_dir}: grpo-matched and grpo-resample are measured on seed 0 of "
                             f"{', '.join(MEASURING)}; {', '.join(missing)} not finished: run `--seeds 0` first")
        records = {arm: read_metrics(task_dir / f"{arm}-s0" / "metrics.jsonl") for arm in MEASURING}
        tokens = {arm: sum(r["sampled_tokens"] for r in rs if r["iteration"] > 0) / sum(r["iteration"] > 0 for r in rs)
                  for arm, rs in records.items()}
        path.write_text(json.dumps({"vine_tokens": tokens["vine"], "grpo_tokens": tokens["grpo"],
                                    "samples_per_prompt": matched_samples(vine_tokens=tokens["vine"],
                                                                          grpo_tokens=tokens["grpo"]),
                                    "resample_silent": resample_count(records["vine-silent"])}, indent=1))
    return json.loads(path.read_text())


def grid_arms(task_dir: Path) -> dict[str, list[str]]:
    """Every arm's train.py flags; the two measured ones only once MEASURED.json exists."""
    measured = json.loads((task_dir / "MEASURED.json").read_text()) if (task_dir / "MEASURED.json").exists() else None
    flags = {arm: f for arm, f in ARMS.items() if f}
    if measured:
        flags["grpo-matched"] = matched_flags(measured["samples_per_prompt"])
        flags["grpo-resample"] = resample_flags(measured["resample_silent"])
    return {arm: flags[arm] for arm in ARMS if arm in flags}


def grid(out: Path, *, arms: list[str], seeds: list[int], jobs: int):
    """MEASURING's seed 0 first (those asked), MEASURED.json from them, then the arms asked seed by seed."""
    task_dir = out / TASK
    sft_dir, _ = start_stage(out, TASK)
    first = [(task_dir, arm, 0) for arm in MEASURING if arm in arms and 0 in seeds]
    if first:
        run_evaluated(first, sft_dirs={task_dir: sft_dir}, folder_arms={task_dir: grid_arms(task_dir)}, jobs=jobs)
    if {"grpo-matched", "grpo-resample"} & set(arms):
        measure(task_dir)
    cells = [(task_dir, arm, seed) for seed in seeds for arm in arms]
    run_evaluated(cells, sft_dirs={task_dir: sft_dir}, folder_arms={task_dir: grid_arms(task_dir)}, jobs=jobs)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calibrate", action="store_true", help="C's SFT start and its plateau")
    parser.add_argument("--rebuild-start", action="store_true", help="--calibrate: make C by sft.py even where the "
                                                                        "committed start matches its digest")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {list(ARMS)}")
    parser.add_argument("--seeds", default="0,1,2,3,4", help="comma-separated seeds")
    parser.add_argument("--jobs", type=int, default=2, help="runs at once, one thread each")
    parser.add_argument("--out", default=OUT, help=f"results folder (default {OUT}, outside git)")
    args = parser.parse_args()
    _, arms, seeds = grid_choices(parser, task="hard", arms=args.arms, seeds=args.seeds, jobs=args.jobs,
                                  known_arms=ARMS)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.calibrate:  # the table, and the validation path (the read-out's sft_validation) under it
        path = "\n".join(f"| {step} | {acc:.3f} | {lr:.1e} |" for step, acc, lr in sft_validation(out / TASK / "sft"))
        text = (f"SFT: `sft.py {' '.join(SFT_SETTINGS)} {' '.join(STARTS[TASK])}`; plateau in fp32, top-p 0.9, 500 "
                f"problems each.\n\n{calibrate(out, tasks=[TASK], rebuild=args.rebuild_start)}\n\nValidation path "
                f"(greedy pass@1, 200 problems):\n\n| step | pass@1 | lr |\n| --- | --- | --- |\n{path}\n")
        (out / "calibration-c.md").write_text(text)
        return print(text)
    torch.set_num_threads(1)  # the final evaluations run here beside the other job
    grid(out, arms=arms, seeds=seeds, jobs=args.jobs)


if __name__ == "__main__":
    main()
