"""The paper-regime recipe that its grids share (research.paper_regime.paper_regime, .third_start,
research.vines_where.vines_where): the tasks and their SFT starts (start_stage: the committed one where its digest
matches, else sft.py), each start's plateau (calibrate), the arms, the two that spend vine's sampled tokens otherwise
(grpo-matched: matched_samples; grpo-resample: resample_count), and the runner that evaluates each finished run's last
policy as the paper does (run_evaluated, final_eval). The design: research/paper_regime/README.md.
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
from research.grid import TASK, run_grid, run_state, sft_digest, sft_stage, this_machine
from rollout import evaluate
from runlog import read_metrics

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
PROMPTS, SAMPLES, MINIBATCH = 64, 8, 64  # SETTINGS' batch: 64 prompts x 8 responses, 8 optimizer steps an iteration
ARMS = {"vine": ["--estimator", "vine"],  # K = 9 fresh vines at every state (the paper)
        "vine-free": ["--estimator", "vine", "--free-samples", "topup"],  # the group's responses count toward K
        "critic": ["--estimator", "critic", "--critic", "separate", "--value-lr", "1e-3"],  # the paper's PPO
        "grpo": ["--estimator", "grpo"],
        "grpo-matched": None}  # grpo given vine's sampled tokens: paper_regime.grid_arms, third_start's MEASURED
# (evaluation temperature, samples per problem, split, problems): the plateau's three measurements
PLATEAU = {"test greedy": (0.0, 1, "test", 500), "test T 0.35 x 16": (0.35, 16, "test", 500),
           "train T 0.6 x 4": (0.6, 4, "train", 500)}


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


def resample_count(records: list[dict]) -> int:
    """M: fresh responses per silent group that spend a vine-silent run's vine tokens, over its iterations:
    sum of vine tokens / sum of (silent groups x mean response length), rounded (at least 1)."""
    trained = [r for r in records if r.get("iteration", 0) > 0 and "silent_frac" in r]
    fresh = sum(r["silent_frac"] * PROMPTS * r["response_length"] for r in trained)
    if not trained or fresh == 0:
        raise SystemExit("error: no silent group in those runs' metrics: M cannot be measured")
    return max(1, round(sum(r.get("vine_tokens", 0) for r in trained) / fresh))


def resample_flags(extra: int) -> list[str]:
    """grpo-resample's train.py flags: grpo, and `extra` fresh responses more to each silent group's prompt."""
    return ["--estimator", "grpo", "--resample-silent", str(extra)]


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
        records = read_metrics(sft_dir / "metrics.jsonl")
        best = max((r for r in records if "validation_accuracy" in r), key=lambda r: r["validation_accuracy"])
        cells = [f"{result[name][0]:.3f} ± {result[name][1]:.3f}" for name in PLATEAU]
        lines.append(f"| {task} | `{' '.join(flags)}` | {best['iteration']} ({best['validation_accuracy']:.3f}) | "
                     + " | ".join(cells) + f" | {digest[:12]}… |")
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
