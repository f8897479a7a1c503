"""The paper-regime grid's pieces (research.paper_regime.paper_regime, research.paper_regime.regime_report): grpo-matched's sample accounting,
the paper-style evaluation of a run's last policy, the lift runs a grid arm adopts, and the paired read-out."""
import hashlib
import json
import math
from types import SimpleNamespace

import pytest

from config import parse_config
from research.grid import SETTINGS
from research.paper_regime import paper_regime, recipe, regime_report
from research.paper_regime.paper_regime import grid_arms
from research.paper_regime.recipe import ARMS, matched_flags, matched_samples

DIGEST = "ab" * 32


def test_matched_samples_scales_the_group_by_the_token_ratio():
    """vine's sampled tokens over grpo's, times 8 responses, to the nearest multiple of 4 (the lift test's easy
    task: 85.0k / 19.5k tokens -> 34.9 -> 36); never below 4."""
    assert matched_samples(vine_tokens=85011, grpo_tokens=19502) == 36
    assert matched_samples(vine_tokens=40000, grpo_tokens=20000) == 16
    assert matched_samples(vine_tokens=41000, grpo_tokens=20000) == 16  # 16.4
    assert matched_samples(vine_tokens=1000, grpo_tokens=20000) == 4


@pytest.mark.parametrize("samples", [16, 36, 40])
def test_grpo_matched_keeps_the_prompts_and_the_optimizer_steps(samples):
    """grpo-matched parses with the grid's settings: the same 64 prompts, `samples` responses each (samples / 8 times
    grpo's sampled tokens at the same response length), and still 8 optimizer steps an iteration, in micro-batches
    that divide the minibatch."""
    grpo = parse_config([*SETTINGS, *ARMS["grpo"], "--device", "cpu"])
    matched = parse_config([*SETTINGS, *matched_flags(samples), "--device", "cpu"])
    assert matched.estimator == "grpo" and matched.prompts_per_iter == grpo.prompts_per_iter == 64
    assert matched.samples_per_prompt * matched.prompts_per_iter == samples * 64
    steps = lambda cfg: cfg.prompts_per_iter * cfg.samples_per_prompt // cfg.minibatch_size  # noqa: E731
    assert steps(matched) == steps(grpo) == 8 and matched.minibatch_size % matched.micro_batch_size == 0
    assert (matched.lr, matched.epochs, matched.kl_coef) == (grpo.lr, grpo.epochs, grpo.kl_coef)


def test_the_grid_arms_differ_from_grpo_only_where_they_say():
    """vine, vine-free, critic and grpo-matched parse with the grid's settings; the critic is the separate copy;
    grpo-matched takes its task's samples per prompt."""
    for task in recipe.TASKS:
        cfgs = {arm: parse_config([*SETTINGS, *flags, "--device", "cpu"]) for arm, flags in grid_arms(task).items()}
        assert cfgs["vine"].estimator == "vine" and cfgs["vine"].k == 9 and cfgs["vine-free"].free_samples == "topup"
        assert cfgs["critic"].critic == "separate" and cfgs["critic"].value_lr == 1e-3
        assert cfgs["grpo-matched"].samples_per_prompt == paper_regime.MATCHED[task]


def test_final_eval_measures_the_last_checkpoint_once_and_names_it(tmp_path, monkeypatch):
    """final.json: the plateau's evaluations (the paper's 16 x T 0.35 among them) of the checkpoint `latest` names,
    bound to its weights' sha256; measured once; a run without it and without a checkpoint is a one-line error."""
    run = tmp_path / "vine-s0"
    (run / "ckpt-000030").mkdir(parents=True)
    (run / "ckpt-000030" / "model.safetensors").write_bytes(b"weights")
    (run / "latest").write_text("ckpt-000030\n")
    calls = []
    monkeypatch.setattr(recipe, "plateau", lambda folder: calls.append(folder.name) or {"test T 0.35 x 16": [0.6, 0.02]})
    first = recipe.final_eval(run)
    assert first["checkpoint"] == "ckpt-000030" and first["test T 0.35 x 16"] == [0.6, 0.02]
    assert first["sha256"] == hashlib.sha256(b"weights").hexdigest()
    assert recipe.final_eval(run) == first and calls == ["ckpt-000030"]
    with pytest.raises(SystemExit, match="no final.json and no checkpoint"):
        recipe.final_eval(tmp_path / "grpo-s0")


