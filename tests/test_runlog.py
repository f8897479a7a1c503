"""runlog.py: the plumbing train.py and sft.py share (when a save is due, the metrics file, Ctrl-C) and what a
person watching a run sees (the progress line, per-section peak memory, the TensorBoard mirror read back, responses as
text)."""
import json
import re
import signal
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from config import parse_config, tracker_missing
from runlog import (Meter, RunLog, Tracker, due, duration, peak_memory_gb, progress_line, reset_peak_memory,
                    response_steps, return_free_memory, sample_markdown, stop_after_interrupt)
from values import step_token_starts


@dataclass
class TinyConfig:
    lr: float = 1e-5


def test_due_every_n_at_the_last_step_and_when_asked():
    assert [d for d in range(1, 11) if due(d, every=4, last=10)] == [4, 8, 10]
    assert due(3, every=4, last=10, now=True) and not due(3, every=4, last=10)


def test_runlog_writes_each_record_at_once_and_prints_one_line(tmp_path, capsys):
    config = TinyConfig()
    runlog = RunLog(tmp_path, config, total=10, first=2, unit="step")
    runlog.write({"iteration": 3, "loss": 0.5})
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {"iteration": 3, "loss": 0.5}  # on disk already
    runlog.line(3, "loss 0.5000", budget_left=None)
    out = capsys.readouterr().out
    assert out.startswith("step 3/10 (30.0%) elapsed") and out.rstrip().endswith("| loss 0.5000")
    runlog.close()
    RunLog(tmp_path, config, total=10, first=3).write({"iteration": 4})  # a resumed run appends
    assert [json.loads(x)["iteration"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [3, 4]


@pytest.mark.parametrize("holding", [False, True])
def test_interrupt_saves_unless_it_cut_an_update(holding, capsys):
    saved = []
    stop = SimpleNamespace(holding=holding, exit_code=lambda: 128 + signal.SIGINT)
    with pytest.raises(SystemExit) as exit_:
        stop_after_interrupt(stop, save=lambda: saved.append(True), completed=7, unit="step")
    assert exit_.value.code == 130 and saved == ([] if holding else [True])
    out = capsys.readouterr().out
    assert ("nothing saved" in out) if holding else ("after step 7" in out)


def test_duration_and_progress():
    assert [duration(s) for s in (42, 1020, 12240, 190000)] == ["42s", "17m", "3.4h", "2.2d"]
    line = progress_line(done=12, total=650, first=2, elapsed=1900.0)
    assert line == "12/650 (1.8%) elapsed 32m, 190 s/it, ETA 33.7h"  # 638 x 190 s left
    assert progress_line(done=12, total=650, first=2, elapsed=1900.0, budget_left=600).endswith("ETA 10m")
    assert progress_line(done=3, total=3, first=0, elapsed=30.0).endswith("10 s/it, ETA 0s")
    assert progress_line(done=4, total=300, first=0, elapsed=10.0).endswith("2.5 s/it, ETA 12m")
    assert progress_line(done=50, total=300, first=0, elapsed=12.0).endswith("4.2 it/s, ETA 60s")  # not "0 s/it"


def resident_gb() -> float:
    """This process's resident memory now (VmRSS), GB."""
    with open("/proc/self/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+) kB", f.read()).group(1)) * 1e3 / 1e9


def high_water_mark_resets() -> bool:
    """Whether this kernel lowers VmHWM through /proc/self/clear_refs: after a freed 400 MB block, a reset must drop
    the mark by most of it. Some sandboxes accept the write and keep the mark (seen in CI: both sections at 1.465 GB)."""
    block = torch.ones(100_000_000)
    block += 1
    del block
    return_free_memory()
    before = peak_memory_gb(torch.device("cpu"))
    reset_peak_memory(torch.device("cpu"))
    return peak_memory_gb(torch.device("cpu")) < before - 0.3


def test_meter_peak_memory_is_per_section():
    """A section that holds 400 MB peaks at least that much above one that holds nothing, after it in time."""
    return_free_memory()  # what earlier tests freed, which the heap would keep resident (and reuse for the block)
    if not high_water_mark_resets():
        pytest.skip("this kernel keeps VmHWM through a write to /proc/self/clear_refs; per-section peaks are the "
                    "run's peak here")
    meter = Meter(torch.device("cpu"))
    meter.start()
    block = torch.ones(100_000_000)  # 400 MB, touched
    block += 1
    meter.stop("big")
    del block
    return_free_memory()
    if resident_gb() > meter.memory["big"] - 0.3:  # seen once in a clean-clone run here: big and small both 1.477
        pytest.skip("the freed block stayed resident, so no later section can peak lower")
    meter.start()
    small = torch.ones(1000)
    meter.stop("small")
    record = meter.record()
    assert record["mem_gb_big"] - record["mem_gb_small"] > 0.3  # the mark was reset between them
    assert record["mem_gb"] == record["mem_gb_big"] and record["seconds_big"] > 0 and small.sum() == 1000


def test_tensorboard_mirror_reads_back(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    tracker = Tracker("tensorboard", tmp_path, parse_config(["--k", "3"]))
    tracker.log({"iteration": 0, "eval_accuracy": 0.25, "train_seconds": 0.0})
    tracker.log({"iteration": 1, "reward_mean": 0.5, "approx_kl": 1e-3, "note": "not a number"})
    tracker.text("responses/0", "    [A +0.500] 3 + 4 = 7", 1)
    tracker.close()
    events = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0, "tensors": 0}).Reload()
    assert sorted(events.Tags()["scalars"]) == ["approx_kl", "eval_accuracy", "reward_mean", "train_seconds"]
    assert [(e.step, e.value) for e in events.Scalars("reward_mean")] == [(1, 0.5)]
    assert events.Scalars("approx_kl")[0].value == pytest.approx(1e-3)
    text = events.Tensors("responses/0/text_summary")[0].tensor_proto.string_val[0].decode()
    assert text == "    [A +0.500] 3 + 4 = 7"


