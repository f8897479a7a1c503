"""When does credit assignment pay? The testbed along the horizon: vine against grpo as the chain grows longer
(chain-L<n>: n operation lines) and as filler lines grow the horizon at fixed difficulty (filler-F<n>: 4 operation
lines and n filler lines "~x", x a free tag the reward ignores).

    python -m research.credit.credit --seeds 0,1,2,3,4                 the grid (restartable: finished runs are skipped)
    python -m research.credit.credit --settings chain-L8 --seeds 0     one setting
    python -m research.credit.credit --redraw                          only the summary from the finished runs
    python -m research.credit.credit --diagnose --settings chain-L8    why: value error and sign accuracy on its SFT policy

Each setting has its own SFT model from scratch (OUT/<setting>/sft): the testbed's SFT recipe stopped at the first
check where greedy pass@1 on the validation split (problems in neither train nor test) reaches STOP_AT (sft.py
--stop-at), so that every length starts at a comparable pass@1. RL is the testbed's (research/grid.py SETTINGS:
64 x 8, 30 iterations, K = 9, ...) with --max-new-tokens scaled with the response (task_flags). Cells run in PLAN's
order, two at a time; each is OUT/<setting>/<arm>-s<seed>, bound to its SFT model by start.json. Compared on three
cost axes, paired vine - grpo by seed: per iteration, per sampled token, per training wall-clock; the slope of that
difference against L and against F (per seed, then mean +- SE over seeds): OUT/results.md, results.json, credit.png.
filler-F0 is chain-L4 (the same task and SFT model).
"""
import argparse
import json
import time
from pathlib import Path

from research.free_samples.truth import sample_groups, true_values
from research.grid import ARMS as TESTBED_ARMS
from research.grid import (ESTIMATORS, SFT_SETTINGS, done_runs, grid_arguments, grid_choices, run_grid, sft_digest,
                           sft_stage, this_machine, truth_arguments, truth_choices)
from research.readout import area, eval_curve, mean_se, pm, token_curve
from research.summary import summary
from runlog import read_metrics

OUT = "runs/credit"  # the default output, ignored by git (the committed grid: --out research/credit/results/credit)
SETTINGS = {"chain-L2": (2, 0), "chain-L4": (4, 0), "chain-L6": (6, 0), "chain-L8": (8, 0),
            "filler-F4": (4, 4), "filler-F8": (4, 8)}  # name -> (operation lines L, filler lines F)
ARMS = {"vine": ESTIMATORS["vine"], "grpo": ESTIMATORS["grpo"], "critic": ESTIMATORS["critic"],
        "rloo": ESTIMATORS["rloo"], "vine-free": TESTBED_ARMS["vine-free"]}
LONG_ONLY = ("critic", "rloo", "vine-free")  # arms run at chain-L8 only
STOP_AT, MAX_SFT_STEPS, WARMUP_STEPS = 0.5, 3000, 100


def task_flags(ops: int, filler: int) -> list[str]:
    """The task's flags for sft.py and train.py: a response's length limit of 16 tokens an operation line and 4 a
    filler line (the testbed's 64 at L = 4; the longest gold solution is 24, 43, 63, 84 characters at L = 2, 4, 6, 8,
    55 and 67 at F = 4, 8)."""
    return ["--arith-ops", str(ops), "--chain-filler", str(filler), "--max-new-tokens", str(16 * ops + 4 * filler)]


def sft_settings(ops: int, filler: int) -> list[str]:
    """The testbed's SFT recipe (constant lr 3e-3 after WARMUP_STEPS of warmup, batch 64) for this task, stopped at
    the first check (every 25 steps, 200 validation problems) where greedy pass@1 reaches STOP_AT, at most
    MAX_SFT_STEPS."""
    return [*SFT_SETTINGS, *task_flags(ops, filler), "--max-steps", str(MAX_SFT_STEPS), "--warmup-ratio",
            str(WARMUP_STEPS / MAX_SFT_STEPS), "--stop-at", str(STOP_AT), "--stop-every", "25", "--stop-size", "200"]


