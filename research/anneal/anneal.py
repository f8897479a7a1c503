"""Why RL cannot lift an annealed SFT start: the testbed's SFT with four schedule tails from one
constant-lr trunk, what each start offers RL (research.anneal.anneal_probes), and RL from each.

    python -m research.anneal.anneal --seeds 0,1,2                    starts, probes, then RL (restartable)
    python -m research.anneal.anneal --seeds 0,1,2 --starts-only      the SFT starts and their probes, no RL
    python -m research.anneal.anneal --redraw                         only the summary from what is finished

Per seed s: the testbed's SFT recipe (research/grid.py SFT_SETTINGS: a 1M Llama from scratch on chain, batch 64,
lr 3e-3, WARMUP steps of warmup) at constant lr for TRUNK steps into OUT/trunk-s<s>/sft; then four tails, each
resumed from a copy of a checkpoint (sft.py --resume applies a changed schedule from the saved step):
    decay      TAIL more steps, the lr decaying linearly to 0 (sft.py --decay-steps TAIL)
    floor      the same decay, to FLOOR x lr (--lr-floor)
    rewarm     decay's model, then REWARM steps at the constant lr again
    constant   the trunk at constant lr until greedy pass@1 on the validation problems reaches decay's (checked every
               MATCH_EVERY steps, at most MATCH_MAX): a start of decay's pass@1 that never decayed
OUT/<start>-s<s> holds sft/, probe.json (research.anneal.anneal_probes, bound to the model's sha256) and the RL runs
<arm>-s<s>: the testbed's RL recipe (research/grid.py SETTINGS: 64 x 8, lr 5e-5, 30 iterations), grpo and vine
from every start, grpo at lr 2e-5 and 5e-6 from decay and constant. The grpo arms run seed by seed, then vine,
`--jobs` at a time.
OUT/results.md, results.json, anneal.png: the starts' probes and RL's gain from each, mean +- SE over seeds, paired
with decay by seed.
"""
import argparse
import json
import shutil
import time
from pathlib import Path

import torch

from research.anneal.anneal_probes import VERSION, probe
from research.grid import (ESTIMATORS, EVAL_EVERY, SFT_SETTINGS, done_runs, grid_arguments, grid_choices, run_grid,
                           sft_digest, sft_stage, this_machine)
from research.readout import mean_se
from runlog import read_metrics

OUT = "runs/anneal"  # the default output, ignored by git (the committed grid: --out research/anneal/results/anneal)
WARMUP, TRUNK, TAIL, REWARM, FLOOR, MATCH_EVERY, MATCH_MAX = 100, 200, 100, 25, 0.1, 5, 400
STARTS = ("decay", "floor", "rewarm", "constant")  # RL starts from these; the trunk is probed as well
ARMS = {"grpo": ESTIMATORS["grpo"], "grpo-lr2e-5": [*ESTIMATORS["grpo"], "--lr", "2e-5"],
        "grpo-lr5e-6": [*ESTIMATORS["grpo"], "--lr", "5e-6"], "vine": ESTIMATORS["vine"]}
LOW_LR_STARTS = ("decay", "constant")  # where the lower lrs run
SHOWN = ("val_pass", "gold_loss", "sharpness", "random_0.003_loss", "random_0.003_pass", "pg_0.0004_loss",
         "pg_0.0004_pass", "pg_0.001_pass", "pgsgd_0.0004_loss", "pgsgd_0.0004_pass", "pg_slope", "pg_curvature",
         "pg_best_eta", "pgsgd_slope", "pgsgd_curvature", "pgsgd_best_eta", "pg_norm", "pg_half_cosine",
         "pg_sft_cosine", "reward", "mixed_groups", "entropy")


def schedule(start: str, *, match: float | None = None) -> tuple[str | None, int, list[str]]:
    """Where a start resumes from (None: fresh; else the start whose checkpoint it copies), that checkpoint's step,
    and its sft.py flags after SFT_SETTINGS. match: decay's validation pass@1, for constant."""
    def total(steps: int) -> list[str]:  # the warmup stays WARMUP steps whatever the total
        return ["--max-steps", str(steps), "--warmup-ratio", repr(WARMUP / steps)]
    decay = ["--lr-decay", "--decay-steps", str(TAIL)]
    return {"trunk": (None, 0, [*total(TRUNK), "--no-lr-decay"]),
            "decay": ("trunk", TRUNK, [*total(TRUNK + TAIL), *decay]),
            "floor": ("trunk", TRUNK, [*total(TRUNK + TAIL), *decay, "--lr-floor", str(FLOOR)]),
            "rewarm": ("decay", TRUNK + TAIL, [*total(TRUNK + TAIL + REWARM), "--no-lr-decay"]),
            "constant": ("trunk", TRUNK, [*total(TRUNK + MATCH_MAX), "--no-lr-decay", "--stop-at", str(match),
                                          "--stop-every", str(MATCH_EVERY), "--stop-size", "200"])}[start]


