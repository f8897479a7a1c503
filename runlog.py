"""The run plumbing that train.py and sft.py share, so that each loop reads as its algorithm: metrics.jsonl and its
mirror to TensorBoard or Weights & Biases (`--track`), the progress line with its ETA, section timings and peak
memory, the training clock, when an evaluation or a checkpoint is due, and what Ctrl-C does. Nothing here changes
training.

metrics.jsonl (the source of truth, fsynced line by line before the checkpoint that covers it) is written by rank 0
alone; the other ranks' RunLog writes nothing and prints nothing. read_metrics reads it back (the plots, the grids).

Peak memory on a CPU is the process's resident high-water mark (VmHWM in /proc/self/status), reset at the start of
each section by writing 5 to /proc/self/clear_refs (Linux); elsewhere it is the run's peak so far. On CUDA it is
torch's peak of allocated memory, reset the same way.
"""
import contextlib
import ctypes
import dataclasses
import hashlib
import json
import math
import os
import re
import resource
import signal
import sys
import time
from pathlib import Path

import torch

import dist


def reset_peak_memory(device: torch.device):
    """Start a new high-water mark (best effort: without /proc, or in a sandbox that ignores the write, the mark
    keeps the run's peak)."""
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
    """Seconds and peak memory of the sections of one iteration: `with meter.section("name"):` around each (or
    start(), then stop("name") at the section's end)."""

    def __init__(self, device: torch.device):
        self.device, self.seconds, self.memory, self.began = device, {}, {}, time.perf_counter()

    def start(self):
        reset_peak_memory(self.device)
        self.began = time.perf_counter()

    def stop(self, name: str):
        self.seconds[name] = time.perf_counter() - self.began
        self.memory[name] = peak_memory_gb(self.device)

    @contextlib.contextmanager
    def section(self, name: str):
        """`with meter.section("rollout"):` start() before the block, stop("rollout") after it."""
        self.start()
        yield
        self.stop(name)

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


def progress_line(*, done: int, total: int, first: int, elapsed: float, budget_left: float | None = None) -> str:
    """'12/650 (1.8%) elapsed 38m, 190 s/it, ETA 33.7h': iterations done of the run, wall time since this process
    started iterating (evaluations included), its mean per iteration and the time to the end of the run (or of the
    --time-budget, when that comes first)."""
    per_it = elapsed / max(1, done - first)
    eta = per_it * (total - done)
    if budget_left is not None:
        eta = min(eta, max(0.0, budget_left))
    return (f"{done}/{total} ({100 * done / total:.1f}%) elapsed {duration(elapsed)}, {rate(per_it)}, "
            f"ETA {duration(eta)}")


def rate(per_it: float) -> str:
    """'190 s/it', '2.5 s/it', or for steps under a second '4.2 it/s' (never '0 s/it')."""
    if per_it >= 10:
        return f"{per_it:.0f} s/it"
    return f"{per_it:.1f} s/it" if per_it >= 1 else f"{1 / max(per_it, 1e-9):.1f} it/s"


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


def response_steps(*, token_ids: list[int], advantages: torch.Tensor, starts: list[int], tokenizer
                   ) -> tuple[list[str], list[float]]:
    """A response cut into its steps (`starts`: the first token of each, as the vines branched): each step's text and
    the mean advantage of its tokens (for VinePPO every token of a step has the same one)."""
    spans = [(a, b) for a, b in zip(starts, list(starts[1:]) + [len(token_ids)]) if b > a]
    texts = [tokenizer.decode(token_ids[a:b], skip_special_tokens=True) for a, b in spans]
    return texts, [advantages[a:b].float().mean().item() for a, b in spans]