def arms_of(setting: str) -> list[str]:
    """vine and grpo everywhere; critic, rloo and vine-free (free samples, topup) at chain-L8 as well."""
    return [a for a in ARMS if a not in LONG_ONLY or setting == "chain-L8"]


def plan(settings: list[str], seeds: list[int], arms: list[str]) -> list[tuple[str, str, int]]:
    """The cells (setting, arm, seed) in the order they run: seed by seed, every setting's vine and grpo, shortest
    horizon first, so that each finished seed adds a whole pair to every setting; the chain-L8-only arms last."""
    core = [(s, a, seed) for seed in seeds for s in settings for a in ("vine", "grpo") if a in arms]
    extra = [(s, a, seed) for a in LONG_ONLY if a in arms for seed in seeds for s in settings if a in arms_of(s)]
    return core + extra


def per_seed(runs: dict[str, dict[int, list[dict]]]) -> dict[str, dict[str, dict[int, float]]]:
    """Each axis's score of every run of one setting (runs: arm -> seed -> metrics): "iteration", mean pass@1 over
    the evaluations after 0; "token", mean pass@1 over sampled tokens up to the setting's costliest run;
    "wall-clock", mean pass@1 over training minutes up to its longest run."""
    tokens = {a: {s: token_curve(r) for s, r in by_seed.items()} for a, by_seed in runs.items()}
    minutes = {a: {s: eval_curve(r) for s, r in by_seed.items()} for a, by_seed in runs.items()}
    most_tokens = max(c[-1][0] for by_seed in tokens.values() for c in by_seed.values())
    most_minutes = max(c[-1][0] for by_seed in minutes.values() for c in by_seed.values())
    return {"iteration": {a: {s: sum(x for _, x in c[1:]) / len(c[1:]) for s, c in by_seed.items()}
                          for a, by_seed in tokens.items()},
            "token": {a: {s: area(c, minutes=most_tokens) for s, c in by_seed.items()} for a, by_seed in tokens.items()},
            "wall-clock": {a: {s: area(c, minutes=most_minutes) for s, c in by_seed.items()}
                           for a, by_seed in minutes.items()}}


def paired(scores: dict[str, dict[str, dict[int, float]]], arm: str, baseline: str) -> dict[str, dict[int, float]]:
    """Per axis of per_seed's scores, arm - baseline by each seed both have."""
    return {axis: {s: v - by_arm[baseline][s] for s, v in by_arm.get(arm, {}).items() if s in by_arm.get(baseline, {})}
            for axis, by_arm in scores.items()}


def slope(xs: list[float], ys: list[float]) -> float:
    """The least-squares slope of ys against xs."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def slope_over_seeds(diffs: dict[float, dict[int, float]]) -> tuple[float, float, int]:
    """diffs: x (L or F) -> seed -> paired difference. The slope against x of each seed that has every x, then the
    mean +- SE over those seeds, and how many: a seed's draw is shared by its points, so seeds are the replicates."""
    seeds = sorted(set.intersection(*(set(d) for d in diffs.values()))) if diffs else []
    if len(diffs) < 2 or not seeds:
        return float("nan"), float("nan"), 0
    xs = sorted(diffs)
    mean, se = mean_se([slope(xs, [diffs[x][s] for x in xs]) for s in seeds])
    return mean, se, len(seeds)


def step_advantages(values: list[float], reward: float) -> list[float]:
    """A_j = r_j + V(s_{j+1}) - V(s_j) with gamma = 1, lam = 0 (values: one per state, the terminal 0 last; the
    reward falls on the last step)."""
    return [(reward if j == len(values) - 2 else 0.0) + values[j + 1] - values[j] for j in range(len(values) - 1)]


