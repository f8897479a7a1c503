"""Pure pieces of the diagnostic, the credit picture and the plots."""
import json
import math

import pytest

from diagnose import expected_mc_error, ranking_accuracy
from plot import plot_runs, read_metrics
from visualize import colour, render_html


def test_expected_mc_error():
    assert expected_mc_error(0.0, 9) == 0.0 and expected_mc_error(1.0, 9) == 0.0
    assert expected_mc_error(0.5, 1) == pytest.approx(0.5)
    # K = 3, v = 0.5: |x/3 - 0.5| is 0.5 (x = 0, 3) or 1/6 (x = 1, 2) -> 2 * 1/8 * 0.5 + 6/8 * 1/6 = 0.25
    assert expected_mc_error(0.5, 3) == pytest.approx(0.25)
    assert expected_mc_error(0.3, 9) < expected_mc_error(0.3, 3) < expected_mc_error(0.3, 1)
    assert expected_mc_error(0.3, 256) == pytest.approx(math.sqrt(0.3 * 0.7 / 256) * math.sqrt(2 / math.pi), rel=0.1)


def test_ranking_accuracy():
    truth = [0.9, 0.1, 0.2, 0.6, 0.5, 0.52]  # the last pair differs by less than the margin: skipped
    assert ranking_accuracy([0.8, 0.3, 0.1, 0.7, 0.0, 1.0], truth) == 1.0
    assert ranking_accuracy([0.1, 0.3, 0.7, 0.1, 0.0, 1.0], truth) == 0.0
    assert ranking_accuracy([0.5, 0.5, 0.1, 0.7, 0, 0], truth) == 0.75  # a tie counts half
    assert ranking_accuracy([0, 0], [0.5, 0.5]) is None


def test_colour_scale():
    assert colour(0.0, 1.0) == "#ffffff" and colour(1.0, 1.0) == "#00ff00" and colour(-1.0, 1.0) == "#ff0000"
    assert colour(5.0, 1.0) == "#00ff00"  # clipped


def test_render_html_escapes_model_text():
    ex = {"question": "Tom has 3 <b>apples</b>.", "answer": "5", "reward": 1.0, "steps": ["3 + 2 = 5\n", "#### 5"],
          "values": [0.25, 0.75, 0.0], "vine": [0.5, 0.25], "grpo": 0.8, "group_rewards": [1, 0, 0, 1], "K": 9}
    page = render_html(ex)
    assert "&lt;b&gt;apples" in page and "<b>apples" not in page
    assert page.count('class="step"') == 4 and "V 0.25 &rarr; 0.75, A = +0.50" in page


def test_plot_runs(tmp_path):
    a = tmp_path / "vine" / "metrics.jsonl"
    a.parent.mkdir()
    rows = [{"iteration": 0, "eval_accuracy": 0.2, "train_seconds": 0},
            {"iteration": 1, "train_seconds": 60, "reward_mean": 0.3, "kl_ref": 1e-4, "tokens_per_s": 200},
            {"iteration": 2, "train_seconds": 120, "reward_mean": 0.4, "kl_ref": 2e-4, "tokens_per_s": 210,
             "eval_accuracy": 0.3}]
    a.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = plot_runs([str(a)], str(tmp_path / "curves.png"))
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.endswith("curves.png")
    a.write_text("not json\n")
    with pytest.raises(SystemExit, match="metrics.jsonl:1"):
        read_metrics(str(a))


def test_rules_are_simulated_on_one_pool_in_order():
    from diagnose import rule_summary, simulate_rule
    pool = [[0.0] * 45, [1.0, 0.0] * 22 + [1.0], [1.0] * 45, [0.0, 0.0, 1.0] * 15]
    assert simulate_rule(pool, k_mode="fixed", K=9) == [p[:9] for p in pool]
    adaptive = simulate_rule(pool, k_mode="adaptive", K=9, k_ci=0.6)
    assert [len(r) for r in adaptive][:3] == [3, 9, 3] and all(r == p[:len(r)] for r, p in zip(adaptive, pool))
    assert sum(map(len, simulate_rule(pool, k_mode="budget", K=9))) == 36
    row = rule_summary([[1.0, 0.0], [1.0], [0.0], [0.0, 0.0]], truth=[0.5, 1.0, 0.25, 0.0])
    assert row["mae"] == pytest.approx(0.25 / 4) and row["bias"] == pytest.approx(-0.25 / 4)
    assert row["advantage_mae"] == pytest.approx(0.25 / 2) and row["vines_per_state"] == 1.5
