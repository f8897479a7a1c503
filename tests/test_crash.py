"""Crash tests: tiny runs killed with SIGKILL at named points (a test hook, VINEPPO_PAUSE_AT=point:iteration, makes
the run wait there), then resumed; and SIGTERM during an update. What they check is what a resume restores, so they
run chain with a tiny scratch model (conftest's `scratch`: a second an iteration where the real SmolLM2 takes twenty);
the real model's checkpoint and resume end to end: tests/test_train.py's smoke test."""
import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from conftest import REPO

TINY = ["--dataset", "arith", "--prompts-per-iter", "2", "--samples-per-prompt", "2", "--max-new-tokens", "16",
        "--k", "2", "--eval-size", "2", "--eval-samples", "1", "--eval-every", "100", "--save-every", "1",
        "--sampler", "hf", "--iterations", "4"]


def start(out, *args, pause=None):
    """train.py with TINY, then args (a later flag wins), in its own process; pause: VINEPPO_PAUSE_AT."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"}
    env.pop("VINEPPO_PAUSE_AT", None)
    if pause:
        env["VINEPPO_PAUSE_AT"] = pause
    return subprocess.Popen([sys.executable, "train.py", *TINY, "--out-dir", str(out), *args], cwd=REPO, env=env,
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def wait_for(proc, text: str) -> str:
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if text in line:
            return "".join(seen)
    proc.wait()
    raise AssertionError(f"the run ended (rc {proc.returncode}) before printing {text!r}:\n{''.join(seen)}")


def iterations(out) -> list[int]:
    return [json.loads(line)["iteration"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def committed(out) -> str:
    return (out / "latest").read_text()


@pytest.mark.slow  # end to end: real train.py / torchrun processes
def test_kill_at_every_point_then_resume(tmp_path, scratch):
    """SIGKILL mid-rollout, after the update, between the metrics line and the checkpoint, and mid-save; after each,
    --resume continues from the last committed checkpoint, losing only the iteration in progress."""
    from transformers import AutoModelForCausalLM
    out = tmp_path / "run"
    for n, point in enumerate(["rollout:2", "ppo:2", "metrics:2", "save:2"]):
        proc = start(out, *scratch, "--iterations", "3", *(["--resume"] if n else []), pause=point)
        wait_for(proc, f"paused at {point}")
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert committed(out) == "ckpt-000001", point  # iteration 2 was in progress: not committed
        assert iterations(out)[:2] == [0, 1] and iterations(out) in ([0, 1], [0, 1, 2]), point
        if point == "save:2":
            assert list(out.glob(".tmp-ckpt-*")), "the dead save should have left its temp folder"
    proc = start(out, *scratch, "--iterations", "3", "--resume")
    log = proc.communicate(timeout=600)[0]
    assert proc.returncode == 0 and "resumed from" in log, log
    assert iterations(out) == [0, 1, 2, 3]  # each iteration exactly once
    assert committed(out) == "ckpt-000003" and not list(out.glob(".tmp-ckpt-*"))
    model = AutoModelForCausalLM.from_pretrained(out / "ckpt-000003")
    assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all()


@pytest.mark.slow  # end to end: real train.py / torchrun processes
def test_sigterm_during_an_update_finishes_the_iteration_and_saves(tmp_path, scratch):
    out = tmp_path / "run"
    proc = start(out, *scratch, pause="ppo:2")
    wait_for(proc, "paused at ppo:2")
    proc.send_signal(signal.SIGTERM)
    log = proc.communicate(timeout=300)[0]
    assert proc.returncode == 128 + signal.SIGTERM, log
    assert "finishing this iteration's update" in log
    assert iterations(out) == [0, 1, 2] and committed(out) == "ckpt-000002"
    proc = start(out, *scratch, "--resume", "--iterations", "3")  # a changed --iterations is applied
    log = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0 and "applying changed flags: --iterations 4 -> 3" in log, log
    assert iterations(out) == [0, 1, 2, 3] and committed(out) == "ckpt-000003"


@pytest.mark.slow  # end to end: real train.py / torchrun processes
def test_resume_with_a_run_defining_flag_changed_stops_at_once(tmp_path, scratch):
    out = tmp_path / "run"
    proc = start(out, *scratch, "--iterations", "1")
    assert proc.communicate(timeout=300)[0] and proc.returncode == 0
    proc = start(out, *scratch, "--iterations", "2")  # no --resume: refused, nothing touched
    log = proc.communicate(timeout=60)[0]
    assert proc.returncode != 0 and "already holds a run" in log and iterations(out) == [0, 1]
    proc = start(out, *scratch, "--iterations", "2", "--resume", "--k", "3", "--estimator", "grpo")
    log = proc.communicate(timeout=60)[0]
    assert proc.returncode != 0 and log.strip().splitlines()[-1].startswith("error: --resume: flags that define")
    assert "--k 2 -> 3" in log and "--estimator vine -> grpo" in log


NOT_COMPARED = ("seconds", "mem_gb", "tokens_per_s", "train_seconds", "comm_bytes")  # timings and memory


def killed_and_resumed(tmp_path, flags: list[str], *, pause: str, cut_iterations) -> list[dict]:
    """Two iterations of train.py with `flags` twice: straight, and killed with SIGKILL at `pause` (committed:
    ckpt-000001, iterations logged: one of cut_iterations) then --resume'd. Asserts each iteration is logged once and
    that every metrics line but timings and memory (NOT_COMPARED) is the straight run's; returns the straight run's."""
    straight, cut = tmp_path / "straight", tmp_path / "cut"
    proc = start(straight, *flags)
    log = proc.communicate(timeout=600)[0]
    assert proc.returncode == 0, log
    proc = start(cut, *flags, pause=pause)
    wait_for(proc, f"paused at {pause}")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert committed(cut) == "ckpt-000001" and iterations(cut) in cut_iterations
    proc = start(cut, *flags, "--resume")
    log = proc.communicate(timeout=600)[0]
    assert proc.returncode == 0 and "resumed from" in log, log
    assert iterations(cut) == [0, 1, 2]
    a, b = ([json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()] for out in (straight, cut))
    for x, y in zip(a, b):
        assert {k: v for k, v in x.items() if not k.startswith(NOT_COMPARED)} == \
               {k: v for k, v in y.items() if not k.startswith(NOT_COMPARED)}, x["iteration"]
    return a


@pytest.mark.slow  # end to end: real train.py processes, the policy, reference and critic each a scratch model
def test_kill_inside_the_separate_critics_update_then_resume_exactly(tmp_path, scratch):
    """--estimator critic (the separate critic): SIGKILL after the critic's first step of iteration 2 (its policy
    updated, the critic half-way), then --resume: each iteration's metrics once, and every one of them as an
    uninterrupted run's; the checkpoint holds the critic as a Hugging Face folder that loads without code."""
    from safetensors.torch import load_file
    from transformers import AutoModel
    critic = [*scratch, "--estimator", "critic", "--iterations", "2"]
    records = killed_and_resumed(tmp_path, critic, pause="critic:3",  # 2 critic steps an iteration
                                 cut_iterations=([0, 1],))
    assert all("value_loss" in x for x in records[1:])
    straight, cut = tmp_path / "straight", tmp_path / "cut"
    folder = cut / "ckpt-000002" / "critic"
    assert AutoModel.from_pretrained(folder).config.hidden_size == 64  # the scratch model's width
    assert not (cut / "ckpt-000002" / "value_head.pt").exists()
    assert set(load_file(folder / "value_head.safetensors")) == {"weight", "bias"}
    for name in ("value_head.safetensors", "model.safetensors"):  # the resumed run ends with the same critic
        mine, theirs = load_file(folder / name), load_file(straight / "ckpt-000002" / "critic" / name)
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine), name


