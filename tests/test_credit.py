"""The credit grid (research/credit/credit.py): its settings and plan, the paired slopes, and the sign-accuracy diagnostic."""
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from advantages import gae, step_rewards
from research.credit import credit

REPO = Path(__file__).resolve().parent.parent


def test_task_flags_scale_the_response_limit_past_the_longest_gold_solution():
    from data import load_split
    for ops, filler in credit.SETTINGS.values():
        flags = credit.task_flags(ops, filler)
        limit = int(flags[flags.index("--max-new-tokens") + 1])
        longest = max(len(e["solution"]) for e in load_split("chain", "train", arith_ops=ops, chain_filler=filler))
        assert longest + 1 <= limit <= 2 * longest  # room for the EOS, not a multiple of the response
    assert credit.task_flags(4, 0)[-1] == "64"  # the testbed's


def test_sft_settings_stop_at_the_target_after_the_testbeds_warmup():
    flags = credit.sft_settings(8, 0)
    last = {flag: flags[len(flags) - 1 - flags[::-1].index(flag) + 1] for flag in ("--arith-ops", "--stop-at",
                                                                                 "--max-steps", "--warmup-ratio")}
    assert last["--arith-ops"] == "8" and float(last["--stop-at"]) == credit.STOP_AT  # argparse: the last one counts
    assert math.ceil(float(last["--warmup-ratio"]) * int(last["--max-steps"])) == credit.WARMUP_STEPS


def test_the_plan_runs_whole_pairs_seed_by_seed_and_the_long_arms_only_at_l8():
    cells = credit.plan(["chain-L2", "chain-L8"], [0, 1], list(credit.ARMS))
    assert cells[:4] == [("chain-L2", "vine", 0), ("chain-L2", "grpo", 0), ("chain-L8", "vine", 0),
                         ("chain-L8", "grpo", 0)]
    assert {s for s, a, _ in cells if a in credit.LONG_ONLY} == {"chain-L8"} and len(cells) == 8 + 3 * 2
    assert credit.arms_of("chain-L2") == ["vine", "grpo"]


def test_step_advantages_are_gae_with_gamma_1_and_lambda_0():
    values, reward = [0.5, 0.75, 0.25, 0.0], 1.0
    expected = gae(step_rewards(3, reward), torch.tensor(values), gamma=1.0, lam=0.0).tolist()
    assert credit.step_advantages(values, reward) == pytest.approx(expected)
    assert credit.step_advantages(values, reward) == pytest.approx([0.25, -0.5, 0.75])


def test_sign_accuracy_counts_only_steps_with_credit_due_and_never_a_zero():
    true = [0.5, -0.3, 0.01, -0.2]
    assert credit.sign_accuracy(true, [0.1, 0.2, -5.0, 0.0], at_least=0.1) == (1, 3)  # 0.01: not counted; 0: wrong
    assert credit.sign_accuracy(true, [1.0, -1.0, 1.0, -1.0], at_least=0.1) == (3, 3)


def test_decisive_state_is_before_the_step_that_loses_the_response():
    assert credit.decisive_state([0.6, 0.7, 0.01, 0.0], 0.0, lost=0.02) == 1  # the third state is lost: step 1
    assert credit.decisive_state([0.6, 0.7, 0.5], 0.0, lost=0.02) == 2  # lost at the answer line: the last state
    assert credit.decisive_state([0.6, 0.7, 0.5], 1.0, lost=0.02) is None  # right
    assert credit.decisive_state([0.0, 0.0], 0.0, lost=0.02) is None  # hopeless from the prompt


def test_slope_over_seeds_uses_the_seeds_with_every_point():
    assert credit.slope([2, 4, 6, 8], [0.0, 0.1, 0.2, 0.3]) == pytest.approx(0.05)
    diffs = {2: {0: 0.0, 1: 0.0, 2: 9.0}, 4: {0: 0.2, 1: 0.4}, 8: {0: 0.6, 1: 1.2}}  # seed 2 lacks two points
    mean, se, n = credit.slope_over_seeds(diffs)
    assert n == 2 and mean == pytest.approx((0.1 + 0.2) / 2) and se == pytest.approx(0.05)
    assert math.isnan(credit.slope_over_seeds({2: {0: 1.0}})[0])


