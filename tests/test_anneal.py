"""research.anneal.anneal (the anneal study's starts and grid) and research.anneal.anneal_probes: the tails' schedules, the checkpoint copy a
tail resumes from, the probes' pure parts and a probe end to end on a tiny model, the summary's pairing."""
import json
import math

import pytest
import torch

from ppo import lr_factor
from research.anneal import anneal, anneal_probes
from sft import parse_sft_config


def test_group_stats_count_the_groups_grpo_learns_from():
    stats = anneal_probes.group_stats([1, 1, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0], group=4)
    assert stats["reward"] == pytest.approx(0.5)
    assert stats["mixed_groups"] == pytest.approx(1 / 3)  # only the first group has both outcomes
    assert stats["p_one_minus_p"] == pytest.approx(0.25 / 3)


def test_top_eigenvalue_of_a_quadratic():
    class Quadratic(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.x = torch.nn.Parameter(torch.tensor([0.3, -0.2, 0.1, 0.5]))
    model, curvature = Quadratic(), torch.tensor([1.0, 5.0, 2.0, -3.0])
    value = anneal_probes.top_eigenvalue(model, lambda: 0.5 * (curvature * model.x ** 2).sum(), iters=40)
    assert value == pytest.approx(5.0, rel=1e-3)
    assert torch.allclose(model.x, torch.tensor([0.3, -0.2, 0.1, 0.5]))  # the weights are put back
    # along x2 (curvature 5, slope 5 x -0.2 = -1) the bottom is 0.2 away; a direction of length 2: eta 0.1
    line = anneal_probes.along(model, lambda: 0.5 * (curvature * model.x ** 2).sum(), torch.tensor([0.0, 2.0, 0, 0]))
    assert line["slope"] == pytest.approx(-1.0, rel=1e-4) and line["curvature"] == pytest.approx(5.0, rel=1e-4)
    assert line["best_eta"] == pytest.approx(0.1, rel=1e-4)


def test_each_tail_has_its_schedule_after_the_shared_trunk():
    def lrs(start: str, steps: list[int]) -> list[float]:
        _, _, flags = anneal.schedule(start, match=0.42)
        cfg = parse_sft_config(["--device", "cpu", "--dataset", "chain", "--model", "scratch", "--prompt-format",
                                "plain", *flags])
        warmup = math.ceil(cfg.warmup_ratio * cfg.max_steps)
        assert warmup == anneal.WARMUP
        return [round(lr_factor(s, warmup=warmup, total=cfg.max_steps, decay=cfg.lr_decay,
                                decay_steps=cfg.decay_steps, floor=cfg.lr_floor), 4) for s in steps]
    assert lrs("trunk", [99, 150, 199]) == [1.0, 1.0, 1.0]
    assert lrs("decay", [199, 200, 250, 299]) == [1.0, 1.0, 0.5, 0.01]
    assert lrs("floor", [200, 299]) == [1.0, 0.109]
    assert lrs("rewarm", [300, 324]) == [1.0, 1.0]
    assert lrs("constant", [200, 599]) == [1.0, 1.0]
    assert anneal.schedule("decay")[:2] == ("trunk", 200) and anneal.schedule("rewarm")[:2] == ("decay", 300)
    _, _, flags = anneal.schedule("constant", match=0.42)
    assert flags[flags.index("--stop-at") + 1] == "0.42"


def test_a_tail_starts_from_a_copy_of_its_parents_checkpoint(tmp_path):
    source, target = tmp_path / "trunk" / "sft", tmp_path / "decay" / "sft"
    (source / "ckpt-000200").mkdir(parents=True)
    (source / "ckpt-000200" / "trainer_state.pt").write_text("state")
    (source / "metrics.jsonl").write_text('{"iteration": 200}\n')
    (target / "ckpt-000200").mkdir(parents=True)  # a copy killed before its end: no `latest` yet
    (target / "ckpt-000200" / "trainer_state.pt").write_text("st")
    anneal.copy_checkpoint(source, target, step=200)
    assert (target / "latest").read_text() == "ckpt-000200"
    assert (target / "ckpt-000200" / "trainer_state.pt").read_text() == "state"
    (target / "ckpt-000200" / "trainer_state.pt").write_text("resumed since")
    anneal.copy_checkpoint(source, target, step=200)  # a tail already under way is left alone
    assert (target / "ckpt-000200" / "trainer_state.pt").read_text() == "resumed since"
    with pytest.raises(SystemExit, match="no checkpoint ckpt-000300"):
        anneal.copy_checkpoint(source, tmp_path / "rewarm" / "sft", step=300)


def test_a_resumed_tail_takes_its_new_schedule_from_the_saved_step(tmp_path):
    """A tiny scratch SFT run: 6 steps at constant lr, then a copy resumed with a 4-step decay to 0."""
    import sft
    base = ["--device", "cpu", "--dataset", "chain", "--arith-ops", "2", "--prompt-format", "plain", "--model",
            "scratch", "--scratch-layers", "1", "--scratch-width", "16", "--scratch-heads", "2", "--batch-size", "4",
            "--micro-batch-size", "4", "--lr", "1e-3", "--eval-size", "2", "--eval-samples", "1", "--eval-temperature",
            "0", "--max-new-tokens", "12", "--threads", "1"]
    sft.main(parse_sft_config([*base, "--max-steps", "6", "--warmup-ratio", "0.33", "--no-lr-decay", "--out-dir",
                               str(tmp_path / "trunk")]))
    anneal.copy_checkpoint(tmp_path / "trunk", tmp_path / "decay", step=6)
    sft.main(parse_sft_config([*base, "--max-steps", "10", "--warmup-ratio", "0.2", "--lr-decay", "--decay-steps",
                               "4", "--resume", "--out-dir", str(tmp_path / "decay")]))
    records = [json.loads(line) for line in (tmp_path / "decay" / "metrics.jsonl").read_text().splitlines()]
    lrs = [round(r["lr"], 6) for r in records if "lr" in r]
    assert lrs == [0.0005, 0.001, 0.001, 0.001, 0.001, 0.001, 0.001, 0.00075, 0.0005, 0.00025]
    assert (tmp_path / "decay" / "config.json").exists()


def test_the_plan_runs_grpo_seed_by_seed_then_vine_and_the_low_lrs_from_decay_and_constant_only():
    cells = anneal.plan([0, 1], ["grpo", "grpo-lr5e-6", "vine"])
    assert cells[:4] == [(s, "grpo", 0) for s in anneal.STARTS]
    assert cells[4:6] == [("decay", "grpo-lr5e-6", 0), ("constant", "grpo-lr5e-6", 0)]
    assert cells[6] == ("decay", "grpo", 1) and cells[12:16] == [(s, "vine", 0) for s in anneal.STARTS]
    assert len(cells) == 20


def test_probe_on_a_tiny_model_reports_every_figure(tmp_path, monkeypatch):
    from data import load_split, prompt_chars, task_chars
    from model import new_scratch_model
    monkeypatch.setattr(anneal_probes, "PROMPTS", 4)
    monkeypatch.setattr(anneal_probes, "VALIDATION", 6)
    monkeypatch.setattr(anneal_probes, "GOLD", 8)
    chars = task_chars(load_split("chain", "train", arith_ops=4)) + prompt_chars("plain", grader="chain")
    model = new_scratch_model(tmp_path / "m", chars=chars, layers=1, width=16, heads=2, seed=0)
    out = anneal_probes.probe(str(model), seed=0)
    for key in ("val_pass", "reward", "mixed_groups", "p_one_minus_p"):
        assert 0.0 <= out[key] <= 1.0, key
    assert out["gold_loss"] > 1.0  # a random model over ~20 characters: ~log 20 a token
    assert out["sharpness"] > 0 and out["pg_norm"] >= 0 and out["entropy"] > 0
    assert {"pg_slope", "pg_curvature", "pg_best_eta", "pgsgd_slope", "pgsgd_curvature", "pgsgd_best_eta"} <= set(out)
    steps = [("random", eta) for eta in anneal_probes.RANDOM_ETAS] + [
        (kind, eta) for kind in ("pg", "pgsgd") for eta in anneal_probes.PG_ETAS]
    for kind, eta in steps:
        assert math.isfinite(out[f"{kind}_{eta:g}_loss"]) and -1 <= out[f"{kind}_{eta:g}_pass"] <= 1


def test_the_summary_pairs_each_start_with_decay_by_seed(tmp_path):
    """Synthetic starts and grpo runs: the gains and their pairing with decay's are read from the metrics."""
    gain = {("decay", 0): 0.00, ("decay", 1): 0.02, ("constant", 0): 0.10, ("constant", 1): 0.14}
    for start in ("trunk", "decay", "constant"):
        for seed in (0, 1):
            folder = tmp_path / f"{start}-s{seed}"
            (folder / "sft").mkdir(parents=True)
            (folder / "sft" / "model.sha256").write_text(f"{start}{seed}\n")
            (folder / "sft" / "metrics.jsonl").write_text(json.dumps({"iteration": 300, "eval_accuracy": 0.5}) + "\n")
            (folder / "probe.json").write_text(json.dumps({k: 0.1 * seed for k in anneal.SHOWN}))
            if start == "trunk":
                continue
            run = folder / f"grpo-s{seed}"
            run.mkdir()
            (run / "start.json").write_text(json.dumps({"model_sha256": f"{start}{seed}"}))
            records = [{"iteration": i, "eval_accuracy": 0.5 + (gain[start, seed] if i else 0.0)}
                       for i in range(0, 31, 3)]
            (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    text = anneal.summary(tmp_path, [0, 1])
    row = next(line for line in text.splitlines() if line.startswith("| grpo | constant |"))
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert cells[2] == "2" and cells[4].startswith("0.12 ±") and cells[6].startswith("+0.11 ±")
    assert json.loads((tmp_path / "results.json").read_text())["rl"]["grpo"]["constant"]["1"]["mean_gain"] == \
        pytest.approx(0.14)
    assert (tmp_path / "anneal.png").exists()
