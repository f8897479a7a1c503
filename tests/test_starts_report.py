"""The third start's read-out (research.paper_regime.starts_report) on fabricated runs: the K gaps, disagreement
between starts, the start/seed split of variance, and pass@1 at matched train reward and KL."""
import json

import pytest

from research.paper_regime import starts_report
from tests.test_paper_regime import DIGEST, fake_run


def test_disagreement_names_the_pair_of_starts_furthest_apart_in_ses():
    gaps = {"A": [0.01, 0.02, 0.03], "B": [0.01, 0.02, 0.03], "C": [0.11, 0.12, 0.13]}
    names, diff, se = starts_report.disagreement(gaps)
    assert names == "C − A" and diff == pytest.approx(0.1) and se == pytest.approx((2 * (0.01 / 3 ** 0.5) ** 2) ** 0.5)
    assert starts_report.disagreement({"A": [0.1, 0.2], "B": [0.3]}) is None  # one SE needs two seeds


def test_variance_shares_splits_between_starts_and_between_seeds():
    same = starts_report.variance_shares({"A": [0.5, 0.6, 0.7], "B": [0.5, 0.6, 0.7]})
    assert same[0] == 0.0 and same[1] == pytest.approx(0.01) and same[2] == 0.0
    apart = starts_report.variance_shares({"A": [0.50, 0.52, 0.54], "B": [0.80, 0.82, 0.84]})
    # within: 0.0004; between: var of the means (0.045) - 0.0004 / 3
    assert apart[1] == pytest.approx(0.0004) and apart[0] == pytest.approx(0.045 - 0.0004 / 3) and apart[2] > 0.99
    assert starts_report.variance_shares({"A": [0.5, 0.6], "B": [0.7]}) is None


def records(rewards, accuracies, kls):
    out = [{"iteration": 0, "eval_accuracy": 0.3}]
    for i, (r, a, k) in enumerate(zip(rewards, accuracies, kls), start=1):
        out.append({"iteration": i, "reward_mean": r, "kl_ref": k, "eval_accuracy": a})
    return out


def test_matched_gap_compares_test_accuracy_only_where_both_runs_reach_the_same_train_reward():
    vine = records([0.31, 0.42, 0.53], [0.40, 0.50, 0.60], [1e-3, 1e-2, 1e-1])
    grpo = records([0.41, 0.52, 0.63], [0.45, 0.52, 0.70], [1e-3, 1e-2, 1e-1])
    assert starts_report.binned(vine, axis="reward") == {6: 0.40, 8: 0.50, 10: 0.60}  # bins of 0.05, iteration 0 out
    assert starts_report.matched_gap(vine, grpo, axis="reward") == pytest.approx(((0.50 - 0.45) + (0.60 - 0.52)) / 2)
    assert starts_report.matched_gap(vine, grpo, axis="kl") == pytest.approx(((0.40 - 0.45) + (0.50 - 0.52)
                                                                              + (0.60 - 0.70)) / 3)
    assert starts_report.matched_gap(vine, records([0.9], [0.9], [1.0]), axis="reward") is None


def test_report_reads_k_gaps_on_c_and_a_gap_on_two_starts(tmp_path):
    levels = {"A": {"vine": (0.60, 0.01), "grpo": (0.50, 0.02)},
              "C": {"vine": (0.73, 0.01), "grpo": (0.60, 0.02), "vine-k1": (0.65, 0.01), "critic": (0.62, 0.01)}}
    starts = {}
    for label, arms in levels.items():
        folder = tmp_path / label
        (folder / "sft").mkdir(parents=True)
        (folder / "sft" / "model.sha256").write_text(DIGEST + "\n")
        for seed in range(3):
            for arm, (level, step) in arms.items():
                fake_run(folder / f"{arm}-s{seed}", evals=[0.3] + [level + step * seed] * 10, final=level)
        starts[label] = folder
    (starts["C"] / "diagnostics-critic").mkdir()
    (starts["C"] / "diagnostics-critic" / "value_error.json").write_text(json.dumps({"summary": {
        "vine K=9": {"mae": 0.02, "ranking_accuracy": 1.0, "expected_mae": 0.018}, "critic": {"mae": 0.46,
                                                                                                "ranking_accuracy": 0.36}}}))
    text = starts_report.report(tmp_path, starts={"hard": starts})
    assert "| vine K=9 | 0.020 | 0.018 | 1.00 |" in text and "| critic | 0.460 | – | 0.36 |" in text
    assert "| vine-k1 − critic | +0.030 ± 0.000 (3) * |" in text and "| vine-k1 − grpo | +0.040 ± 0.006 (3) * |" in text
    assert ("| hard | vine − grpo | per iteration | +0.090 ± 0.006 (3) * | – | +0.120 ± 0.006 (3) * | "
            "C − A: +0.030 ± 0.008 * |") in text
    saved = json.loads((tmp_path / "starts.json").read_text())
    assert saved["variance"]["hard: vine"]["finals"] == {"A": [0.6] * 3, "C": [0.73] * 3}
    assert (tmp_path / "generalisation.png").stat().st_size > 0 and (tmp_path / "kl.png").stat().st_size > 0