def finished(run_dir: Path, *, start: str, accuracy: float, tokens: int, seconds: float):
    """A finished run: pass@1 `accuracy` at every evaluation after the first (0.5), `tokens` sampled and `seconds`
    taken an iteration."""
    from research.grid import EVAL_EVERY, ITERATIONS
    run_dir.mkdir(parents=True)
    records = [{"iteration": i, "reward_mean": 0.5, "kl_ref": 0.0, "seconds": seconds, "train_seconds": seconds * i,
                "sampled_tokens": tokens, "response_length": 10,
                **({"eval_accuracy": 0.5 if i == 0 else accuracy, "eval_se": 0.02} if i % EVAL_EVERY == 0 else {})}
               for i in range(ITERATIONS + 1)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (run_dir / "start.json").write_text(json.dumps({"model_sha256": start}) + "\n")


def test_the_summary_pairs_vine_with_grpo_by_seed_and_fits_the_slope(tmp_path):
    """Two lengths, two seeds: vine leads grpo by 0.1 at L = 2 and 0.3 at L = 4 per iteration (slope 0.1 a line),
    at twice grpo's tokens; the summary reports those, per setting and as slopes, and leaves grpo's unpaired seed out."""
    for setting, lead in (("chain-L2", 0.1), ("chain-L4", 0.3)):
        sft = tmp_path / setting / "sft"
        sft.mkdir(parents=True)
        (sft / "model.sha256").write_text("a" * 64 + "\n")
        (sft / "metrics.jsonl").write_text(json.dumps({"iteration": 100, "validation_accuracy": 0.52,
                                                       "eval_accuracy": 0.49, "eval_se": 0.02}) + "\n")
        for seed in (0, 1):
            finished(tmp_path / setting / f"vine-s{seed}", start="a" * 64, accuracy=0.5 + lead + seed / 100,
                     tokens=2000, seconds=20.0)
            finished(tmp_path / setting / f"grpo-s{seed}", start="a" * 64, accuracy=0.5, tokens=1000, seconds=10.0)
        finished(tmp_path / setting / "grpo-s2", start="a" * 64, accuracy=0.9, tokens=1000, seconds=10.0)
    text = credit.credit_summary(tmp_path, settings=list(credit.SETTINGS), started=None, extra=[])
    # sft.py's own evaluation (0.49) and the RL runs' iteration 0 (0.5) side by side
    assert "| chain-L2 | 2 | 0 | 100 | 0.520 | 0.490 | 0.500 | 2 | +0.105 ± 0.005 |" in text
    assert "| chain-L4 | 4 | 0 | 100 | 0.520 | 0.490 | 0.500 | 2 | +0.305 ± 0.005 |" in text
    assert "| L | +0.1000 ± 0.0000 |" in text  # two seeds, the same slope
    assert "| F | +" not in text  # F has one point only: no slope
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["diffs"]["chain-L2"]["iteration"] == {"0": pytest.approx(0.1), "1": pytest.approx(0.11)}
    assert result["diffs"]["chain-L2"]["token"]["0"] < 0.1  # vine spends twice the tokens an iteration
    assert (tmp_path / "credit.png").exists() and (tmp_path / "chain-L4" / "results.md").exists()


def test_credit_flags_bad_values_are_one_line(tmp_path):
    for args, message in ((["--settings", "chain-L3"], "error: --settings: unknown ['chain-L3']"),
                          (["--arms", "ppo"], "error: --arms: unknown ['ppo']"),
                          (["--diagnose", "--truth", "0"], "error: --truth must be at least 1 (got 0)")):
        run = subprocess.run([sys.executable, "-m", "research.credit.credit", "--out", str(tmp_path), *args], cwd=REPO,
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 1 and run.stderr.strip().startswith(message) and len(run.stderr.strip().splitlines()) == 1
    assert credit.OUT.startswith("runs/")


def test_diagnose_on_a_tiny_model_reports_every_figure_in_range(tmp_path):
    """The diagnostic end to end on a random 2-layer character model: the numbers it reports are proportions."""
    from data import load_split, prompt_chars, task_chars
    from model import new_scratch_model
    chars = task_chars(load_split("chain", "train", arith_ops=2, chain_filler=2)) + prompt_chars("plain",
                                                                                                 grader="chain")
    model = new_scratch_model(tmp_path / "m", chars=chars, layers=2, width=32, heads=2, seed=0)
    d = credit.diagnose(model, ops=2, filler=2, prompts=2, truth=4, seed=0)
    assert d["responses"] == 16 and d["distinct_states"] >= 2 and d["vines"] == 9 * d["distinct_states"]
    for key in ("value_mae", "sign_accuracy_vine", "sign_accuracy_grpo", "sign_zero_vine", "sign_zero_grpo", "misplaced_vine", "misplaced_grpo",
                "decisive_at_prompt", "decisive_state_shared", "decisive_state_right_sibling", "reward_mean"):
        assert 0.0 <= d[key] <= 1.0, key


def test_the_summary_pairs_every_l8_arm_with_vine(tmp_path):
    """At chain-L8 the long-only arms are paired with vine by seed: critic trails vine by 0.2 per iteration in both
    seeds, rloo's only seed (2) has no vine partner and is left out."""
    sft = tmp_path / "chain-L8" / "sft"
    sft.mkdir(parents=True)
    (sft / "model.sha256").write_text("a" * 64 + "\n")
    (sft / "metrics.jsonl").write_text(json.dumps({"iteration": 100, "validation_accuracy": 0.52,
                                                   "eval_accuracy": 0.5, "eval_se": 0.02}) + "\n")
    for seed in (0, 1):
        for arm, accuracy in (("vine", 0.8), ("grpo", 0.7), ("critic", 0.6)):
            finished(tmp_path / "chain-L8" / f"{arm}-s{seed}", start="a" * 64, accuracy=accuracy + seed / 100,
                     tokens=1000, seconds=10.0)
    finished(tmp_path / "chain-L8" / "rloo-s2", start="a" * 64, accuracy=0.9, tokens=1000, seconds=10.0)
    text = credit.credit_summary(tmp_path, settings=["chain-L8"], started=None, extra=[])
    assert "| critic | 2 | -0.200 ± 0.000 |" in text and "| grpo | 2 | -0.100 ± 0.000 |" in text
    assert "| rloo |" not in text.split("Every arm at chain-L8")[1]