def copy_checkpoint(source: Path, target: Path, *, step: int):
    """Seed target (an SFT folder) with source's checkpoint at `step` and its metrics, for sft.py --resume; nothing
    happens if target already holds a checkpoint or a final model. `latest` is written last: a copy cut short is
    redone."""
    if (target / "latest").exists() or (target / "config.json").exists():
        return
    name = f"ckpt-{step:06d}"
    if not (source / name).exists():
        raise SystemExit(f"error: {source}: no checkpoint {name} to start {target} from (the run was cut or changed)")
    target.mkdir(parents=True, exist_ok=True)
    shutil.copytree(source / name, target / name, dirs_exist_ok=True)
    shutil.copy(source / "metrics.jsonl", target / "metrics.jsonl")
    (target / "latest").write_text(name)


def make_start(out: Path, start: str, seed: int) -> Path:
    """The start's SFT model for this seed (made once; a cut one resumes), its sha256 in model.sha256, and its
    probe.json; returns its folder (OUT/<start>-s<seed>)."""
    folder = out / f"{start}-s{seed}"
    match = probed(out, "decay", seed)["val_pass"] if start == "constant" else None
    source, step, flags = schedule(start, match=match)
    if source is not None:
        copy_checkpoint(make_start(out, source, seed) / "sft", folder / "sft", step=step)
    sft_stage(folder, settings=[*SFT_SETTINGS, "--seed", str(seed), *flags])
    probed(out, start, seed)
    return folder


def probed(out: Path, start: str, seed: int) -> dict:
    """probe.json of OUT/<start>-s<seed>, measured now if missing or made from other weights."""
    folder = out / f"{start}-s{seed}"
    digest, path = sft_digest(folder / "sft"), folder / "probe.json"
    saved = json.loads(path.read_text()) if path.exists() else {}
    if [saved.get("sft_sha256"), saved.get("version")] == [digest, VERSION]:
        return saved
    t0 = time.perf_counter()
    result = {"sft_sha256": digest, **probe(str(folder / "sft"), seed=seed)}
    result["seconds"] = round(time.perf_counter() - t0, 1)
    path.with_suffix(".tmp").write_text(json.dumps(result, indent=1) + "\n")
    path.with_suffix(".tmp").replace(path)  # whole or not at all: a kill leaves no half-written probe
    print(f"{folder}: probed in {result['seconds']:.0f} s: {json.dumps(result)}", flush=True)
    return result


def plan(seeds: list[int], arms: list[str]) -> list[tuple[str, str, int]]:
    """The RL cells (start, arm, seed): the grpo arms seed by seed (each from every start, the lower lrs from
    LOW_LR_STARTS), then vine seed by seed."""
    order = [(seed, arm) for seed in seeds for arm in arms if arm != "vine"] + [(seed, "vine") for seed in seeds
                                                                                if "vine" in arms]
    return [(start, arm, seed) for seed, arm in order for start in STARTS
            if not arm.startswith("grpo-lr") or start in LOW_LR_STARTS]


def sft_record(folder: Path) -> dict:
    """The SFT run's steps and greedy test pass@1 (its last metrics line)."""
    last = read_metrics(folder / "sft" / "metrics.jsonl")[-1]
    return {"steps": last["iteration"], "test_pass": last.get("eval_accuracy")}


def gains(records: list[dict]) -> dict:
    """A run's pass@1 at iteration 0, the mean of its later evaluations minus it, and its last minus it."""
    evals = [(r["iteration"], r["eval_accuracy"]) for r in records if "eval_accuracy" in r]
    later = [a for i, a in evals if i > 0]
    return {"start": evals[0][1], "mean_gain": sum(later) / len(later) - evals[0][1],
            "end_gain": evals[-1][1] - evals[0][1]}


def cell(values: dict[int, float], base: dict[int, float] | None = None) -> str:
    """mean +- SE over seeds, to 3 significant digits; with base, the paired difference to it (seeds both have)."""
    if base is not None:
        values = {s: v - base[s] for s, v in values.items() if s in base}
    if not values:
        return "–"
    (mean, se), sign = mean_se(list(values.values())), "+" if base is not None else ""
    return f"{mean:{sign}.3g} ± {se:.2g}" if len(values) > 1 else f"{mean:{sign}.3g} ± –"


