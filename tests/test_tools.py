"""Pure pieces of the diagnostic, the credit picture and the plots."""
import json
import math
import shutil

import pytest

from research.readout import plot_runs
from runlog import read_metrics
from scripts.diagnose import expected_mc_error, ranking_accuracy, sibling_states
from scripts.visualize import colour, render_html


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


class ScriptedSampler:
    """Every response is "x = 2 / y = 3 / #### 5". Two continuations of Q0's parent share their first line (no
    pair); Q1's and Q2's differ. Screening vines: Q1's states are all right, Q2's half right."""

    def __init__(self, tokenizer):
        self.tokenizer, self.calls = tokenizer, []

    def make(self, text):
        from rollout import Sample
        ids = self.tokenizer(text, add_special_tokens=False).input_ids
        return Sample(token_ids=ids, text=text, finished=True, logprobs=[0.0] * len(ids))

    def sample(self, prompts, *, n, **kwargs):
        self.calls.append(("sample", len(prompts)))
        return [[self.make("x = 2\ny = 3\n#### 5")] for _ in prompts]

    def sample_prefixes(self, sequences, prefix_lens, *, n, **kwargs):
        self.calls.append(("prefixes", len(sequences), n))
        out = []
        for seq, L in zip(sequences, prefix_lens):
            problem = next(q for q in ("Q0", "Q1", "Q2") if q in self.tokenizer.decode(seq[:L]))
            if n == 2:
                firsts = ["z = 1\n", "z = 1\n"] if problem == "Q0" else ["a = 1\n", "b = 2\n"]
                out.append([self.make(f + "c = 3\n#### 5") for f in firsts])
            else:
                out.append([self.make("#### 5" if problem == "Q1" or j % 2 else "#### 6") for j in range(n)])
        return out


def test_sibling_states_keep_differing_pairs_and_screen_for_intermediate_values(smol_path):
    from model import load_tokenizer
    tokenizer = load_tokenizer(smol_path)
    examples = [{"question": f"Q{i}: what is 2 + 3?", "answer": "5"} for i in range(3)]
    find = dict(tokenizer=tokenizer, examples=examples, dataset="arith", max_new_tokens=64, temperature=1.0,
                top_p=1.0, seed=0)
    sampler = ScriptedSampler(tokenizer)
    states = sibling_states(sampler, pairs=5, **find)
    assert [s["pair"] for s in states] == [0, 0, 1, 1]  # Q1 and Q2: Q0's two continuations begin alike
    assert sampler.calls == [("sample", 3), ("prefixes", 3, 2)]  # the chunk in one call each
    texts = [tokenizer.decode(s["prefix"]) for s in states]
    assert texts[0].endswith("a = 1\n") and texts[1].endswith("b = 2\n") and "Q1" in tokenizer.decode(states[0]["prompt"])
    screened = sibling_states(ScriptedSampler(tokenizer), pairs=5, screen=4, **find)
    assert len(screened) == 2 and all("Q2" in tokenizer.decode(s["prompt"]) for s in screened)  # Q1's are all right
    one = ScriptedSampler(tokenizer)
    assert len(sibling_states(one, pairs=1, chunk=1, **find)) == 2 and len(one.calls) == 4  # Q0 (none), Q1: stop


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
    from scripts.diagnose import rule_summary, simulate_rule
    pool = [[0.0] * 45, [1.0, 0.0] * 22 + [1.0], [1.0] * 45, [0.0, 0.0, 1.0] * 15]
    assert simulate_rule(pool, k_mode="fixed", K=9) == [p[:9] for p in pool]
    adaptive = simulate_rule(pool, k_mode="adaptive", K=9, k_ci=0.6)
    assert [len(r) for r in adaptive][:3] == [3, 9, 3] and all(r == p[:len(r)] for r, p in zip(adaptive, pool))
    assert sum(map(len, simulate_rule(pool, k_mode="budget", K=9))) == 36
    row = rule_summary([[1.0, 0.0], [1.0], [0.0], [0.0, 0.0]], truth=[0.5, 1.0, 0.25, 0.0])
    assert row["mae"] == pytest.approx(0.25 / 4) and row["bias"] == pytest.approx(-0.25 / 4)
    assert row["advantage_mae"] == pytest.approx(0.25 / 2) and row["vines_per_state"] == 1.5