def sign_accuracy(true: list[float], estimate: list[float], *, at_least: float) -> tuple[int, int]:
    """(right, counted): of the steps whose true advantage is at least `at_least` in size, those whose estimate has
    the same sign (an estimate of 0, no credit, is never right)."""
    pairs = [(t, e) for t, e in zip(true, estimate) if abs(t) >= at_least]
    return sum(t * e > 0 for t, e in pairs), len(pairs)


def decisive_state(true_values: list[float], reward: float, *, lost: float) -> int | None:
    """The state before a wrong response's decisive step: the step after which its true value (values one per state,
    then the reward) first falls to `lost` or below. None if the response is right or already lost at the prompt."""
    chain = [*true_values, reward]
    if reward > 0 or chain[0] <= lost:
        return None
    return next(j - 1 for j in range(1, len(chain)) if chain[j] <= lost)


def diagnose(model_dir: Path, *, ops: int, filler: int, prompts: int, truth: int, seed: int) -> dict:
    """Why, on one setting's SFT policy: groups of 8 responses to `prompts` train problems
    (research.free_samples.truth.sample_groups), every distinct state's true value from `truth` vines, and K = 9 fresh
    vines as training takes them. Returns:
    - the value error of K = 9 (mean absolute; all states, and states of intermediate truth);
    - the sign accuracy, against the true step advantage where it is at least 0.1 in size, of vine's step advantages
      and of grpo's response advantage applied to every step (before whitening), and how often the estimate is 0
      there (no credit: counted wrong);
    - the share of each one's advantage mass on steps whose true advantage is below 0.05 in size (credit where none
      is due: filler lines, copied lines);
    - for the wrong responses, how often the decisive step (decisive_state) is the first (the prompt, which every
      member shares); for the others, how often another member passes through the state before it, and how often one
      of those is right (grpo then sees the step's two outcomes, as a vine would).
    Samples on one thread with 512 decode slots, as the grid's runs do."""
    import torch

    from advantages import group_baseline_advantages
    from ablations.free_samples import responses_through
    from values import estimate_values
    torch.set_num_threads(1)
    sampler, batch, keys = sample_groups(model_dir, prompts=prompts, seed=seed, ops=ops, filler=filler,
                                         max_new_tokens=16 * ops + 4 * filler, batch_size=512)
    true = true_values(sampler, batch, keys, truth=truth, seed=seed + 1)
    values, stats = estimate_values(sampler=sampler, K=9, seed=seed + 2, **batch)
    rewards, prompts_of = batch["rewards"], [tuple(p) for p in batch["prompts"]]
    grpo = group_baseline_advantages(rewards=rewards, groups=[hash(p) for p in prompts_of],
                                     lengths=[len(ks) for ks in keys], kind="grpo")
    sequences = [tuple(p + r) for p, r in zip(batch["prompts"], batch["responses"])]
    groups = {}
    for i, p in enumerate(prompts_of):
        groups.setdefault(p, []).append(i)
    errors, shared = [], []
    signs, mass = {"vine": [0, 0, 0], "grpo": [0, 0, 0]}, {"vine": [0.0, 0.0], "grpo": [0.0, 0.0]}
    for i, ks in enumerate(keys):
        truth_i = [true[k] for k in ks] + [0.0]
        errors += [(abs(v - true[k]), 0 < true[k] < 1) for v, k in zip(values[i], ks)]
        true_adv = step_advantages(truth_i, rewards[i])
        for name, estimate in (("vine", step_advantages(values[i], rewards[i])), ("grpo", grpo[i].tolist())):
            right, counted = sign_accuracy(true_adv, estimate, at_least=0.1)
            signs[name][0] += right
            signs[name][1] += counted
            signs[name][2] += sum(abs(t) >= 0.1 and e == 0 for t, e in zip(true_adv, estimate))  # no credit
            mass[name][0] += sum(abs(e) for t, e in zip(true_adv, estimate) if abs(t) < 0.05)
            mass[name][1] += sum(abs(e) for e in estimate)
        if (d := decisive_state(truth_i[:-1], rewards[i], lost=0.02)) is not None:
            through = [j for j in responses_through(ks[d], prompt=prompts_of[i], sequences=sequences, groups=groups)
                       if j != i]
            shared.append((d, bool(through), any(rewards[j] > 0 for j in through)))
    middle, past = [e for e, mid in errors if mid], [(s, r) for d, s, r in shared if d > 0]  # past the prompt
    return {"prompts": prompts, "truth": truth, "responses": len(keys), "steps_per_response": sum(map(len, keys)) /
            len(keys), "distinct_states": len(true), "reward_mean": sum(rewards) / len(rewards),
            "value_mae": sum(e for e, _ in errors) / len(errors), "value_mae_intermediate": sum(middle) / max(
                len(middle), 1), "vines": stats["vines"],
            **{f"sign_accuracy_{k}": r / max(n, 1) for k, (r, n, _) in signs.items()},
            **{f"sign_zero_{k}": z / max(n, 1) for k, (_, n, z) in signs.items()}, "signed_steps": signs["vine"][1],
            **{f"misplaced_{k}": m / max(t, 1e-12) for k, (m, t) in mass.items()},
            "wrong_with_decisive_state": len(shared), "decisive_at_prompt": 1 - len(past) / max(len(shared), 1),
            "decisive_state_shared": sum(s for s, _ in past) / max(len(past), 1),
            "decisive_state_right_sibling": sum(r for _, r in past) / max(len(past), 1)}