def summary(out: Path, seeds: list[int]) -> str:
    """results.md, results.json and anneal.png over what is finished in out."""
    starts = {s: {seed: {**sft_record(out / f"{s}-s{seed}"), **json.loads((out / f"{s}-s{seed}" / "probe.json")
                                                                           .read_text())}
                  for seed in seeds if (out / f"{s}-s{seed}" / "probe.json").exists()} for s in ("trunk", *STARTS)}
    rl = {}
    for s in STARTS:
        for seed in seeds:
            runs, _ = done_runs(out / f"{s}-s{seed}", arms=ARMS, start=sft_digest(out / f"{s}-s{seed}" / "sft"))
            for arm, by_seed in runs.items():
                rl.setdefault(arm, {}).setdefault(s, {})[seed] = {**gains(by_seed[seed]), "records": by_seed[seed]}
    keys, shown = ["steps", "test_pass", *SHOWN], [s for s, by_seed in starts.items() if by_seed]
    paired = [s for s in shown if s not in ("trunk", "decay")] if starts["decay"] else []
    lines = ["## The starts (mean ± SE over seeds; then each start − decay, paired by seed)", "",
             "| quantity | " + " | ".join(shown) + " | " + " | ".join(f"{s} − decay" for s in paired) + " |",
             "|" + " --- |" * (1 + len(shown) + len(paired))]
    for key in keys:
        values = {s: {seed: v[key] for seed, v in starts[s].items()} for s in shown}
        lines.append(f"| {key} | " + " | ".join(cell(values[s]) for s in shown) + " | " +
                     " | ".join(cell(values[s], values["decay"]) for s in paired) + " |")
    lines += ["", "## RL from each start (pass@1 on 500 test problems, greedy)", "",
              "| arm | start | seeds | pass@1 at iteration 0 | mean of later evaluations − start | end − start | "
              "mean gain − decay's (paired) |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for arm, by_start in rl.items():
        for s, by_seed in by_start.items():
            pick = {k: {seed: g[k] for seed, g in by_seed.items()} for k in ("start", "mean_gain", "end_gain")}
            base = {seed: g["mean_gain"] for seed, g in by_start.get("decay", {}).items()}
            lines.append(f"| {arm} | {s} | {len(by_seed)} | {cell(pick['start'])} | {cell(pick['mean_gain'])} | "
                         f"{cell(pick['end_gain'])} | {'–' if s == 'decay' else cell(pick['mean_gain'], base)} |")
    text = "\n".join(lines) + "\n"
    (out / "results.md").write_text(text)
    (out / "results.json").write_text(json.dumps({"starts": starts, "rl": {a: {s: {seed: {k: v for k, v in g.items()
                                                  if k != "records"} for seed, g in b.items()} for s, b in bs.items()}
                                                  for a, bs in rl.items()}}, indent=1))
    if rl:
        plot(rl, out / "anneal.png")
    return text


def plot(rl: dict, path: Path):
    """Greedy pass@1 against iterations, a panel per arm, a line per start (mean +- SE over seeds)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, panels = plt.subplots(1, len(rl), figsize=(5 * len(rl), 4), sharey=True, squeeze=False)
    for panel, (arm, by_start) in zip(panels[0], rl.items()):
        for s, by_seed in by_start.items():
            curves = [{r["iteration"]: r["eval_accuracy"] for r in g["records"] if "eval_accuracy" in r}
                      for g in by_seed.values()]
            its = sorted(set.intersection(*(set(c) for c in curves)))
            points = [mean_se([c[i] for c in curves]) for i in its]
            panel.errorbar(its, [m for m, _ in points], yerr=[e for _, e in points], marker="o", ms=3, capsize=2,
                           label=f"{s} ({len(curves)})")
        panel.set_title(arm)
        panel.set_xlabel(f"iteration (evaluated every {EVAL_EVERY})")
    panels[0][0].set_ylabel("greedy pass@1 (500 test problems)")
    panels[0][0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    grid_arguments(parser, arm="arm", arms=ARMS, out=OUT)  # --seeds, --arms, --jobs, --out, --redraw
    parser.add_argument("--starts-only", action="store_true", help="make and probe the SFT starts, no RL")
    args, extra = parser.parse_known_args()  # anything else goes to train.py
    arms, seeds = grid_choices(args, arm="arm", arms=ARMS)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)  # the probes: a tiny model, beside another single-thread job (as the runs)
    if not args.redraw:
        for seed in seeds:
            for start in ("trunk", *STARTS):
                make_start(out, start, seed)
        if not args.starts_only:
            cells = [(out / f"{s}-s{seed}", arm, seed) for s, arm, seed in plan(seeds, arms)]
            run_grid(cells, sft_dirs={c[0]: c[0] / "sft" for c in cells}, extras={c[0]: extra for c in cells},
                     jobs=args.jobs, machine=this_machine(), arms=ARMS)
    print(summary(out, seeds))


if __name__ == "__main__":
    main()