def grid_run(evals: list[tuple[float, float]], kl: float = 1e-3) -> list[dict]:
    """A run's metrics: an evaluation at each (training minute, pass@1), one iteration a minute."""
    records = []
    for i, (minute, accuracy) in enumerate(evals):
        record = {"iteration": i, "train_seconds": 60.0 * minute, "eval_accuracy": accuracy}
        if i:
            record["kl_ref"] = kl
        records.append(record)
    return records


def test_grid_statistics_by_hand():
    from research.readout import area, held, mean_se, summarize_grid, summary_markdown, time_to
    curve = [(0.0, 0.2), (4.0, 0.4), (8.0, 0.1)]
    assert [held(curve, t) for t in (0, 3.9, 4, 7, 8, 20)] == [0.2, 0.2, 0.4, 0.4, 0.1, 0.1]
    assert area(curve, minutes=10) == pytest.approx((0.2 * 4 + 0.4 * 4 + 0.1 * 2) / 10)
    assert time_to(curve, 0.35) == 4.0 and time_to(curve, 0.5) is None
    assert mean_se([0.2, 0.4]) == pytest.approx((0.3, 0.1)) and mean_se([0.5]) == (0.5, 0.0)
    runs = {"vine": {0: grid_run([(0, 0.2), (5, 0.4), (10, 0.5)]), 1: grid_run([(0, 0.2), (6, 0.3), (10, 0.3)])},
            "grpo": {1: grid_run([(0, 0.2), (5, 0.05), (10, 0.05)], kl=0.5)}}
    summary = summarize_grid(runs, budget=600, threshold=0.35)
    vine, grpo = summary["vine"], summary["grpo"]
    assert (vine["seeds"], vine["final"], vine["final_se"]) == (2, pytest.approx(0.4), pytest.approx(0.1))
    assert (vine["gain"], vine["gain_se"]) == (pytest.approx(0.2), pytest.approx(0.1))  # (0.5 - 0.2, 0.3 - 0.2)
    assert grpo["gain"] == pytest.approx(-0.15) and grpo["gain_se"] == 0.0
    assert vine["best"] == pytest.approx(0.4) and (vine["minutes_to_threshold"], vine["reached"]) == (5.0, 1)
    assert vine["area"] == pytest.approx(((0.2 * 5 + 0.4 * 5) + (0.2 * 6 + 0.3 * 4)) / 20)
    assert (vine["area_gain"], vine["area_gain_se"]) == (pytest.approx(0.07), pytest.approx(0.03))  # mean of 0.3 - 0.2, 0.24 - 0.2
    assert vine["seconds_per_iteration"] == pytest.approx(300) and vine["collapsed"] == 0
    assert (grpo["collapsed"], grpo["reached"], grpo["kl_ref"]) == (1, 0, 0.5)
    table = summary_markdown(summary, threshold=0.35)
    # paired with vine on the one seed both have (seed 1): final 0.05 - 0.3, area (0.2 * 5 + 0.05 * 5) / 10 - 0.24
    assert grpo["paired"] == 1 and grpo["final_vs_baseline"] == pytest.approx(-0.25)
    assert grpo["area_vs_baseline"] == pytest.approx(0.125 - 0.24) and vine["final_vs_baseline"] == 0.0
    assert "| vine | 2 | 0.400 ± 0.100 | +0.200 ± 0.100 |" in table and "never (0/1)" in table and "| -0.250 ± – (1) |" in table
    assert "| grpo | 1 | 0.050 ± – | -0.150 ± – |" in table  # one seed: no spread to show, never "± 0.000"


