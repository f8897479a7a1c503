"""Issue 61's grid (research.vines_where.vines_where): M from a vine-silent run's tokens, the arms' flags, each task folder bound to
the paper-regime grid's start, and the paired read-out of the four pairs."""
import json
import subprocess
import sys

import pytest

from config import parse_config
from conftest import REPO
from research.grid import SETTINGS
from research.paper_regime.recipe import resample_count, resample_flags
from research.vines_where import vines_where
from tests.test_paper_regime import DIGEST, fake_run


def test_resample_count_spends_the_vine_tokens_on_fresh_responses():
    """M = vine tokens / (silent groups x response length), summed over iterations: 2 iterations with 32 and 16
    silent groups of 40-token responses and 61,440 + 30,720 vine tokens -> 48 a silent group; iteration 0 ignored."""
    records = [{"iteration": 0, "eval_accuracy": 0.5},
               {"iteration": 1, "silent_frac": 0.5, "response_length": 40.0, "vine_tokens": 61440},
               {"iteration": 2, "silent_frac": 0.25, "response_length": 40.0, "vine_tokens": 30720}]
    assert resample_count(records) == 48
    records[2]["vine_tokens"] = 0  # 61,440 over 1,920 fresh-response tokens a response: 32
    assert resample_count(records) == 32
    with pytest.raises(SystemExit, match="no silent group"):
        resample_count([{"iteration": 1, "silent_frac": 0.0, "response_length": 40.0}])


def test_the_arms_parse_with_the_grids_settings(monkeypatch):
    """vine-silent is vine with --vines-where silent; grpo-resample is grpo with M fresh responses per silent group,
    refused (one line, nothing written) until M is measured for that task."""
    monkeypatch.delitem(vines_where.RESAMPLE, "hard", raising=False)  # as before its measurement
    with pytest.raises(SystemExit, match="grpo-resample on hard: M is not measured"):
        vines_where.grid_arms("hard", ["vine-silent", "grpo-resample"])
    monkeypatch.setitem(vines_where.RESAMPLE, "hard", 12)
    arms = vines_where.grid_arms("hard", ["vine-silent", "grpo-resample"])
    silent = parse_config([*SETTINGS, *arms["vine-silent"]])
    resample = parse_config([*SETTINGS, *arms["grpo-resample"]])
    assert (silent.estimator, silent.vines_where, silent.k) == ("vine", "silent", 9)
    assert (resample.estimator, resample.resample_silent, resample.samples_per_prompt) == ("grpo", 12, 8)


def test_task_folder_binds_to_the_regime_start_and_copies_its_base_runs(tmp_path):
    """out/<task>/sft gets the regime SFT's sha256 and plateau; the regime's finished vine and grpo runs of that start
    are copied once evaluated (one from another start, or one still in its final evaluation, is not); a regime
    without an SFT model is one line."""
    regime, out = tmp_path / "regime", tmp_path / "out"
    sft = regime / "easy" / "sft"
    sft.mkdir(parents=True)
    (sft / "model.sha256").write_text(DIGEST + "\n")
    (sft / "plateau.json").write_text(json.dumps({"test greedy": [0.5, 0.02]}))
    fake_run(regime / "easy" / "vine-s0", evals=[0.5] * 11, final=0.6)
    fake_run(regime / "easy" / "grpo-s0", evals=[0.5] * 11, final=0.6, start="cd" * 32)
    fake_run(regime / "easy" / "critic-s0", evals=[0.5] * 11, final=0.6)
    fake_run(regime / "easy" / "grpo-s1", evals=[0.5] * 11)  # done, its final evaluation not yet written
    assert vines_where.task_folder(out, regime, "easy", seeds=[0, 1]) == sft
    assert (out / "easy" / "sft" / "model.sha256").read_text().strip() == DIGEST
    assert sorted(p.name for p in (out / "easy").iterdir()) == ["sft", "vine-s0"]
    (regime / "easy" / "grpo-s1" / "final.json").write_text("{}")
    vines_where.task_folder(out, regime, "easy", seeds=[0, 1])
    assert (out / "easy" / "grpo-s1" / "final.json").exists()
    with pytest.raises(SystemExit, match="no SFT model"):
        vines_where.task_folder(out, regime, "hard", seeds=[0])


def test_report_pairs_vine_silent_with_its_comparators(tmp_path):
    """results.md has vine-silent − grpo-resample (and − grpo, − vine) paired by seed, and the silent groups of
    grpo-resample as sampled (before its fresh responses) with the share its fresh responses gave contrast."""
    from research.paper_regime.regime_report import report
    sft = tmp_path / "easy" / "sft"
    sft.mkdir(parents=True)
    (sft / "model.sha256").write_text(DIGEST + "\n")
    (sft / "plateau.json").write_text(json.dumps({"test T 0.35 x 16": [0.5, 0.02], "test greedy": [0.5, 0.02]}))
    for seed in range(2):
        for arm, level in (("vine-silent", 0.7), ("grpo-resample", 0.6), ("vine", 0.65), ("grpo", 0.6)):
            fake_run(tmp_path / "easy" / f"{arm}-s{seed}", evals=[0.5] + [level] * 10, final=level)
        path = tmp_path / "easy" / f"grpo-resample-s{seed}" / "metrics.jsonl"
        records = [json.loads(line) for line in path.read_text().splitlines()]
        for r in records[1:]:
            r.update(silent_before_frac=0.75, resample_found_frac=0.4)
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    arms = {"vine": ["--estimator", "vine"], "grpo": ["--estimator", "grpo"],
            "vine-silent": vines_where.ARMS["vine-silent"], "grpo-resample": resample_flags(12)}
    text = report(tmp_path, arms={"easy": arms}, settings=["--x"], pairs=vines_where.PAIRS)
    assert "| easy | vine-silent − grpo-resample | +0.100 ± 0.000 (2) * |" in text
    assert "| easy | vine-silent − vine | +0.050 ± 0.000 (2) * |" in text
    assert "| easy | grpo-resample | 0.75 | 0.75 | 0.40 | 0.40 |" in text  # a group given contrast: all credited
    assert "vine − critic" not in text


def test_the_command_refuses_bad_values_in_one_line():
    for flags, message in ((["--task", "medium"], "unknown ['medium']"), (["--seeds", "0,x"], "--seeds takes")):
        result = subprocess.run([sys.executable, "-m", "research.vines_where.vines_where", *flags], capture_output=True, text=True)
        assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("script", ["research.paper_regime.paper_regime", "research.vines_where.vines_where"])
def test_redraw_of_an_empty_folder_says_there_is_nothing_to_summarise(tmp_path, script):
    out = tmp_path / "empty"
    out.mkdir()
    run = subprocess.run([sys.executable, "-m", script, "--redraw", "--out", str(out)], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode != 0 and "Traceback" not in run.stderr, run.stderr[-2000:]
    assert run.stderr.strip() == (f"error: {out}: no task folder with an SFT plateau (<task>/sft/plateau.json): "
                                  f"nothing to summarise")