def diagnose_table(out: Path, settings: list[str]) -> str:
    """The diagnose.json of every setting that has one, a row each."""
    lines = ["| setting | steps / response | distinct states | value MAE, K = 9 (intermediate) | sign accuracy, vine (of it 0) | "
             "sign accuracy, grpo (of it 0) | advantage mass where none is due: vine | grpo | wrong responses decided at the "
             "prompt | decided later: another member shares the decisive state | ... and one of those is right |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for setting in settings:
        if (path := out / setting / "diagnose.json").exists():
            d = json.loads(path.read_text())
            lines.append(f"| {setting} | {d['steps_per_response']:.1f} | {d['distinct_states']} | "
                         f"{d['value_mae']:.3f} ({d['value_mae_intermediate']:.3f}) | "
                         f"{d['sign_accuracy_vine']:.3f} ({d['sign_zero_vine']:.3f}) | {d['sign_accuracy_grpo']:.3f} "
                         f"({d['sign_zero_grpo']:.3f}) | {d['misplaced_vine']:.3f} | "
                         f"{d['misplaced_grpo']:.3f} | {d['decisive_at_prompt']:.2f} of "
                         f"{d['wrong_with_decisive_state']} | {d['decisive_state_shared']:.2f} | "
                         f"{d['decisive_state_right_sibling']:.2f} |")
    return "\n".join(lines)


def credit_summary(out: Path, *, settings: list[str], started: float | None, extra: list[str]) -> str:
    """Each setting's own testbed summary (OUT/<setting>/results.md), then OUT/results.md, results.json and
    credit.png: per setting its SFT start and vine - grpo paired by seed on the three axes; the slopes against L and
    F; every chain-L8 arm paired with vine; the diagnostics."""
    rows, diffs, against_vine = {}, {}, {}
    for setting in settings:
        folder, (ops, filler) = out / setting, SETTINGS[setting]
        runs, _ = done_runs(folder, arms={a: ARMS[a] for a in arms_of(setting)}, start=sft_digest(folder / "sft"))
        if not runs:
            continue
        summary(folder, started=started, extra=[*task_flags(ops, filler), *extra],
                arms={a: ARMS[a] for a in arms_of(setting)}, sft_dir=folder / "sft",
                sft_settings=sft_settings(ops, filler))
        sft = [r for r in read_metrics(folder / "sft" / "metrics.jsonl") if "eval_accuracy" in r][-1]
        scores = per_seed(runs)
        if "vine" in runs and any(a in LONG_ONLY for a in runs):  # chain-L8: every arm, paired with vine by seed
            against_vine = {a: d for a in runs if a != "vine" and (d := paired(scores, a, "vine"))["iteration"]}
        diffs[setting] = paired(scores, "vine", "grpo")
        cost = {a: mean_se([sum(r["seconds"] - r.get("seconds_eval", 0.0) for r in recs if r["iteration"] > 0) / 30
                            for recs in by_seed.values()])[0] for a, by_seed in runs.items()}  # training, no eval
        rows[setting] = {"ops": ops, "filler": filler, "sft_steps": sft["iteration"],
                         "sft_validation": sft.get("validation_accuracy"), "sft_test": sft["eval_accuracy"],
                         "rl_start": mean_se([recs[0]["eval_accuracy"] for by_seed in runs.values()
                                              for recs in by_seed.values()])[0],  # the runs' iteration 0, fp32
                         "seconds_per_iteration": cost,
                         **{axis: (mean_se(list(d.values())) if d else (float("nan"), float("nan"))) + (len(d),)
                            for axis, d in diffs[setting].items()}}  # no pair yet: nan, 0 seeds
    lines = [f"SFT per setting: `sft.py` with the testbed's recipe and `--stop-at {STOP_AT}` (research/credit/credit.py "
             "sft_settings); RL: the testbed's recipe, 30 iterations, with the task's flags (task_flags).", "",
             "| setting | L | F | SFT steps | SFT validation pass@1 (sft.py, bf16) | SFT test pass@1 (sft.py, bf16) | "
             "the same model in the RL runs' iteration 0 (train.py, fp32) | seeds | vine − grpo per iteration "
             "| per sampled token | per wall-clock | train s / iteration, no eval (vine, grpo) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for setting, r in rows.items():
        n = r["iteration"][2]
        secs = ", ".join(f"{r['seconds_per_iteration'].get(a, float('nan')):.1f}" for a in ("vine", "grpo"))
        lines.append(f"| {setting} | {r['ops']} | {r['filler']} | {r['sft_steps']} | {r['sft_validation'] or 0:.3f} | "
                     f"{r['sft_test']:.3f} | {r['rl_start']:.3f} | {n} | " + " | ".join(pm(*r[axis][:2], n, signed=True) for axis in
                                                                  ("iteration", "token", "wall-clock")) + f" | {secs} |")
    slopes = {}
    for name, xs in (("L", {s: SETTINGS[s][0] for s in diffs if s.startswith("chain")}),
                     ("F", {s: SETTINGS[s][1] for s in diffs if SETTINGS[s][0] == 4})):
        slopes[name] = {axis: slope_over_seeds({x: diffs[s][axis] for s, x in xs.items()})
                        for axis in ("iteration", "token", "wall-clock")}
    lines += ["", "Slope of vine − grpo (per seed, then mean ± SE over the seeds that have every point; per sampled token "
              "and per wall-clock it is mostly the cost ratio: grpo's last pass@1 is held flat after its run ends, "
              "over most of those axes):", "",
              "| against | per iteration | per sampled token | per wall-clock | seeds | > 2 SE from 0 |",
              "| --- | --- | --- | --- | --- | --- |"]
    for name, by_axis in slopes.items():
        n = by_axis["iteration"][2]
        far = ", ".join(axis for axis, (m, se, k) in by_axis.items() if k > 1 and abs(m) > 2 * se) or "none"
        lines.append(f"| {name} | " + " | ".join("–" if not k else f"{m:+.4f} ± {se:.4f}" if k > 1 else f"{m:+.4f} ± –"
                                                 for m, se, k in by_axis.values())
                     + f" | {n} | {far} |")
    if against_vine:
        lines += ["", "Every arm at chain-L8, paired with vine by seed (arm − vine; mean ± SE over the seeds both have):",
                  "", "| arm | seeds | per iteration | per sampled token | per wall-clock |", "| --- | --- | --- | --- | --- |"]
        lines += [f"| {a} | {len(d['iteration'])} | " + " | ".join(pm(*mean_se(list(d[axis].values())), len(d[axis]), signed=True)
                                                                 for axis in ("iteration", "token", "wall-clock")) + " |"
                  for a, d in against_vine.items()]
    lines += ["", "Why, on each setting's SFT policy (`python -m research.credit.credit --diagnose`):", "",
              diagnose_table(out, settings)]
    text = "\n".join(lines) + "\n"
    (out / "results.md").write_text(text)
    (out / "results.json").write_text(json.dumps({"rows": rows, "slopes": slopes, "diffs": diffs,
                                                  "l8_against_vine": against_vine}, indent=1))
    plot_credit(diffs, out / "credit.png")
    return text


def plot_credit(diffs: dict[str, dict[str, dict[int, float]]], path: Path):
    """vine - grpo (mean +- SE over seeds) against L and against F, a line per cost axis."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, panels = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for panel, (name, pick) in zip(panels, (("L (operation lines; F = 0)", lambda s: s.startswith("chain")),
                                            ("F (filler lines; L = 4)", lambda s: SETTINGS[s][0] == 4))):
        chosen = sorted((SETTINGS[s][0] if name.startswith("L") else SETTINGS[s][1], s) for s in diffs if pick(s))
        for axis in ("iteration", "token", "wall-clock"):
            points = [(x, *mean_se(list(diffs[s][axis].values()))) for x, s in chosen if diffs[s][axis]]
            if points:
                panel.errorbar([p[0] for p in points], [p[1] for p in points], yerr=[p[2] for p in points],
                               marker="o", capsize=3, label=f"per {axis}")
        panel.axhline(0, color="grey", lw=0.8)
        panel.set_xlabel(name)
    panels[0].set_ylabel("vine − grpo, mean pass@1 (paired by seed)")
    panels[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    grid_arguments(parser, arm="arm", arms=ARMS, out=OUT)  # --seeds, --arms, --jobs, --out, --redraw
    parser.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated, of {list(SETTINGS)} "
                        "(critic, rloo, vine-free run at chain-L8 only)")
    parser.add_argument("--sft-only", action="store_true", help="make the settings' SFT models, nothing else")
    parser.add_argument("--diagnose", action="store_true", help="run nothing else: diagnose (value error, sign "
                        "accuracy, shared states) on each setting's SFT policy into OUT/<setting>/diagnose.json")
    truth_arguments(parser, mode="diagnose")  # --prompts, --truth
    args, extra = parser.parse_known_args()  # anything else goes to train.py
    arms, seeds = grid_choices(args, arm="arm", arms=ARMS)
    settings = args.settings.split(",")
    truth_choices(args)
    if unknown := [s for s in settings if s not in SETTINGS]:
        raise SystemExit(f"error: --settings: unknown {unknown} (choose from {list(SETTINGS)})")
    out, started = Path(args.out), time.time()
    out.mkdir(parents=True, exist_ok=True)
    if not args.redraw:
        sft_dirs = {out / s: sft_stage(out / s, settings=sft_settings(*SETTINGS[s]))[0] for s in settings}
        if args.diagnose:
            for s in settings:
                result = diagnose(sft_dirs[out / s], ops=SETTINGS[s][0], filler=SETTINGS[s][1], prompts=args.prompts,
                                  truth=args.truth, seed=seeds[0])
                (out / s / "diagnose.json").write_text(json.dumps(result, indent=1) + "\n")
                print(s, json.dumps(result), flush=True)
            return print(diagnose_table(out, settings))
        if args.sft_only:
            return
        cells = [(out / s, a, seed) for s, a, seed in plan(settings, seeds, arms) if a in arms_of(s)]
        run_grid(cells, sft_dirs=sft_dirs, extras={out / s: [*task_flags(*SETTINGS[s]), *extra] for s in settings},
                 jobs=args.jobs, machine=this_machine(), arms=ARMS)
    print(credit_summary(out, settings=list(SETTINGS), started=None if args.redraw else started, extra=extra))


if __name__ == "__main__":
    main()