def test_tracker_missing_package_is_named(monkeypatch):
    import importlib.util
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert tracker_missing("wandb") == "--track wandb needs the `wandb` package (pip install wandb)"
    assert tracker_missing("none") is None


def test_response_steps_carry_their_advantage(smol):
    _, tokenizer = smol
    text = "3 + 4 = 7\n7 * 2 = 14\n#### 14"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    advantages = torch.zeros(len(ids))
    starts = step_token_starts(ids, text, tokenizer=tokenizer, task="gsm8k")
    steps, means = response_steps(token_ids=ids, advantages=advantages, starts=starts, tokenizer=tokenizer)
    assert steps == ["3 + 4 = 7\n", "7 * 2 = 14\n#### 14"]  # the answer line belongs to the last step (values.py)
    first_two = len(tokenizer(steps[0], add_special_tokens=False).input_ids)
    advantages[:first_two] = 0.5  # the first step's tokens
    _, means = response_steps(token_ids=ids, advantages=advantages, starts=starts, tokenizer=tokenizer)
    assert means == [0.5, 0.0]
    markdown = sample_markdown(text_steps=steps, step_advantages=means, reward=1.0, answer="14")
    assert markdown.splitlines() == ["reward 1 (gold answer 14)", "", "    [A +0.500] 3 + 4 = 7",
                                     "    [A +0.000] 7 * 2 = 14", " " * 15 + "#### 14"]


def test_silent_groups_counts_groups_without_contrast_and_the_credit_found_there():
    """Groups of one problem's responses: mixed outcomes are not silent; all right / all wrong are, and a silent
    group's response counts as credited when any of its tokens has a nonzero raw advantage (vines found contrast)."""
    import torch
    from runlog import silent_groups
    groups = [0, 0, 1, 1, 2, 2, 3]
    rewards = [1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    advantages = [torch.tensor([0.5]), torch.tensor([-0.5]), torch.zeros(3), torch.zeros(2),
                  torch.tensor([0.0, -0.3]), torch.zeros(4), torch.zeros(1)]
    assert silent_groups(groups, rewards, advantages) == [4, 1, 2, 5, 1, 1]
    assert silent_groups([0, 0], [1.0, 0.0], [torch.ones(1), torch.ones(1)]) == [1, 0, 0, 0, 0, 0]
