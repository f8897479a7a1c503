"""The testbed's pieces: the chain task, the character tokenizer and the from-scratch model
(model.new_scratch_model), the gradient signal (ppo.half_cosine), their flags' one-line errors, a data file that is
not UTF-8, and (slow) sft.py --model scratch then two train.py iterations of every estimator from it."""
import json
import subprocess
import sys

import pytest
import torch

from conftest import REPO
from data import load_split, make_arith, make_chain, task_chars
from grader import grade
from model import char_tokenizer, new_scratch_model
from ppo import half_cosine
from values import split_steps


def test_chain_is_arith_written_compactly():
    arith, chain = make_arith(50, seed=3, ops=4, max_number=20), make_chain(50, seed=3, ops=4, max_number=20)
    for a, c in zip(arith, chain):
        assert c["answer"] == a["answer"] and c["solution"] == a["solution"].replace(" ", "")  # the same numbers
        steps = [line.split(" ") for line in a["solution"].split("\n")[:-1]]  # "13 * 3 = 39" -> its five parts
        assert c["question"] == " ".join([steps[0][0]] + [op + b for _, op, b, _, _ in steps])
        assert c["solution"].split("\n")[-1] == f"####{a['answer']}"
        assert grade(c["solution"], c["answer"], grader="chain") == 1.0
        assert grade(c["solution"].replace(f"####{c['answer']}", "####1000"), c["answer"], grader="chain") == 0.0
        assert len(split_steps(c["solution"], task="chain")) == 4  # one step per operation; "####N" joins the last
    assert make_chain(1, seed=0, ops=4, max_number=20)[0] == {"question": "3 -2 +17 *2 +11", "answer": "47",
                                                              "solution": "3-2=1\n1+17=18\n18*2=36\n36+11=47\n####47"}


def test_chain_filler_lines_grow_the_horizon_not_the_arithmetic():
    """--chain-filler F: F lines "~x" (x a uniform tag) dealt round-robin after the operation lines; the same
    problems and answers, graded the same; every line a step; F = 0 is the plain chain."""
    from data import FILLER_TAGS
    plain = make_chain(200, seed=3, ops=4, max_number=20)
    assert make_chain(200, seed=3, ops=4, max_number=20, filler=0) == plain
    for filler in (1, 4, 8):
        filled = make_chain(200, seed=3, ops=4, max_number=20, filler=filler)
        tags = []
        for p, f in zip(plain, filled):
            lines = f["solution"].split("\n")
            fill = [line for line in lines if line.startswith("~")]
            assert (f["question"], f["answer"]) == (p["question"], p["answer"]) and len(fill) == filler
            assert [line for line in lines if not line.startswith("~")] == p["solution"].split("\n")
            assert lines[1].startswith("~") and all(len(line) == 2 and line[1] in FILLER_TAGS for line in fill)
            assert grade(f["solution"], f["answer"], grader="chain") == 1.0
            assert len(split_steps(f["solution"], task="chain")) == 4 + filler  # a step per line; "####" joins
            tags += [line[1] for line in fill]
        assert set(tags) == set(FILLER_TAGS)  # the free choice varies
    for filler, kinds in ((8, "o~~o~~o~~o~~#"), (5, "o~~o~o~o~#")):  # round-robin over the gaps, the first first
        lines = make_chain(1, seed=0, ops=4, max_number=20, filler=filler)[0]["solution"].split("\n")
        assert "".join("~" if x.startswith("~") else "#" if x.startswith("#") else "o" for x in lines) == kinds
    train = load_split("chain", "train", arith_ops=4, chain_filler=2)
    assert train[0]["where"] == "--dataset chain --arith-ops 4 --chain-filler 2: train problem 1"


def test_chain_splits_are_disjoint_and_the_prompt_is_plain():
    train, test = load_split("chain", "train", arith_ops=4), load_split("chain", "test", arith_ops=4)
    assert len(test) == 500 and not {e["question"] for e in test} & {e["question"] for e in train}
    from data import make_prompt
    assert make_prompt("13 *3 -3", grader="chain", tokenizer=None, prompt_format="plain") == "13 *3 -3\n"