def test_plateau_evaluates_as_the_paper():
    """The paper's evaluation among the plateau's: 16 samples per test problem at T 0.35, and greedy beside it."""
    assert recipe.PLATEAU["test T 0.35 x 16"] == (0.35, 16, "test", 500)
    assert recipe.PLATEAU["test greedy"] == (0.0, 1, "test", 500)


def test_pass1_from_many_samples_is_the_mean_over_problems_with_its_se():
    """rollout.evaluate with 16 samples per problem: each problem's share of right samples, their mean, and the SE
    over problems (not over samples)."""
    from rollout import evaluate
    right = {"1": 16, "2": 4, "3": 0}  # right samples of 16, by answer

    class Scripted:
        def sample(self, prompts, *, n, temperature, top_p, max_new_tokens, seed):
            assert (n, temperature) == (16, 0.35)
            return [[SimpleNamespace(text=f"####{answer if i < right[answer] else 0}", finished=True)
                     for i in range(n)] for answer in ("1", "2", "3")]

    class Tokenizer:
        def __call__(self, text, **_):
            return SimpleNamespace(input_ids=[0])
    cfg = SimpleNamespace(grader="chain", prompt_format="plain", eval_samples=16, eval_temperature=0.35, top_p=0.9,
                          max_new_tokens=8)
    examples = [{"question": f"{a} +0", "answer": a} for a in ("1", "2", "3")]
    mean, se = evaluate(Scripted(), Tokenizer(), examples, cfg, seed=0)
    shares = [1.0, 0.25, 0.0]
    assert mean == pytest.approx(sum(shares) / 3)
    sd = math.sqrt(sum((s - mean) ** 2 for s in shares) / 2)
    assert se == pytest.approx(sd / math.sqrt(3))


