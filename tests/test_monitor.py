"""monitor.py: the progress line, per-section peak memory, the TensorBoard mirror read back, responses as text."""
import pytest
import torch

from config import parse_config
from monitor import Meter, Tracker, duration, progress, response_steps, sample_markdown, tracker_missing


def test_duration_and_progress():
    assert [duration(s) for s in (42, 1020, 12240, 190000)] == ["42s", "17m", "3.4h", "2.2d"]
    line = progress(done=12, total=650, first=2, elapsed=1900.0)
    assert line == "12/650 (1.8%) elapsed 32m, 190 s/it, ETA 33.7h"  # 638 x 190 s left
    assert progress(done=12, total=650, first=2, elapsed=1900.0, budget_left=600).endswith("ETA 10m")
    assert progress(done=3, total=3, first=0, elapsed=30.0).endswith("10 s/it, ETA 0s")


def test_meter_peak_memory_is_per_section():
    """A section that holds 400 MB peaks at least that much above one that holds nothing, after it in time."""
    meter = Meter(torch.device("cpu"))
    meter.start()
    block = torch.ones(100_000_000)  # 400 MB, touched
    block += 1
    meter.stop("big")
    del block
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
    steps, means = response_steps(token_ids=ids, text=text, advantages=advantages, tokenizer=tokenizer,
                                  task="gsm8k", split="auto")
    assert steps == ["3 + 4 = 7\n", "7 * 2 = 14\n#### 14"]  # the answer line belongs to the last step (values.py)
    first_two = len(tokenizer(steps[0], add_special_tokens=False).input_ids)
    advantages[:first_two] = 0.5  # the first step's tokens
    _, means = response_steps(token_ids=ids, text=text, advantages=advantages, tokenizer=tokenizer,
                              task="gsm8k", split="auto")
    assert means == [0.5, 0.0]
    markdown = sample_markdown(text_steps=steps, step_advantages=means, reward=1.0, answer="14")
    assert markdown.splitlines() == ["reward 1 (gold answer 14)", "", "    [A +0.500] 3 + 4 = 7",
                                     "    [A +0.000] 7 * 2 = 14", " " * 15 + "#### 14"]