def test_the_character_tokenizer_round_trips_every_character_of_the_task(tmp_path):
    from transformers import AutoTokenizer
    examples = load_split("chain", "train", arith_ops=4) + load_split("chain", "test", arith_ops=4)
    chars = task_chars(examples)
    assert set(chars) == set("0123456789+-*=# \n")
    char_tokenizer(chars).save_pretrained(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)  # a real transformers tokenizer, from its folder
    assert tokenizer.eos_token == "<eos>" and tokenizer.pad_token == "<pad>" and tokenizer.pad_token_id != tokenizer.eos_token_id
    assert len(tokenizer) == len(chars) + 3
    for text in [chars, *(e["question"] + "\n" + e["solution"] for e in examples[:200])]:
        ids = tokenizer(text, add_special_tokens=False).input_ids
        assert len(ids) == len(text) and tokenizer.decode(ids) == text  # one token per character, no spaces added
        assert tokenizer.decode(ids + [tokenizer.eos_token_id], skip_special_tokens=True) == text
    assert tokenizer("a", add_special_tokens=False).input_ids == [tokenizer.unk_token_id]


def test_a_scratch_model_is_an_ordinary_hf_folder(tmp_path):
    from transformers import AutoModelForCausalLM
    folder = new_scratch_model(tmp_path / "m", chars="0123456789+-*=# \n", layers=2, width=32, heads=2, seed=1)
    model = AutoModelForCausalLM.from_pretrained(folder)
    again = AutoModelForCausalLM.from_pretrained(new_scratch_model(tmp_path / "n", chars="0123456789+-*=# \n",
                                                                   layers=2, width=32, heads=2, seed=1))
    other = new_scratch_model(tmp_path / "o", chars="0123456789+-*=# \n", layers=2, width=32, heads=2, seed=2)
    assert model.config.model_type == "llama" and model.config.tie_word_embeddings
    assert model.generation_config.eos_token_id == 1 and model.config.vocab_size == 20
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), again.parameters()))  # the seed decides
    assert not torch.equal(model.model.embed_tokens.weight,
                           AutoModelForCausalLM.from_pretrained(other).model.embed_tokens.weight)


def test_half_cosine_tells_agreeing_halves_from_unrelated_ones():
    g = torch.randn(1000)
    assert half_cosine(g, 2 * g) == pytest.approx(1.0, abs=1e-6)  # the second half equals the first
    assert half_cosine(g, torch.zeros(1000)) == pytest.approx(-1.0, abs=1e-6)  # opposite halves
    torch.manual_seed(0)
    a, b = torch.randn(100_000), torch.randn(100_000)
    assert abs(half_cosine(a, a + b)) < 0.02  # independent noise


@pytest.mark.parametrize("argv, message", [
    (["train.py", "--threads", "-1"], "--threads must be 0 (torch's default) or above (got -1)"),
    (["sft.py", "--threads", "-2"], "--threads must be 0 (torch's default) or above (got -2)"),
    (["sft.py", "--model", "scratch", "--prompt-format", "plain", "--scratch-width", "130", "--scratch-heads", "4"],
     "--scratch-width (130) must be an even multiple of --scratch-heads (4): each head's width is even (RoPE)"),
    (["sft.py", "--model", "scratch", "--scratch-layers", "0", "--prompt-format", "plain"],
     "--scratch-layers must be at least 1 (got 0)"),
    (["sft.py", "--model", "scratch"], "--model scratch has no chat template: pass --prompt-format plain (or sft)"),
])
def test_new_flags_bad_values_are_one_line(argv, message, capsys):
    if argv[0] == "train.py":
        from config import parse_config as parse
    else:
        from sft import parse_sft_config as parse
    with pytest.raises(SystemExit):
        parse(["--device", "cpu", *argv[1:]])
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(f"error: {message}")


