"""What a person watching a run sees: section timings and peak memory, the progress line with its ETA, and the
mirror of metrics.jsonl to TensorBoard or Weights & Biases (`--track`). Plumbing: nothing here changes training.

Peak memory on a CPU is the process's resident high-water mark (VmHWM in /proc/self/status), reset at the start
of each section by writing 5 to /proc/self/clear_refs (Linux); elsewhere it is the run's peak so far. On CUDA it is
torch's peak of allocated memory, reset the same way.
"""
import ctypes
import dataclasses
import hashlib
import importlib.util
import re
import resource
import sys
import time
from pathlib import Path

import torch

from values import step_token_starts

TRACKERS = ("none", "tensorboard", "wandb")


def reset_peak_memory(device: torch.device):
    """Start a new high-water mark (best effort: without /proc the mark keeps the run's peak)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_memory_gb(device: torch.device) -> float:
    """GB at the high-water mark since the last reset: resident memory of this process (CPU), allocated (CUDA)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    try:
        with open("/proc/self/status") as f:
            return int(re.search(r"VmHWM:\s+(\d+) kB", f.read()).group(1)) * 1e3 / 1e9
    except (OSError, AttributeError):
        scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, kB on Linux
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 1e9


def return_free_memory():
    """Hand the memory the heap keeps after big frees back to the OS (glibc's malloc_trim; elsewhere nothing). After
    an update, glibc would keep ~2.5 GB of freed activations resident, and the next sampling's KV caches (mapped
    afresh) would come on top of them."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


class Meter:
    """Seconds and peak memory of the sections of one iteration: start(), then stop("name") at the section's end."""

    def __init__(self, device: torch.device):
        self.device, self.seconds, self.memory, self.began = device, {}, {}, time.perf_counter()

    def start(self):
        reset_peak_memory(self.device)
        self.began = time.perf_counter()

    def stop(self, name: str):
        self.seconds[name] = time.perf_counter() - self.began
        self.memory[name] = peak_memory_gb(self.device)

    def record(self) -> dict:
        """seconds_<section> and mem_gb_<section> for the metrics line, and mem_gb: the iteration's peak."""
        return {**{f"seconds_{k}": v for k, v in self.seconds.items()},
                **{f"mem_gb_{k}": round(v, 3) for k, v in self.memory.items()},
                "mem_gb": round(max(self.memory.values(), default=0.0), 3)}


def duration(seconds: float) -> str:
    """42s, 17m, 3.4h or 2.1d."""
    for limit, unit, size in ((120, "s", 1), (7200, "m", 60), (172800, "h", 3600)):
        if seconds < limit:
            return f"{seconds / size:.0f}{unit}" if unit != "h" else f"{seconds / size:.1f}h"
    return f"{seconds / 86400:.1f}d"


def progress(*, done: int, total: int, first: int, elapsed: float, budget_left: float | None = None) -> str:
    """'12/650 (1.8%) elapsed 38m, 190 s/it, ETA 33.7h': iterations done of the run, wall time since this process
    started iterating (evaluations included), its mean per iteration and the time to the end of the run (or of the
    --time-budget, when that comes first)."""
    per_it = elapsed / max(1, done - first)
    eta = per_it * (total - done)
    if budget_left is not None:
        eta = min(eta, max(0.0, budget_left))
    return (f"{done}/{total} ({100 * done / total:.1f}%) elapsed {duration(elapsed)}, {per_it:.0f} s/it, "
            f"ETA {duration(eta)}")


def tracker_missing(kind: str) -> str | None:
    """Why --track `kind` cannot run here, or None (checked at parse time, before anything is written)."""
    if kind != "none" and importlib.util.find_spec(kind) is None:  # the package is named like the tracker
        return f"--track {kind} needs the `{kind}` package (pip install {kind})"
    return None


class Tracker:
    """Mirrors each metrics.jsonl record (the source of truth, written first) to TensorBoard (<out-dir>/tb) or W&B
    (project "vineppo", one run per out-dir, resumed with it; WANDB_MODE=offline logs without a network)."""

    def __init__(self, kind: str, out_dir: Path, config):
        self.kind, self.writer, self.run = kind, None, None
        flags = dataclasses.asdict(config)
        if kind == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(str(out_dir / "tb"))
            self.writer.add_text("config", "\n".join(f"    --{k.replace('_', '-')} {v}" for k, v in flags.items()))
        elif kind == "wandb":
            import wandb
            run_id = hashlib.sha1(str(out_dir.resolve()).encode()).hexdigest()[:12]
            self.run = wandb.init(project="vineppo", name=out_dir.name, id=run_id, resume="allow", config=flags,
                                  dir=str(out_dir))

    def log(self, record: dict):
        """Every number of a metrics line, at step = its iteration."""
        step = record["iteration"]
        scalars = {k: float(v) for k, v in record.items() if isinstance(v, (int, float)) and k != "iteration"}
        if self.writer is not None:
            for name, value in scalars.items():
                self.writer.add_scalar(name, value, step)
            self.writer.flush()
        if self.run is not None:
            self.run.log(scalars, step=step)

    def text(self, name: str, markdown: str, step: int):
        if self.writer is not None:
            self.writer.add_text(name, markdown, step)
            self.writer.flush()
        if self.run is not None:
            import wandb
            self.run.log({name: wandb.Html(f"<pre>{markdown}</pre>")}, step=step)

    def close(self):
        if self.writer is not None:
            self.writer.close()
        if self.run is not None:
            self.run.finish()


def sample_markdown(*, text_steps: list[str], step_advantages: list[float], reward: float, answer: str) -> str:
    """One response as markdown for a tracker: each reasoning step under the (mean) advantage its tokens got."""
    lines = [f"reward {reward:.0f} (gold answer {answer})", ""]
    for text, advantage in zip(text_steps, step_advantages):  # a code block: indented, continuation lines aligned
        head = f"    [A {advantage:+.3f}] "
        lines.append(head + text.strip().replace("\n", "\n" + " " * len(head)))
    return "\n".join(lines)


def response_steps(*, token_ids: list[int], text: str, advantages: torch.Tensor, tokenizer, task: str,
                   split: str) -> tuple[list[str], list[float]]:
    """A response cut into its reasoning steps (the dataset's rule, as for the vines): each step's text and the mean
    advantage of its tokens (for VinePPO every token of a step has the same one)."""
    starts = step_token_starts(token_ids, text, tokenizer=tokenizer, task=task, split=split)
    spans = [(a, b) for a, b in zip(starts, list(starts[1:]) + [len(token_ids)]) if b > a]
    texts = [tokenizer.decode(token_ids[a:b], skip_special_tokens=True) for a, b in spans]
    return texts, [advantages[a:b].float().mean().item() for a, b in spans]
