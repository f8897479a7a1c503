"""The run's files without a model: out-dir preparation, the `latest` pointer, resume state without code execution,
metrics repair, a full disk during a save, config changes on resume, and the learning rate a resume applies."""
import errno
import json
import os
import pickle
from pathlib import Path

import pytest
import torch

import checkpoint
from checkpoint import (committed_checkpoint, load_trainer_state, prepare_out_dir, repair_metrics, restore,
                        save_checkpoint)
from config import config_changes, parse_config


class FakeModel:
    """What save_checkpoint needs of a policy and a tokenizer: save_pretrained(folder), parameters()."""

    def __init__(self, name):
        self.name = name

    def parameters(self):
        return iter(())

    def save_pretrained(self, folder, state_dict=None):
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / f"{self.name}.txt").write_text(self.name)


def save(out, iteration, **kwargs):
    linear = torch.nn.Linear(2, 1)
    optimizer = torch.optim.AdamW(linear.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    save_checkpoint(out, iteration=iteration, scorer=linear, policy=FakeModel("policy"), value_head=None,
                    tokenizer=FakeModel("tok"), optimizer=optimizer, scheduler=scheduler, python_rng=(3, tuple(range(625)), None),
                    torch_rng=torch.get_rng_state(), cfg=parse_config(["--out-dir", str(out)]), train_seconds=1.5,
                    **kwargs)


def test_save_commits_a_new_checkpoint_then_drops_the_old(tmp_path):
    save(tmp_path, 1)
    save(tmp_path, 2)
    assert committed_checkpoint(tmp_path) == tmp_path / "ckpt-000002"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-000002", "latest"]
    state = load_trainer_state(tmp_path / "ckpt-000002")  # weights_only: everything we save loads that way
    assert state["iteration"] == 2 and state["python_rng"][1][:3] == (0, 1, 2)


@pytest.mark.parametrize("failure", [OSError(errno.ENOSPC, "No space left on device"),
                                     RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")])
def test_a_full_disk_leaves_the_last_checkpoint_usable(tmp_path, monkeypatch, failure):
    save(tmp_path, 1)

    def full_disk(*args, **kwargs):
        raise failure

    monkeypatch.setattr(checkpoint.torch, "save", full_disk)
    with pytest.raises(SystemExit) as e:
        save(tmp_path, 2)
    assert str(e.value).startswith("error: no space left on device while writing") and "\n" not in str(e.value)
    assert committed_checkpoint(tmp_path) == tmp_path / "ckpt-000001"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-000001", "latest"]  # no temp folder left


class RunsCode:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_resume_refuses_a_crafted_pickle_without_running_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ckpt = tmp_path / "ckpt-000001"
    ckpt.mkdir()
    (ckpt / "trainer_state.pt").write_bytes(pickle.dumps({"iteration": 1, "x": RunsCode()}))
    (tmp_path / "latest").write_text("ckpt-000001")
    source = prepare_out_dir(tmp_path, resume=True, overwrite=False)
    with pytest.raises(SystemExit) as e:
        load_trainer_state(source)
    assert "refusing to load it" in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "pwned").exists()


def test_a_crafted_value_head_is_refused_without_running_it(tmp_path, monkeypatch):
    from ablations.critic_head import load_value_head
    monkeypatch.chdir(tmp_path)
    (tmp_path / "value_head.pt").write_bytes(pickle.dumps({"weight": RunsCode()}))
    with pytest.raises(SystemExit) as e:
        load_value_head(tmp_path, torch.nn.Linear(4, 1))
    assert "value_head.pt: not a value head this program wrote; refusing" in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "pwned").exists()
    head = torch.nn.Linear(4, 1)
    torch.save(head.state_dict(), tmp_path / "value_head.pt")
    other = torch.nn.Linear(4, 1)
    load_value_head(tmp_path, other)  # a real one loads
    assert torch.equal(other.weight, head.weight)


@pytest.mark.parametrize("pointer", ["../elsewhere/ckpt-000001", "/tmp/ckpt-000001", "ckpt-1", "ckpt-000002"])
def test_latest_must_name_a_checkpoint_folder_inside_the_out_dir(tmp_path, pointer):
    save(tmp_path, 1)
    (tmp_path / "latest").write_text(pointer)
    with pytest.raises(SystemExit, match="must name a complete ckpt-NNNNNN folder"):
        prepare_out_dir(tmp_path, resume=True, overwrite=False)


def test_out_dir_holding_a_run_needs_resume_or_overwrite(tmp_path):
    save(tmp_path, 1)
    (tmp_path / "metrics.jsonl").write_text('{"iteration": 0}\n')
    (tmp_path / ".tmp-ckpt-000002-123").mkdir()  # a dead save's leftover
    with pytest.raises(SystemExit, match="already holds a run; continue it with --resume"):
        prepare_out_dir(tmp_path, resume=False, overwrite=False)
    assert not (tmp_path / ".tmp-ckpt-000002-123").exists()
    assert prepare_out_dir(tmp_path, resume=True, overwrite=False) == tmp_path / "ckpt-000001"
    assert prepare_out_dir(tmp_path, resume=False, overwrite=True) is None
    assert list(tmp_path.iterdir()) == []


def test_a_checkpoint_renamed_but_never_committed_is_dropped(tmp_path):
    save(tmp_path, 1)
    save(tmp_path, 2)
    (tmp_path / "latest").write_text("ckpt-000001")  # as if killed between the rename and the pointer update
    (tmp_path / "ckpt-000001").mkdir()
    (tmp_path / "ckpt-000001" / "trainer_state.pt").write_bytes((tmp_path / "ckpt-000002" / "trainer_state.pt")
                                                                .read_bytes())
    assert prepare_out_dir(tmp_path, resume=True, overwrite=False) == tmp_path / "ckpt-000001"
    assert not (tmp_path / "ckpt-000002").exists()


def test_repair_metrics_keeps_each_iteration_once_up_to_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [{"iteration": 0}, {"iteration": 1, "a": 1}, {"iteration": 1, "a": 2}, {"iteration": 2}, {"iteration": 3}]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"iteration": 4, "tor')
    repair_metrics(path, upto=2)
    assert [json.loads(line) for line in path.read_text().splitlines()] == [
        {"iteration": 0}, {"iteration": 1, "a": 2}, {"iteration": 2}]


def test_config_changes_split_run_defining_flags_from_the_rest(tmp_path):
    saved = vars(parse_config(["--out-dir", str(tmp_path), "--k", "9", "--lr", "1e-6"])).copy()
    defining, other = config_changes(saved, parse_config(["--out-dir", str(tmp_path), "--k", "3", "--lr", "2e-5",
                                                          "--iterations", "7", "--resume"]))
    assert defining == ["--k 9 -> 3"]
    assert other == ["--iterations 650 -> 7", "--lr 1e-06 -> 2e-05", "--value-lr 1e-06 -> 2e-05"]


def test_restore_applies_a_changed_learning_rate_on_the_saved_schedule():
    def setup(lr):
        linear = torch.nn.Linear(2, 1)
        optimizer = torch.optim.AdamW(linear.parameters(), lr=lr)
        return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 ** step)
    optimizer, scheduler = setup(1e-3)
    for _ in range(2):
        optimizer.step()
        scheduler.step()
    state = {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "iteration": 4,
             "train_seconds": 9.0, "python_rng": (3, tuple(range(625)), None), "torch_rng": torch.get_rng_state()}
    optimizer, scheduler = setup(1e-3)
    import random
    assert restore(state, scorer=torch.nn.Linear(2, 1), optimizer=optimizer, scheduler=scheduler, rng=random.Random(),
                   lrs=[4e-3]) == (4, 9.0)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(4e-3 * 0.25)  # the new base lr at step 2
    scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(4e-3 * 0.125)


@pytest.mark.parametrize("argv, message", [
    (["--temperature", "0"], "--temperature must be above 0"), (["--temperature", "-1"], "--temperature must be"),
    (["--top-p", "0"], "--top-p must be in (0, 1]"), (["--top-p", "1.5"], "--top-p must be in (0, 1]"),
    (["--eval-temperature", "-0.1"], "--eval-temperature must be"), (["--resume", "--overwrite"], "contradict")])
def test_sampling_flags_are_checked_at_parse_time(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_config(argv)
    assert message in capsys.readouterr().err


def test_out_dir_that_is_a_file_or_unwritable_is_refused(tmp_path, capsys, monkeypatch):
    (tmp_path / "file").write_text("x")
    with pytest.raises(SystemExit):
        parse_config(["--out-dir", str(tmp_path / "file" / "run")])
    assert "is not a folder" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_config(["--out-dir", str(tmp_path / "file")])
    assert "exists and is not a folder" in capsys.readouterr().err
    import config
    monkeypatch.setattr(config.os, "access", lambda path, mode: False)  # as for a user without write permission
    with pytest.raises(SystemExit):
        parse_config(["--out-dir", str(tmp_path / "run")])
    assert f"{tmp_path} is not writable" in capsys.readouterr().err