def test_a_data_file_that_is_not_utf8_is_one_line_naming_file_and_line(tmp_path):
    rows = b'{"question": "1 +1", "answer": "2"}\n{"question": "caf\xe9", "answer": "3"}\n'
    for split in ("train", "test"):
        (tmp_path / f"{split}.jsonl").write_bytes(rows)
    with pytest.raises(SystemExit, match=rf"^error: {tmp_path}/train.jsonl:2: not UTF-8 text \(byte 0xe9 at column 18\)$"):
        load_split(str(tmp_path), "train")
    run = subprocess.run([sys.executable, "train.py", "--device", "cpu", "--dataset", str(tmp_path)], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "Traceback" not in run.stderr
    assert run.stderr.strip().splitlines()[-1].endswith(f"{tmp_path}/train.jsonl:2: not UTF-8 text (byte 0xe9 at column 18)")


def test_testbed_flags_bad_values_are_one_line(tmp_path):
    for args, message in ((["--jobs", "0"], "error: --jobs must be at least 1 (got 0)"),
                          (["--seeds", "0,x"], "error: --seeds: expected comma-separated non-negative integers, got '0,x'"),
                          (["--estimators", "ppo"], "error: --estimators: unknown ['ppo']")):
        run = subprocess.run([sys.executable, "-m", "scripts.testbed", "--out", str(tmp_path), *args], cwd=REPO,
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 1 and run.stderr.strip().startswith(message) and len(run.stderr.strip().splitlines()) == 1
    run = subprocess.run([sys.executable, "-m", "research.free_samples.free_samples", "--out", str(tmp_path), "--values",
                          "--prompts", "0"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and run.stderr.strip() == "error: --prompts must be at least 1 (got 0)"


@pytest.mark.slow  # end to end, ~2 minutes on 2 cores
def test_scratch_sft_then_every_estimator_trains_from_it(tmp_path):
    """sft.py --model scratch builds, trains and saves a tiny model; train.py then runs two iterations of each
    estimator from that folder (its policy, reference, sampler and checkpoint) as processes of their own: vine, its
    free samples, the separate critic, grpo and its fresh responses (every other arm, in process: the golden test);
    the last is resumed."""
    env_args = dict(cwd=REPO, capture_output=True, text=True, timeout=600)
    task = ["--dataset", "chain", "--arith-ops", "2", "--prompt-format", "plain", "--threads", "1",
            "--max-new-tokens", "32", "--device", "cpu"]
    sft = tmp_path / "sft"
    run = subprocess.run([sys.executable, "sft.py", *task, "--model", "scratch", "--scratch-layers", "2",
                          "--scratch-width", "32", "--scratch-heads", "2", "--max-steps", "3", "--batch-size", "8",
                          "--micro-batch-size", "8", "--lr", "3e-3", "--eval-size", "4", "--eval-samples", "1",
                          "--out-dir", str(sft)], **env_args)
    assert run.returncode == 0, run.stderr[-2000:]
    assert (sft / "config.json").exists() and (sft / "tokenizer.json").exists()
    for name, flags in (("vine", ["--estimator", "vine", "--k", "2"]),  # the other arms' numbers: tests/test_golden.py
                        ("free", ["--estimator", "vine", "--k", "2", "--free-samples", "topup"]),
                        ("critic", ["--estimator", "critic"]), ("grpo", ["--estimator", "grpo"]),
                        ("resample", ["--estimator", "grpo", "--resample-silent", "2"])):
        out = tmp_path / name
        cmd = [sys.executable, "train.py", *task, "--model", str(sft), *flags, "--iterations", "2",
               "--prompts-per-iter", "2", "--samples-per-prompt", "2", "--minibatch-size", "4", "--micro-batch-size",
               "2", "--eval-size", "4", "--eval-samples", "1", "--eval-every", "2", "--out-dir", str(out)]
        run = subprocess.run(cmd, **env_args)
        assert run.returncode == 0, (name, run.stderr[-2000:])
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert [r["iteration"] for r in records] == [0, 1, 2] and "eval_accuracy" in records[-1]
        assert "grad_cosine" in records[1] and -1 <= records[1]["grad_cosine"] <= 1  # two micro-batches a step
        if flags[1] == "vine":
            assert records[1]["steps_per_response"] >= 1 and abs(records[1]["ratio"] - 1) < 0.1  # old log-probs right
        if name == "free":  # the prompt state alone is passed through by both responses: one free sample there
            assert records[1]["free_per_state"] >= 1 / records[1]["value_states"] and records[1]["vines"] < 2 * \
                records[1]["value_states"]
        if name == "resample":  # silent groups grew by 2 fresh responses each; the update kept grpo's steps
            grpo = json.loads((tmp_path / "grpo" / "metrics.jsonl").read_text().splitlines()[1])
            r = records[1]  # every response counted: the 4 and 2 more for each silent group
            assert r["sampled_tokens"] == pytest.approx(r["response_length"] * (4 + 2 * r["resampled_groups"]))
            assert 0 <= r["resampled_groups"] <= 2 and r["optimizer_steps"] == grpo["optimizer_steps"]
            sampling = r["seconds_rollout"] + r["seconds_resample"] + r["seconds_values"]  # the fresh ones timed too
            assert r["tokens_per_s"] == pytest.approx(r["sampled_tokens"] / sampling)
        assert json.loads((out / "start.json").read_text())["model_sha256"] == json.loads(
            (tmp_path / "vine" / "start.json").read_text())["model_sha256"]  # every run records the same start
        assert (out / "latest").exists()
    again = subprocess.run(cmd[:cmd.index("--iterations") + 1] + ["3"] + cmd[cmd.index("--iterations") + 2:]
                           + ["--resume"], **env_args)
    assert again.returncode == 0, again.stderr[-2000:]
    assert json.loads((tmp_path / "resample" / "metrics.jsonl").read_text().splitlines()[-1])["iteration"] == 3


def finished_run(run_dir, *, start: str | None):
    """A run folder whose metrics end with the last iteration's evaluation, started from `start` (None: unrecorded)."""
    from research.grid import ITERATIONS
    run_dir.mkdir(parents=True)
    records = [{"iteration": i, "eval_accuracy": 0.5 + i / 100, "eval_se": 0.02, "reward_mean": 0.5, "kl_ref": 0.0,
                "train_seconds": 10.0 * i, "seconds": 10.0} for i in range(ITERATIONS + 1)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if start:
        (run_dir / "start.json").write_text(json.dumps({"model_sha256": start}) + "\n")


def test_a_grid_never_reuses_runs_made_from_another_sft_model(tmp_path, monkeypatch):
    """run_state tells a finished run of this SFT model from one of another (or of none recorded); run_cells refuses
    a folder holding the latter in one line before running anything, and the summary leaves it out."""
    from research import grid
    from research.summary import summary
    sft = tmp_path / "sft"
    sft.mkdir()
    (sft / "model.sha256").write_text("a" * 64 + "\n")
    finished_run(tmp_path / "vine-s0", start="a" * 64)
    finished_run(tmp_path / "grpo-s0", start="b" * 64)
    finished_run(tmp_path / "rloo-s0", start=None)
    assert grid.run_state(tmp_path / "vine-s0", start="a" * 64) == "done"
    assert grid.run_state(tmp_path / "grpo-s0", start="a" * 64) == "other start"
    assert grid.run_state(tmp_path / "rloo-s0", start="a" * 64) == "other start"
    monkeypatch.setattr(grid.subprocess, "Popen", lambda *a, **k: pytest.fail("nothing may run"))
    assert grid.run_cells([("vine", 0)], out=tmp_path, sft_dir=sft, extra=[], jobs=1, machine={}) == []
    with pytest.raises(SystemExit, match=r"^error: .*: grpo-s0, rloo-s0 started from another model than .*sft "
                                         r"\(sha256 aaaaaaaaaaaa; see their start.json\)"):
        grid.run_cells([("vine", 0), ("grpo", 0), ("rloo", 0)], out=tmp_path, sft_dir=sft, extra=[], jobs=1,
                          machine={})
    monkeypatch.undo()  # matplotlib's font cache runs a subprocess
    text, mine = summary(tmp_path, started=None, extra=[], ran=["vine-s0"])
    assert "Left out, made from another SFT model: grpo-s0, rloo-s0." in text and "| vine | 1 |" in text
    assert "| grpo |" not in text and "± 0.000" not in text  # one seed: no "± 0.000" as an SE
    assert mine.splitlines()[4] == "| vine-s0 | 0.500 | 0.800 | +0.300 ± 0.020 | 5.2 | 10.0 |"
    assert "Reference grid (research/testbed/results/testbed, 5 seeds" in mine and "another SFT model (fbaef8613d93" in mine


def test_the_grids_write_outside_git_by_default():
    """README's commands leave `git status` clean: the grids' default folders are under runs/, which .gitignore lists."""
    from research.branching import branching
    from scripts import testbed
    assert testbed.OUT == "runs/testbed" and branching.OUT == "runs/branching" and branching.TESTBED == testbed.OUT
    assert "runs/" in (REPO / ".gitignore").read_text().splitlines()


def test_machine_json_keeps_the_first_machine_and_appends_each_resume(tmp_path):
    """A run's machine.json names the machine it started on; a resume appends its own (with the checkpoint it went on
    from) instead of overwriting it, and a block's machine is still the first run's."""
    from research.grid import record_machine
    from research.replication.replicate import seed_machine
    run = tmp_path / "vine-s0"
    run.mkdir()
    record_machine(run, {"cpu": "AMD EPYC", "jobs": 2}, resuming=False)
    (run / "latest").write_text("ckpt-000024")
    record_machine(run, {"cpu": "Xeon", "jobs": 1}, resuming=True)
    saved = json.loads((run / "machine.json").read_text())
    assert saved["cpu"] == "AMD EPYC" and saved["jobs"] == 2
    assert saved["resumes"] == [{"cpu": "Xeon", "jobs": 1, "from": "ckpt-000024"}]
    assert seed_machine(tmp_path, 0) == {"cpu": "AMD EPYC", "jobs": 2}
    record_machine(run, {"cpu": "Xeon", "jobs": 1}, resuming=False)  # a fresh start replaces it all
    assert json.loads((run / "machine.json").read_text()) == {"cpu": "Xeon", "jobs": 1}


def test_paper_regime_lift_summary_says_lifted_only_above_two_se(tmp_path):
    """research.paper_regime.paper_regime --lift --redraw: per task and arm, the mean over seeds of (mean pass@1 over iterations
    3-30 − the run's iteration 0), and 'yes' only where that exceeds 2 SE; runs from another start are not counted."""
    from research.paper_regime.paper_regime import lift
    digest = "ab" * 32
    gains = {"grpo-lr5e-5": [0.05, 0.06, 0.07], "vine-lr5e-5": [0.05, -0.04, 0.01]}
    for task in ("easy", "hard"):
        (tmp_path / task / "sft").mkdir(parents=True)
        (tmp_path / task / "sft" / "model.sha256").write_text(digest + "\n")
        for arm, per_seed in gains.items():
            for seed, gain in enumerate(per_seed):
                run = tmp_path / task / "lift" / f"{arm}-s{seed}"
                run.mkdir(parents=True)
                (run / "start.json").write_text(json.dumps({"model_sha256": digest}))
                records = [{"iteration": i, "eval_accuracy": 0.5 + (gain if i else 0.0)} for i in range(0, 31, 3)]
                (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    other = tmp_path / "hard" / "lift" / "grpo-lr2e-4-s0"
    other.mkdir()
    (other / "start.json").write_text(json.dumps({"model_sha256": "cd" * 32}))
    (other / "metrics.jsonl").write_text("".join(json.dumps({"iteration": i, "eval_accuracy": 0.9}) + "\n"
                                                 for i in range(0, 31, 3)))
    rows = [line.split(" | ") for line in lift(tmp_path, seeds=[0], jobs=1, redraw=True).splitlines()[2:]]
    assert [(r[0], r[1], r[2], r[4], r[-1]) for r in rows] == [
        ("| easy", "grpo-lr5e-5", "3", "+0.060 ± 0.006", "yes |"), ("| easy", "vine-lr5e-5", "3", "+0.007 ± 0.026", "no |"),
        ("| hard", "grpo-lr5e-5", "3", "+0.060 ± 0.006", "yes |"), ("| hard", "vine-lr5e-5", "3", "+0.007 ± 0.026", "no |")]


def test_the_one_command_runs_the_default_arms_each_beside_a_committed_reference():
    """`python -m scripts.testbed` with no flags runs DEFAULT (vine, vine-free, the separate critic, grpo, rloo: the
    vine-adaptive arm left its default list to keep the command near 20 minutes); every one of them has a committed
    5-seed grid from the same SFT recipe among REFERENCES to be placed beside."""
    import argparse
    from research.summary import REFERENCES
    from scripts import testbed
    parser = argparse.ArgumentParser()
    testbed.grid_arguments(parser, arm="estimator", arms=testbed.ARMS, out=testbed.OUT, default=testbed.DEFAULT)
    assert parser.parse_args([]).estimators == "vine,vine-free,critic-separate,grpo,rloo"
    summaries = {ref: json.loads((REPO / ref / "results.json").read_text()) for ref in REFERENCES}
    for arm in testbed.DEFAULT:
        assert any(summary["summary"].get(arm, {}).get("seeds") == 5 for summary in summaries.values()), arm
    # the same SFT recipe (its weights differ between CPUs: the invocation table says which start each grid had)
    assert all(summary["sft"] == testbed.SFT_SETTINGS for summary in summaries.values())