def test_bands_end_at_each_runs_final_evaluation():
    from research.readout import bands
    # a 10-minute budget; the runs' last iterations end past it (10.2 and 10.4 min), as real runs do
    runs = {"vine": {0: grid_run([(0, 0.2), (9.8, 0.6), (10.2, 0.4)]), 1: grid_run([(0, 0.2), (5, 0.3), (10.4, 0.2)])}}
    band = bands(runs, budget=600, points=53)["vine"]
    assert band[0] == (0.0, 0.2, 0.0) and band[-1][0] == pytest.approx(10.4)
    assert band[-1][1:] == pytest.approx((0.3, 0.1))  # the mean of the final evaluations, not of those before
    assert [m for t, m, _ in band if t == pytest.approx(10.0)] == [pytest.approx(0.45)]  # 0.6 and 0.3 held at 10 min


def test_bands_on_iterations_and_the_reward_view(tmp_path):
    from research.readout import bands, plot_bands, reward_curve
    runs = {"vine": {0: grid_run([(0, 0.2), (1, 0.6), (2, 0.4)]), 1: grid_run([(0, 0.2), (1, 0.3)])}}
    band = bands(runs, budget=600, points=3, x="iteration")["vine"]  # the shortest seed ends at iteration 1
    assert [t for t, _, _ in band] == [0.0, 0.5, 1.0] and band[-1][1:] == pytest.approx((0.45, 0.15))
    records = [{"iteration": 0, "eval_accuracy": 0.1}] + [{"iteration": i, "reward_mean": i / 10} for i in range(1, 8)]
    records[-1]["eval_accuracy"] = 0.5
    assert reward_curve(records, window=5) == [(pytest.approx(0.5), 0.5)]  # (0.3 + ... + 0.7) / 5; not iteration 0
    assert plot_bands(runs, str(tmp_path / "c.png"), budget=600) and (tmp_path / "c.png").stat().st_size > 0


def test_replicate_summarize_one_run_by_hand():
    from research.readout import summarize
    records = [{"iteration": 0, "eval_accuracy": 0.5, "eval_se": 0.02, "seconds_eval": 30.0},
               {"iteration": 1, "train_seconds": 40.0, "seconds": 40.0, "reward_mean": 0.2},
               {"iteration": 2, "train_seconds": 80.0, "seconds": 70.0, "reward_mean": 0.6, "eval_accuracy": 0.4,
                "eval_se": 0.03, "seconds_eval": 30.0}]
    row = summarize(records, "vine", 3)
    assert row["wall_minutes"] == pytest.approx((30 + 40 + 70) / 60)  # the start evaluation has no "seconds"
    assert row["train_minutes"] == pytest.approx(80 / 60) and row["seconds_per_iteration"] == pytest.approx(40)
    assert (row["start_pass1"], row["final_pass1"], row["best_pass1"], row["eval_se"]) == (0.5, 0.4, 0.5, 0.03)
    assert row["final_train_reward"] == pytest.approx(0.4) and row["iterations"] == 2


def test_replicate_skips_finished_runs_and_resumes_cut_ones(tmp_path):
    from research.replication.replicate import run_state
    run_dir = tmp_path / "vine-s0"
    assert run_state(run_dir, budget=600) == "fresh"  # nothing there
    run_dir.mkdir()
    (run_dir / "latest").write_text("ckpt-000004")
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in grid_run([(0, 0.2), (4, 0.3)])))
    assert run_state(run_dir, budget=600) == "resume"  # 240 s of 600: cut off
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"iteration": 11, "train_seconds": 610.0, "kl_ref": 1e-3, "eval_accuracy": 0.4}) + "\n")
    assert run_state(run_dir, budget=600) == "done"
    (run_dir / "latest").unlink()  # a clean checkout: the committed metrics, no checkpoint
    assert run_state(run_dir, budget=600) == "done"
    assert run_state(run_dir, budget=900) == "fresh"  # cut off with nothing to resume from


