"""runlog.py: the plumbing train.py and sft.py share (when a save is due, the metrics file, the progress line, Ctrl-C)."""
import json
import signal
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from runlog import RunLog, due, stop_after_interrupt


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
