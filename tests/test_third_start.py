"""The third start (research.paper_regime.third_start): a committed start used when its digest matches, the two matched arms
measured from seed 0's runs, and their flags."""
import hashlib
import json

import pytest

from config import parse_config
from research.grid import SETTINGS
from research.paper_regime import recipe, third_start
from tests.test_paper_regime import fake_run


def test_start_stage_copies_the_committed_start_when_its_digest_matches(tmp_path, monkeypatch):
    shipped = tmp_path / "shipped" / "hard-c" / "sft"
    shipped.mkdir(parents=True)
    (shipped / "model.safetensors").write_bytes(b"weights")
    (shipped / "config.json").write_text("{}")
    (shipped / "model.sha256").write_text(hashlib.sha256(b"weights").hexdigest() + "\n")
    monkeypatch.setattr(recipe, "SHIPPED", tmp_path / "shipped")
    monkeypatch.setattr(recipe, "sft_stage", lambda out, settings: (out / "sft", "built"))  # never built here
    sft_dir, _ = recipe.start_stage(tmp_path / "out", "hard-c")
    assert sft_dir == tmp_path / "out" / "hard-c" / "sft"
    assert (sft_dir / "model.safetensors").read_bytes() == b"weights" and (sft_dir / "config.json").exists()
    (shipped / "model.safetensors").write_bytes(b"other weights")  # changed since its digest was committed
    with pytest.raises(SystemExit, match="its weights' sha256 .* is not its model.sha256"):
        recipe.start_stage(tmp_path / "again", "hard-c")
    assert recipe.STARTS["hard-c"][-2:] == ["--seed", "1"]  # C: the hard recipe with SFT seed 1


def test_measure_sets_grpo_matched_and_grpo_resample_from_seed_0(tmp_path):
    task = tmp_path / "hard-c"
    with pytest.raises(SystemExit, match="vine, grpo, vine-silent not finished"):
        third_start.measure(task)
    fake_run(task / "vine-s0", evals=[0.3] * 11, tokens=90000, final=0.5)
    fake_run(task / "grpo-s0", evals=[0.3] * 11, tokens=20000, final=0.5)
    fake_run(task / "vine-silent-s0", evals=[0.3] * 11, tokens=60000, final=0.5)
    for i, line in enumerate(lines := (task / "vine-silent-s0" / "metrics.jsonl").read_text().splitlines()):
        record = json.loads(line)
        if record["iteration"]:
            record.update(vine_tokens=40000, response_length=40.0)  # silent_frac 0.5 (fake_run): 32 groups
        lines[i] = json.dumps(record)
    (task / "vine-silent-s0" / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    assert third_start.grid_arms(task).keys() == {"vine", "vine-k3", "vine-k1", "critic", "grpo", "vine-silent"}
    measured = third_start.measure(task)
    assert measured["samples_per_prompt"] == 36 and measured["resample_silent"] == 31  # 8 x 4.5; 40000 / (32 x 40)
    arms = third_start.grid_arms(task)
    assert list(arms) == list(third_start.ARMS)
    matched, resample = (parse_config([*SETTINGS, *arms[a]]) for a in ("grpo-matched", "grpo-resample"))
    assert (matched.samples_per_prompt, matched.minibatch_size) == (36, 288) and resample.resample_silent == 31
    assert parse_config([*SETTINGS, *arms["vine-k1"]]).k == 1