def test_replicate_pipeline_summary_and_blocks_keyed_by_the_sft_model(tmp_path):
    from research.grid import describe
    from research.replication.replicate import sft_summary
    assert sft_summary(tmp_path) == "SFT stage: no metrics here.\n"
    records = [{"iteration": 0, "eval_accuracy": 0.01}, {"iteration": 1, "loss": 0.5, "train_seconds": 60.0},
               {"iteration": 2, "loss": 0.1, "train_seconds": 120.0, "eval_accuracy": 0.6,
                "first_wrong_line": {"1": 3, "2": 5}}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    line = sft_summary(tmp_path)
    assert "2 steps, 2.0 min" in line and "0.010 before, 0.600 after" in line and "{'1': 3, '2': 5}" in line
    machine = {"cpu": "X", "bf16_units": [], "cpus": 2, "threads": 2, "dtype": "float32"}
    assert "SFT" not in describe(machine) and "from SFT model 0123456789ab" in describe(
        {**machine, "sft_sha256": "0123456789abcdef"})
    assert machine != {**machine, "sft_sha256": "0123456789abcdef"}  # run() compares blocks as whole dicts


def test_replicate_pipeline_refuses_an_sft_stage_of_the_other_schedule(tmp_path):
    from research.grid import ended_decayed, sft_stage
    from research.replication.replicate import SFT_SETTINGS
    sft = tmp_path / "sft"
    sft.mkdir()
    metrics = sft / "metrics.jsonl"
    metrics.write_text(json.dumps({"iteration": 0, "eval_accuracy": 0.0}) + "\n")
    assert ended_decayed(metrics) is None  # no step yet: either schedule may resume it
    rows = [{"iteration": i, "lr": lr} for i, lr in enumerate([2.5e-5, 5e-5, 3e-5, 1e-6], 1)]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert ended_decayed(metrics) is True
    with pytest.raises(SystemExit, match="decayed, unlike the schedule asked for"):
        sft_stage(tmp_path, settings=[*SFT_SETTINGS, "--no-lr-decay"])
    metrics.write_text("".join(json.dumps({**r, "lr": min(r["lr"], 5e-5) if i < 2 else 5e-5}) + "\n"
                               for i, r in enumerate(rows)))
    assert ended_decayed(metrics) is False
    with pytest.raises(SystemExit, match="did not decay"):
        sft_stage(tmp_path, settings=SFT_SETTINGS)


def test_replicate_extras_use_a_run_that_still_has_its_checkpoint(tmp_path):
    from research.replication.replicate import latest_checkpoint
    runs = [tmp_path / f"critic-s{seed}" for seed in range(3)]
    for run_dir in runs:
        run_dir.mkdir()
    assert latest_checkpoint(runs) is None  # a clean checkout: metrics only
    (runs[2] / "latest").write_text("ckpt-000061\n")
    (runs[1] / "latest").write_text("ckpt-000040")
    assert latest_checkpoint(runs) == runs[1] / "ckpt-000040"


def test_replicate_keeps_each_seed_on_one_machine(tmp_path):
    from research.grid import this_machine
    from research.replication.replicate import run, seed_machine
    here = this_machine()
    other = {**here, "bf16_units": ["amx_bf16"] if not here["bf16_units"] else [], "dtype": "other"}
    assert seed_machine(tmp_path, 1) is None  # a new seed: its block goes to whichever machine starts it
    (tmp_path / "vine-s1").mkdir()
    (tmp_path / "vine-s1" / "machine.json").write_text(json.dumps(other))
    assert seed_machine(tmp_path, 1) == other
    # seed 1's block is on another machine: its critic run is not started here (None, and no folder written)
    assert run("critic", 1, budget=600, out=tmp_path, extra=[], machine=here) is None
    assert not (tmp_path / "critic-s1").exists()


def test_replicate_redraw_runs_nothing_and_summarizes_the_finished_runs(tmp_path, monkeypatch):
    from research.replication import replicate
    done, cut = tmp_path / "vine-s0", tmp_path / "critic-s0"
    for run_dir, minutes in ((done, 10), (cut, 4)):
        run_dir.mkdir()
        records = [{**r, "reward_mean": 0.5} for r in grid_run([(0, 0.2), (minutes / 2, 0.3), (minutes, 0.4)])]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (cut / "latest").write_text("ckpt-000002")  # cut off at 4 of 10 minutes: a plain invocation would resume it
    (done / "latest").write_text("ckpt-000005")  # its checkpoint still here: what --extras would diagnose
    other = tmp_path / "grpo-s5"  # finished in an earlier sitting, outside this invocation's --seeds and --estimators
    shutil.copytree(done, other)
    (other / "machine.json").write_text(json.dumps(replicate.this_machine()))
    (tmp_path / "notes-sx").mkdir()  # a folder that is not a cell
    (tmp_path / "notes-sx" / "machine.json").write_text("{}")
    assert replicate.block_seeds(tmp_path) == [5]
    monkeypatch.setattr(replicate, "run", lambda *a, **k: pytest.fail(f"--redraw started the run {a}"))
    monkeypatch.setattr(replicate.subprocess, "run", lambda cmd, **k: pytest.fail(f"--redraw ran {cmd}"))  # --extras
    monkeypatch.setattr("sys.argv", ["research/replication/replicate.py", "--budget", "600", "--seeds", "0", "--estimators", "vine,critic",
                                     "--out", str(tmp_path), "--redraw"])
    replicate.main()
    results = (tmp_path / "results.md").read_text()
    assert "| vine | 1 | 0.400 ± – |" in results and "| critic |" not in results
    assert "| grpo | 1 | 0.400 ± – |" in results  # the summary covers every finished run in --out
    assert (tmp_path / "curves.png").exists() and not (cut / "machine.json").exists()


def test_replicate_bad_seeds_is_a_one_line_error(tmp_path, monkeypatch):
    from research.replication import replicate
    monkeypatch.setattr("sys.argv", ["research/replication/replicate.py", "--seeds", "0,x", "--out", str(tmp_path), "--redraw"])
    with pytest.raises(SystemExit, match="--seeds: expected comma-separated non-negative integers, got '0,x'"):
        replicate.main()



def test_diagnose_reads_a_separate_critic_as_training_does(tmp_path):
    """scripts.diagnose's V of a state from a saved --critic separate critic (ckpt-*/critic/) is what training's
    Critic.forward gives before the token after that state; a nonzero head, so a zero head cannot pass."""
    import torch
    from checkpoint import save_critic
    from critic import Critic, load_critic
    from dist_worker import tiny_policy
    from scripts.diagnose import separate_critic_values
    head = torch.nn.Linear(32, 1)
    torch.nn.init.normal_(head.weight, std=0.5)
    critic = Critic(tiny_policy().model, head)
    save_critic(tmp_path, critic, critic.state_dict())
    loaded = load_critic(str(tmp_path), device=torch.device("cpu"), dtype=torch.float32)
    states = [{"prompt": [1, 5, 7], "prefix": [9, 11]}, {"prompt": [1, 2], "prefix": [3, 4, 6, 8]}]
    got = separate_critic_values(loaded, states)
    for s, v in zip(states, got):
        ids = torch.tensor([s["prompt"] + s["prefix"] + [0]])  # one more token: forward gives V before each one
        with torch.no_grad():
            want = critic(ids, torch.ones_like(ids), response_start=len(s["prompt"] + s["prefix"]))[0, 0].item()
        assert v == pytest.approx(want, abs=1e-5)
    assert abs(got[0] - got[1]) > 1e-4  # the states are told apart
