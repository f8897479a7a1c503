"""The testbed grid's summary, which scripts/testbed.py and the testbed's studies (research/branching,
research/free_samples, research/credit) write: OUT/results.md, results.json and curves.png over every finished run
made from the folder's SFT model (summary: research/readout.py's statistics, and pass@1 against iterations, the
training signal, each run), the table of this invocation's runs beside the committed reference grids
(invocation_table), and arm_grid: a study's grid of arms from the testbed's SFT model, run, then summarized.
"""
import json
import time
from pathlib import Path

from research.grid import (ESTIMATORS, EVAL_EVERY, ITERATIONS, ROOT, SETTINGS, SFT_SETTINGS, describe, done_runs,
                           run_cells, sft_digest, sft_stage, this_machine)
from research.readout import (paired_cells, plot_bands, pm, signal_table, summarize, summarize_grid,
                              summary_markdown, table)
from runlog import read_metrics

THRESHOLD = 0.7  # pass@1 whose time to reach the summary reports (the SFT start: ~0.54)
# the committed 5-seed grids from this SFT recipe a newcomer's run is placed beside: every estimator, and the
# free-sample grid (vine-free and the separate critic)
REFERENCES = ("research/testbed/results/testbed", "research/free_samples/results/free-samples")


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