SILENT_ARMS = {"grpo-resample": ["--estimator", "grpo", "--resample-silent", "2"],  # fresh responses, trained on
               "vine-silent": ["--estimator", "vine", "--vines-where", "silent"]}  # vines in silent groups only


@pytest.mark.slow  # end to end: real train.py processes
@pytest.mark.parametrize("arm", SILENT_ARMS)
def test_kill_after_a_silent_groups_update_then_resume_exactly(tmp_path, scratch, arm):
    """research/vines_where/README.md's two arms: SIGKILL after iteration 2's update (grpo-resample: its silent groups' fresh
    responses sampled and trained on in a grown minibatch; vine-silent: vines only in the silent groups), then
    --resume: each iteration's metrics once, each as an uninterrupted run's, silent groups among them."""
    # 16 groups: at ~8 in 10 right, some group has contrast in every iteration, so every update moves the policy
    tiny = [*scratch, *SILENT_ARMS[arm], "--iterations", "2", "--prompts-per-iter", "16"]
    records = killed_and_resumed(tmp_path, tiny, pause="ppo:2", cut_iterations=([0, 1], [0, 1, 2]))
    spent = "resampled_groups" if arm == "grpo-resample" else "vines"
    assert any(r.get(spent, 0) > 0 for r in records), f"no silent group: no {spent} were sampled"
    assert all(r["grad_norm"] > 0 for r in records[1:]), "an update that moves nothing would resume exactly by default"