def fake_run(folder, *, evals, tokens=20000, seconds=8.0, silent=0.5, final=None, start=DIGEST):
    """A finished run: evaluations at iterations 0, 3, ..., 30, `tokens` sampled and `seconds` trained an iteration."""
    folder.mkdir(parents=True)
    (folder / "start.json").write_text(json.dumps({"model_sha256": start}))
    records = []
    for i in range(31):
        r = {"iteration": i}
        if i:
            r.update(sampled_tokens=tokens, train_seconds=seconds * i, silent_frac=silent, silent_credited_frac=0.1,
                     silent_found_frac=0.2)
        if i % 3 == 0:
            r.update(eval_accuracy=evals[i // 3], train_seconds=seconds * i)
        records.append(r)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if final is not None:
        (folder / "final.json").write_text(json.dumps({"test T 0.35 x 16": [final, 0.02], "test greedy": [final, 0.02]}))


def test_pair_gap_on_each_axis_uses_only_what_both_runs_reached():
    """Per iteration: the difference of the means over evaluations 3-30. Per token: the held curves' means up to the
    cheaper run's total, never the cheaper run held flat past its end."""
    cheap = [{"iteration": 0, "eval_accuracy": 0.5}] + [
        {"iteration": i, "sampled_tokens": 1e5, **({"eval_accuracy": 0.8} if i % 3 == 0 else {})} for i in range(1, 31)]
    costly = [{"iteration": 0, "eval_accuracy": 0.5}] + [
        {"iteration": i, "sampled_tokens": 4e5, **({"eval_accuracy": 0.6} if i % 3 == 0 else {})} for i in range(1, 31)]
    assert regime_report.pair_gap(cheap, costly, axis="iteration") == pytest.approx(0.2)
    # the cheap run's 3 M tokens: the costly one evaluated at 1.2, 2.4 (0.5 before 1.2, then 0.6); the cheap one 0.5
    # before 0.3 M tokens, 0.8 after
    cheap_mean = (0.5 * 0.3 + 0.8 * 2.7) / 3.0
    costly_mean = (0.5 * 1.2 + 0.6 * 1.8) / 3.0
    assert regime_report.pair_gap(cheap, costly, axis="tokens") == pytest.approx(cheap_mean - costly_mean)


def test_report_reads_the_paper_table_gaps_and_growth(tmp_path):
    """results.md from fake runs: each arm's final 16 x T 0.35 against the plateau ('*' only > 2 SE above it), the
    paired gaps with their seeds, the growth from easy to hard, the silent groups; results.json and curves.png."""
    for task, lift in (("easy", 0.1), ("hard", 0.2)):
        sft = tmp_path / task / "sft"
        sft.mkdir(parents=True)
        (sft / "model.sha256").write_text(DIGEST + "\n")
        (sft / "plateau.json").write_text(json.dumps({"test T 0.35 x 16": [0.5, 0.02], "test greedy": [0.5, 0.02]}))
        for seed in range(3):
            fake_run(tmp_path / task / f"vine-s{seed}", evals=[0.5] + [0.5 + lift + 0.01 * seed] * 10, tokens=80000,
                     seconds=16, final=0.5 + lift + 0.01 * seed)
            fake_run(tmp_path / task / f"grpo-s{seed}", evals=[0.5] + [0.5 + 0.01 * seed] * 10, final=0.5 + 0.01 * seed)
    arms = {"vine": ARMS["vine"], "grpo": ARMS["grpo"]}
    text = regime_report.report(tmp_path, arms={"easy": arms, "hard": arms}, settings=["--x"])
    easy = next(line for line in text.splitlines() if line.startswith("| easy | 0.500 ± 0.020"))  # the paper's table
    assert "| 0.610 ± 0.006 * (greedy 0.610) | 0.510 ± 0.006 (greedy 0.510) |" in easy
    assert "| easy | vine − grpo | +0.100 ± 0.000 (3) * |" in text and "| hard | vine − grpo | +0.200 ± 0.000 (3) * |" in text
    assert "| vine − grpo | +0.100 ± 0.000 * |" in text  # hard − easy per iteration, more than 2 SE from 0
    assert "| hard | vine | 0.50 | 0.50 | 0.20 | 0.10 | 0.080 | 16.0 |" in text
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["tasks"]["hard"]["sft_sha256"] == DIGEST and (tmp_path / "curves.png").stat().st_size > 0


def test_adopt_lift_runs_copies_only_finished_runs_of_the_same_start(tmp_path):
    """A grid arm whose command a lift arm ran takes that run (done, same start) instead of rerunning it; a cut-off
    run, one from another start, or a grid folder already there is left alone."""
    task = tmp_path / "easy"
    (task / "sft").mkdir(parents=True)
    (task / "sft" / "model.sha256").write_text(DIGEST + "\n")
    fake_run(task / "lift" / "grpo-lr5e-5-s0", evals=[0.5] * 11)
    fake_run(task / "lift" / "vine-lr5e-5-s0", evals=[0.5] * 11, start="cd" * 32)
    fake_run(task / "lift" / "grpo-lr2e-4-s1", evals=[0.5] * 11)
    fake_run(task / "lift" / "grpo-lr5e-5-s2", evals=[0.5] * 11)
    fake_run(task / "grpo-s2", evals=[0.6] * 11)
    assert paper_regime.adopt_lift_runs(task, seeds=[0, 1, 2]) == ["grpo-s0"]
    assert (task / "grpo-s0" / "metrics.jsonl").read_text() == (task / "lift" / "grpo-lr5e-5-s0" / "metrics.jsonl").read_text()
    assert '"eval_accuracy": 0.6' in (task / "grpo-s2" / "metrics.jsonl").read_text()
    assert paper_regime.ADOPTED == {"grpo": "grpo-lr5e-5", "vine": "vine-lr5e-5"}
    lift_flags = [f for f in paper_regime.LIFT_ARMS["grpo-lr5e-5"] if f not in ("--lr", "5e-5")]
    assert lift_flags == ARMS["grpo"] and "5e-5" == SETTINGS[SETTINGS.index("--lr") + 1]


def test_the_grid_command_refuses_an_unknown_task_or_arm():
    import subprocess
    import sys
    from conftest import REPO
    for flag in (["--task", "medium"], ["--arms", "vine,ppo"]):
        out = subprocess.run([sys.executable, "-m", "research.paper_regime.paper_regime", *flag, "--redraw"], cwd=REPO,
                             capture_output=True, text=True)
        assert out.returncode == 2 and "unknown" in out.stderr.strip().splitlines()[-1]


def test_run_grid_takes_each_folders_own_arm_flags_and_reports_each_run_as_it_ends(tmp_path, monkeypatch):
    """research.grid.run_grid with folder_arms: a cell's train.py command carries its folder's flags for the arm
    (grpo-matched's samples per task), and on_done gets each run's folder when it ends."""
    from research import grid
    launched, ended = [], []

    class Finished:
        returncode = 0

        def __init__(self, cmd, **_):
            launched.append(cmd)

        def poll(self):
            return 0
    monkeypatch.setattr(grid.subprocess, "Popen", Finished)
    monkeypatch.setattr(grid.time, "sleep", lambda _: None)
    folders = {tmp_path / task: tmp_path / task / "sft" for task in ("easy", "hard")}
    for sft in folders.values():
        sft.mkdir(parents=True)
        (sft / "model.sha256").write_text(DIGEST + "\n")
    grid.run_grid([(folder, "grpo-matched", 0) for folder in folders], sft_dirs=folders,
                     extras={f: [] for f in folders}, jobs=2, machine={}, arms={},
                     folder_arms={f: grid_arms(f.name) for f in folders}, on_done=ended.append)
    samples = [cmd[len(cmd) - 1 - cmd[::-1].index("--samples-per-prompt") + 1] for cmd in launched]
    assert samples == [str(paper_regime.MATCHED["easy"]), str(paper_regime.MATCHED["hard"])]
    assert ended == [tmp_path / "easy" / "grpo-matched-s0", tmp_path / "hard" / "grpo-matched-s0"]


def test_the_paper_table_lines_up_when_a_task_lacks_an_arm():
    """A grid cut off between tasks: the table's columns are every task's arms, and a task without one shows '–'
    in that column instead of shifting its other cells left."""
    plateau = {"test T 0.35 x 16": [0.3, 0.02], "test greedy": [0.3, 0.02]}
    run = {"final_paper": 0.6, "final_greedy": 0.61}
    summaries = {"easy": {"plateau": plateau, "arms": {"vine-silent": {0: run}}, "gaps": {}},
                 "hard": {"plateau": plateau, "arms": {"vine": {0: run}, "vine-silent": {0: run}}, "gaps": {}}}
    table = [line for line in regime_report.markdown(summaries).splitlines() if line.startswith("| ") and "---" not in line][:3]
    assert table[0] == "| task | SFT plateau | vine-silent | vine |"
    assert table[1].split(" | ")[2:] == ["0.600 ± – (greedy 0.610)", "– |"]
    assert table[2].split(" | ")[2:] == ["0.600 ± – (greedy 0.610)", "0.600 ± – (greedy 0.610) |"]


def test_start_shift_pairs_each_arm_by_seed_across_two_starts(tmp_path):
    """start_shift: the second start's runs minus the first's, seed by seed, per iteration and on the final score,
    with each start's plateau; runs bound to another start are not counted."""
    other = "b" * 64
    for label, digest, level, plateau in (("A", DIGEST, 0.5, 0.30), ("B", other, 0.6, 0.36)):
        sft = tmp_path / label / "sft"
        sft.mkdir(parents=True)
        (sft / "model.sha256").write_text(digest + "\n")
        (sft / "plateau.json").write_text(json.dumps({"test T 0.35 x 16": [plateau, 0.02]}))
        for seed in range(3):
            fake_run(tmp_path / label / f"vine-s{seed}", evals=[0.3] + [level + 0.01 * seed * (label == "B")] * 10,
                     final=level + 0.02, start=digest)
    fake_run(tmp_path / "B" / "grpo-s0", evals=[0.3] * 11, final=0.3, start=DIGEST)  # bound to A's start: skipped
    text = regime_report.start_shift({"A": tmp_path / "A", "B": tmp_path / "B"}, arms=["vine", "grpo"])
    assert "plateau 16 × T 0.35: A 0.300, B 0.360, +0.060" in text
    assert "| vine | 3 | +0.110 ± 0.006 (3) * | +0.100 ± 0.000 (3) * |" in text and "| grpo |" not in text


def test_sft_validation_reads_the_path_every_n_steps_and_the_last(tmp_path):
    records = [{"iteration": i, "lr": 1e-3 * (1 - i / 250), **({"validation_accuracy": i / 1000} if i % 50 == 0 else {})}
               for i in range(1, 251)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert regime_report.sft_validation(tmp_path, every=100) == [(100, 0.1, pytest.approx(6e-4)), (200, 0.2,
                                                                 pytest.approx(2e-4)), (250, 0.25, 0.0)]
    assert regime_report.sft_validation(tmp_path / "missing") == []