class RunLog:
    """metrics.jsonl (appended to: a resumed run continues it), the --track mirror, and the one line per step."""

    def __init__(self, out_dir: Path, config, *, total: int, first: int, unit: str = "iteration", track: str = "none"):
        self.writer = dist.rank() == 0  # only rank 0 writes the run's files
        if self.writer:
            out_dir.mkdir(parents=True, exist_ok=True)
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
        """'iteration 12/650 (1.8%) elapsed 38m, 190 s/it, ETA 33.7h | <summary>' (progress_line)."""
        where = progress_line(done=done, total=self.total, first=self.first, elapsed=time.perf_counter() - self.started,
                         budget_left=budget_left)
        dist.print0(f"{self.unit} {where} | {summary}")

    def summary(self, done: int, record: dict, *, budget_left: float | None = None):
        """train.py's line after an iteration: where the run is, then this iteration's seconds, reward, KL to the
        reference, sampling speed, peak memory and (when evaluated) pass@1."""
        evaluated = f", eval {record['eval_accuracy']:.3f}" if "eval_accuracy" in record else ""
        self.line(done, f"this one {record['seconds']:.0f}s, reward {record['reward_mean']:.3f}, kl_ref "
                        f"{record.get('kl_ref', 0):.2e}, {record['tokens_per_s']:.0f} tok/s, {record['mem_gb']:.1f} GB"
                        f"{evaluated}", budget_left=budget_left)

    def responses(self, step: int, *, episodes, rewards: list[float], advantages: list, tokenizer, steps_of):
        """The first and the last response of the batch, each step under the advantage it got, for the tracker.
        steps_of(i): the first token of each of response i's steps (where its vines branched, or the text rule's)."""
        if not self.writer or self.tracker.kind == "none":
            return
        for i in (0, len(episodes.samples) - 1):
            steps, step_advantages = response_steps(token_ids=episodes.responses[i], advantages=advantages[i],
                                                    tokenizer=tokenizer, starts=steps_of(i))
            self.text(f"responses/{i}", sample_markdown(text_steps=steps, step_advantages=step_advantages,
                                                        reward=rewards[i], answer=episodes.answers[i]), step)

    def close(self):
        self.tracker.close()
        if self.file is not None:
            self.file.close()


def append_metrics(log, record: dict):
    """One metrics line, on disk (fsynced) before anything else of its iteration is."""
    log.write(json.dumps(record) + "\n")
    log.flush()
    os.fsync(log.fileno())


def read_metrics(path: str) -> list[dict]:
    """The records of a metrics.jsonl (append_metrics' lines), in order; a line that is not JSON is a one-line
    error."""
    records = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            raise SystemExit(f"error: {path}:{number}: not a JSON line") from None
    return records


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


def pause_point(name: str, iteration: int):
    """Test hook for the crash tests: with VINEPPO_PAUSE_AT=name:iteration, print and wait here until killed or
    signalled (a signal is then handled as anywhere else). Not in a worker that torchrun has restarted."""
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    if os.environ.get("VINEPPO_PAUSE_AT") == f"{name}:{iteration}" and not restarted:
        print(f"paused at {name}:{iteration} (rank {dist.rank()}, pid {os.getpid()})", flush=True)
        while GracefulStop.last_signal is None:
            time.sleep(0.05)


class GracefulStop:
    """SIGINT / SIGTERM. Outside hold() ... release(), a signal raises KeyboardInterrupt at once; inside, it is noted
    (`requested`) and the held section (an iteration's update and what follows it) runs to its end. A second signal
    raises at once; `holding` then stays True: the weights are half-updated and must not be saved."""

    last_signal = None  # of any instance: what pause_point waits for

    def __init__(self):
        self.requested, self.holding = None, False
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self.handle)

    def handle(self, signum, frame):
        first = self.requested is None
        self.requested = GracefulStop.last_signal = signum
        if self.holding and first:
            print(f"\n{signal.Signals(signum).name}: finishing this iteration's update, then saving (send it again to "
                  "stop at once, losing the iteration)", flush=True)
            return
        raise KeyboardInterrupt

    def hold(self):
        self.holding = True

    def release(self):
        self.holding = False

    def any_rank(self) -> bool:
        """Whether any rank has been signalled (under torchrun all ranks then stop together)."""
        return dist.all_sum(torch.tensor([float(self.requested is not None)]))[0].item() > 0

    def exit_code(self) -> int:
        return 128 + (self.requested or signal.SIGINT)


