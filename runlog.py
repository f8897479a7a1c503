"""The run plumbing that train.py and sft.py share, so that each loop reads as its algorithm: metrics.jsonl and its
mirror to the tracker, the progress line, when an evaluation or a checkpoint is due, and what Ctrl-C does. Nothing
here changes training.

A run's record keeping: metrics.jsonl (the source of truth, fsynced line by line before the checkpoint that covers
it) is written by rank 0 alone; the other ranks' RunLog writes nothing and prints nothing.
"""
import sys
import time
from pathlib import Path

import dist
from checkpoint import append_metrics
from monitor import Tracker, progress


class RunLog:
    """metrics.jsonl (appended to: a resumed run continues it), the --track mirror, and the one line per step."""

    def __init__(self, out_dir: Path, config, *, total: int, first: int, unit: str = "iteration", track: str = "none"):
        self.writer = dist.rank() == 0  # only rank 0 writes the run's files
        self.file = open(out_dir / "metrics.jsonl", "a") if self.writer else None
        self.tracker = Tracker(track if self.writer else "none", out_dir, config)
        self.total, self.first, self.unit = total, first, unit
        self.started = time.perf_counter()

    def start_clock(self):
        """Start the progress line's clock (after the step-0 evaluation, so that its s/it are the loop's)."""
        self.started = time.perf_counter()

    def write(self, record: dict):
        """One metrics line on disk, then to the tracker."""
        if self.writer:
            append_metrics(self.file, record)
            self.tracker.log(record)

    def text(self, name: str, markdown: str, step: int):
        if self.writer:
            self.tracker.text(name, markdown, step)

    def line(self, done: int, summary: str, *, budget_left: float | None = None):
        """'iteration 12/650 (1.8%) elapsed 38m, 190 s/it, ETA 33.7h | <summary>' (monitor.progress)."""
        where = progress(done=done, total=self.total, first=self.first, elapsed=time.perf_counter() - self.started,
                         budget_left=budget_left)
        dist.print0(f"{self.unit} {where} | {summary}")

    def close(self):
        self.tracker.close()
        if self.file is not None:
            self.file.close()


def due(done: int, *, every: int, last: int, now: bool = False) -> bool:
    """Whether an evaluation (or a checkpoint) is due after step `done`: every `every` steps, at the last one, and
    whenever `now` (a time budget reached, a clock cadence crossed, a stop requested)."""
    return done % every == 0 or done == last or now


def stop_after_interrupt(stop, *, save, completed: int, unit: str = "iteration"):
    """What Ctrl-C (or a second SIGTERM) ends with: if it cut an update (stop.holding), the weights in memory are
    half-updated and nothing is saved; otherwise `save()` writes the state after step `completed`. Then exits with
    128 + the signal's number."""
    if stop.holding:
        print("stopped during an update: nothing saved; --resume continues from the last checkpoint", flush=True)
    else:
        print(f"interrupted: saving the state after {unit} {completed}", flush=True)
        save()
    sys.exit(stop.exit_code())