def mark_crossed(before: float, after: float, *, every: float) -> bool:
    """Whether the clock passed a multiple of `every` seconds between `before` (excluded) and `after` (included);
    never when `every` is 0. Stateless, so a resumed run keeps the cadence from its restored clock."""
    return every > 0 and math.floor(after / every) > math.floor(before / every)


class Clock:
    """Seconds of training (evaluations excluded), carried over on --resume; rank 0's clock decides for every rank
    whether the --time-budget is spent (`out_of_time`) and whether an --eval-every-seconds mark was passed
    (`crossed`) by the last iteration."""

    def __init__(self, seconds: float, *, budget: float, eval_every: float):
        self.seconds, self.budget, self.eval_every = seconds, budget, eval_every
        self.out_of_time = self.crossed = False

    def add(self, seconds: float):
        before, self.seconds = self.seconds, self.seconds + seconds
        self.out_of_time = dist.broadcast(self.budget > 0 and self.seconds >= self.budget)
        self.crossed = dist.broadcast(mark_crossed(before, self.seconds, every=self.eval_every))

    def budget_left(self) -> float | None:
        return self.budget - self.seconds if self.budget > 0 else None


def silent_groups(groups: list[int], rewards: list[float], advantages: list[torch.Tensor]) -> list[int]:
    """Groups (one problem's responses) without contrast, all right or all wrong: grpo's advantages there are 0.
    Returns the counts [groups, silent all right, silent all wrong, responses in silent groups, of them those with a
    nonzero raw advantage on some token (what vines found there), silent groups with such a response]."""
    members = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    counts = [len(members), 0, 0, 0, 0, 0]
    for idx in members.values():
        outcomes = {rewards[i] for i in idx}
        if len(outcomes) == 1:
            credited = sum(bool((advantages[i] != 0).any()) for i in idx)
            counts[1 if outcomes == {1.0} else 2] += 1
            counts[3] += len(idx)
            counts[4] += credited
            counts[5] += credited > 0
    return counts


def iteration_record(done: int, *, episodes, rewards: list[float], advantages: list, stats: dict, lr: float,
                     clock: Clock, meter: Meter) -> dict:
    """The metrics line of a training iteration (before its evaluation), every figure over all ranks: reward,
    response length, the raw advantages' moments, the groups without contrast (silent_groups), the value / update /
    mismatch stats, tokens sampled per second (rollouts, --resample-silent's fresh responses and vines, over the
    seconds of the sections that sampled them)."""
    responses = episodes.responses
    raw = torch.cat(dist.all_gather(torch.cat(advantages)))  # (N,) all ranks' tokens
    response_tokens = dist.all_sum(torch.tensor([sum(map(len, responses))]))[0].item()
    generated = response_tokens + stats.get("vine_tokens", 0)
    total, right, wrong, silent, credited, found = dist.all_sum(torch.tensor(silent_groups(episodes.groups, rewards,
                                                                                           advantages))).tolist()
    return {"iteration": done, "train_seconds": clock.seconds, "reward_mean": dist.mean(rewards),
            "silent_frac": (right + wrong) / max(total, 1), "silent_right_frac": right / max(total, 1),
            "silent_wrong_frac": wrong / max(total, 1), "silent_credited_frac": credited / max(silent, 1),
            "silent_found_frac": found / max(right + wrong, 1),
            "response_length": dist.mean(list(map(len, responses))),
            "finished_frac": dist.mean([float(s.finished) for s in episodes.samples]),
            "advantage_mean": raw.mean().item(), "advantage_std": raw.std().item() if len(raw) > 1 else 0.0,
            "advantage_abs_mean": raw.abs().mean().item(), "lr": lr, **stats,
            "sampled_tokens": generated,
            "tokens_per_s": generated / sum(meter.seconds.get(k, 0.0) for k in ("rollout", "resample", "values"))}
