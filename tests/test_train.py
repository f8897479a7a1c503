"""Config parsing, and the smoke run: train.py on the real SmolLM2 and the shipped GSM8K rows, checkpoint, resume,
Ctrl-C."""
import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from conftest import REPO
from config import Config, parse_config
from ppo import lr_factor
from runlog import mark_crossed


def test_config_defaults_and_derived_values():
    cfg = parse_config(["--dataset", "math", "--device", "cpu"])
    assert (cfg.k, cfg.temperature, cfg.top_p, cfg.gamma, cfg.lam, cfg.clip, cfg.kl_coef, cfg.lr, cfg.epochs) == (
        9, 0.6, 0.9, 1.0, 0.0, 0.2, 1e-4, 1e-6, 2)
    assert (cfg.prompts_per_iter, cfg.samples_per_prompt, cfg.max_new_tokens) == (4, 4, 192)  # CPU sizes
    assert cfg.iterations == 1000 and cfg.max_value_steps == 0 and cfg.out_dir == "runs/math-vine-k9-s0"
    assert parse_config(["--device", "cpu"]).max_value_steps == 25
    assert parse_config(["--no-whiten", "--k", "3"]).whiten is False


@pytest.mark.parametrize("argv", [["--k", "0"], ["--step-split", "lines"], ["--step-split", "lowprob:1.5"],
                                  ["--step-split", "entropy:x"], ["--step-split", "entropy"], ["--step-split", "tokens:0"],
                                  ["--dataset", "svamp"], ["--iterations", "x"],
                                  ["--tis-cap", "0.5"], ["--dtype", "float16"], ["--k-ci", "0"],
                                  ["--eval-every-seconds", "-1"], ["--k-mode", "sometimes"], ["--k-round", "0"],
                                  ["--k-max", "0"]])
def test_bad_flags_are_one_line_errors(argv, capsys):
    with pytest.raises(SystemExit):
        parse_config(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("train.py: error:") or "error:" in err[-1]


def test_lr_schedule():
    assert [round(lr_factor(s, warmup=2, total=6), 3) for s in range(7)] == [0.5, 1.0, 1.0, 0.75, 0.5, 0.25, 0.0]
    assert [lr_factor(s, warmup=2, total=6, decay=False) for s in range(7)] == [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    # warmup-stable-decay: constant until the last 2 steps; a floor: the decay ends at 0.2, not 0
    assert [lr_factor(s, warmup=2, total=6, decay_steps=2) for s in range(7)] == [0.5, 1.0, 1.0, 1.0, 1.0, 0.5, 0.0]
    assert [round(lr_factor(s, warmup=2, total=6, floor=0.2), 3) for s in range(7)] == [0.5, 1.0, 1.0, 0.8, 0.6,
                                                                                         0.4, 0.2]


def test_evaluation_on_the_clock():
    assert [mark_crossed(a, b, every=120) for a, b in ((0, 119.9), (100, 120), (119, 250), (120, 121), (359, 361))] == \
        [False, True, True, False, True]
    assert not mark_crossed(0, 1e9, every=0)  # off


def run_train(args, out_dir, **kwargs):
    cmd = [sys.executable, "train.py", "--dataset", "gsm8k", "--k", "2", "--prompts-per-iter", "2",
           "--samples-per-prompt", "2", "--max-new-tokens", "24", "--eval-size", "2", "--eval-samples", "1",
           "--out-dir", str(out_dir), "--sampler", "hf", *args]
    return subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1"}, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **kwargs)


@pytest.mark.slow  # end to end: real train.py / torchrun processes
def test_smoke_train_checkpoint_resume(tmp_path, smol_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    out = tmp_path / "OUT"
    proc = run_train(["--iterations", "1", "--eval-every", "1", "--track", "tensorboard"], out)
    log = proc.communicate(timeout=600)[0]
    assert proc.returncode == 0, log
    assert "iteration 1/1 (100.0%) elapsed" in log and "s/it, ETA 0s" in log  # the progress line
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [0, 1] and "eval_accuracy" in records[0]
    assert records[0]["seconds_eval"] > 0 and records[0]["mem_gb_eval"] > 0.3  # the first evaluation is measured
    assert records[1]["mem_gb"] == max(records[1][f"mem_gb_{k}"] for k in ("rollout", "values", "ppo", "sync", "eval"))
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(out / "tb"), size_guidance={"scalars": 0, "tensors": 0}).Reload()
    assert [e.step for e in events.Scalars("eval_accuracy")] == [0, 1]
    assert [e.value for e in events.Scalars("eval_accuracy")] == pytest.approx([r["eval_accuracy"] for r in records])
    assert [e.value for e in events.Scalars("kl_ref")] == pytest.approx([records[1]["kl_ref"]])
    texts = {tag: events.Tensors(tag)[0].tensor_proto.string_val[0].decode() for tag in events.Tags()["tensors"]}
    assert "--k 2" in texts["config/text_summary"] and "[A " in texts["responses/0/text_summary"]
    first = records[1]
    for key in ("reward_mean", "value_mean", "advantage_std", "approx_kl", "clipfrac", "entropy", "kl_ref",
                "value_states", "vines", "vine_tokens", "tokens_per_s", "seconds_rollout", "seconds_values",
                "seconds_ppo", "eval_accuracy", "mismatch_abs_logp", "mismatch_kl", "mismatch_ratio_out"):
        assert key in first, key
    assert first["vines"] == 2 * first["value_states"] and first["optimizer_steps"] >= 1
    trained = AutoModelForCausalLM.from_pretrained(out / "ckpt-000001")  # a plain HF checkpoint
    assert torch.isfinite(trained(torch.tensor([[1, 2, 3]])).logits).all()
    saved = load_file(out / "ckpt-000001" / "model.safetensors")
    assert {t.dtype for t in saved.values()} == {torch.float32}  # the master weights, whatever --dtype computes in
    state = torch.load(out / "ckpt-000001" / "trainer_state.pt", weights_only=False)
    steps = {int(s["step"]) for s in state["optimizer"]["state"].values()}
    assert state["iteration"] == 1 and steps == {first["optimizer_steps"]}  # the optimizer really stepped

    # resumed with an evaluation every millisecond of training: iteration 2 is evaluated on the clock alone
    proc = run_train(["--iterations", "3", "--eval-every", "5", "--eval-every-seconds", "0.001", "--resume"], out)
    log = proc.communicate(timeout=600)[0]
    assert proc.returncode == 0 and "resumed from" in log, log
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [0, 1, 2, 3]
    assert "eval_accuracy" in records[2] and "eval_accuracy" in records[3]  # on the clock; after the last
    assert (out / "latest").read_text() == "ckpt-000003" and not (out / "ckpt-000001").exists()


def test_a_failed_start_writes_nothing(tmp_path):
    """No data (the Hub asked for, offline): a one-line error, and the out-dir is not created."""
    out = tmp_path / "runs" / "OUT"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VINEPPO_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "train.py", "--dataset", "gsm8k", "--data-dir", "hub", "--out-dir", str(out)],
                          cwd=REPO, env=env, text=True, capture_output=True, timeout=120)
    assert proc.returncode != 0 and proc.stderr.strip().splitlines()[-1].startswith(
        "error: gsm8k/train: --data-dir hub, but the Hugging Face Hub is unreachable")
    assert "Traceback" not in proc.stderr and not out.exists() and not out.parent.exists()


@pytest.mark.slow  # end to end: real train.py / torchrun processes
def test_ctrl_c_saves_a_checkpoint(tmp_path, smol_path):
    out = tmp_path / "OUT"
    proc = run_train(["--iterations", "5", "--eval-every", "5"], out)
    for line in proc.stdout:
        if line.startswith("iteration 0:"):  # the first evaluation is done; the first iteration is starting
            proc.send_signal(signal.SIGINT)
            break
    log = proc.communicate(timeout=300)[0]
    assert proc.returncode == 130, log
    assert (out / "latest").read_text() == "ckpt-000000" and (out / "ckpt-000000" / "model.safetensors").exists()


@pytest.mark.slow  # end to end: a real train.py process
def test_the_separate_critic_runs_in_the_same_loop_under_a_time_budget(tmp_path, scratch):
    """One iteration of the paper's PPO baseline (the separate critic: a second copy of the start model) in train.py's
    loop, stopped by --time-budget, its critic checkpointed (the value head in safetensors). The tiny scratch model:
    grpo, rloo and every other arm's numbers are the golden test's; the real model end to end, the smoke test."""
    out = tmp_path / "critic"
    cmd = [sys.executable, "train.py", *scratch, "--estimator", "critic", "--iterations", "3",
           "--prompts-per-iter", "2", "--samples-per-prompt", "2", "--max-new-tokens", "32", "--eval-size", "2",
           "--eval-samples", "1", "--out-dir", str(out), "--sampler", "hf", "--time-budget", "0.01"]
    proc = subprocess.run(cmd, cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1"}, text=True, capture_output=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "time budget of 0s reached after 1 iterations" in proc.stdout  # of --iterations 3
    record = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][-1]
    assert "vines" not in record and record["optimizer_steps"] >= 1 and "value_loss" in record
    assert (out / "ckpt-000001" / "critic" / "value_head.safetensors").exists()  # the separate critic's own folder


FOLDER_ROWS = {"number": [("Tom has 3 apples and buys 4 more. How many apples does he have?", "7"),
                          ("A box holds 12 pens. How many pens are in 2 boxes?", "24"),
                          ("Sam had 10 coins and lost 4. How many coins are left?", "6")],
               "math": [("What is $\\frac{1}{2} + \\frac{1}{4}$?", "\\frac{3}{4}"),
                        ("Solve $2x = 6$ for $x$.", "3"),
                        ("Simplify $\\sqrt{8}$.", "2\\sqrt{2}")]}


@pytest.mark.slow  # a real train.py run, ~20 s on 2 idle cores
@pytest.mark.parametrize("grader", ["math"])  # a folder of numbers: --grader auto's choice, tests/test_config.py
def test_one_iteration_on_a_folder_data_set(tmp_path, smol_path, grader):
    """--dataset FOLDER (hand-made train.jsonl / test.jsonl) of math answers: one VinePPO iteration, evaluated and
    checkpointed, under runs/<folder name>-...; --grader auto picks the grader from the answers (a folder of numbers
    gets the number grader: tests/test_config.py)."""
    folder = tmp_path / f"my-{grader}"
    folder.mkdir()
    for split, rows in (("train", FOLDER_ROWS[grader]), ("test", FOLDER_ROWS[grader][:2])):
        (folder / f"{split}.jsonl").write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in rows))
    cmd = [sys.executable, str(REPO / "train.py"), "--dataset", str(folder), "--iterations", "1", "--k", "2",
           "--prompts-per-iter", "1", "--samples-per-prompt", "2", "--max-new-tokens", "16", "--eval-size", "1",
           "--eval-samples", "1", "--epochs", "1", "--sampler", "hf"]
    proc = subprocess.run(cmd, cwd=tmp_path, env={**os.environ, "HF_HUB_OFFLINE": "1"},
                          text=True, capture_output=True, timeout=600)  # cwd: the default out-dir lands in tmp_path
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = tmp_path / "runs" / f"my-{grader}-vine-k2-s0"  # named after the folder
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [0, 1] and "eval_accuracy" in records[1]
    assert records[1]["value_states"] >= 1 and records[1]["optimizer_steps"] >= 1
    state = torch.load(out / "ckpt-000001" / "trainer_state.pt", weights_only=False)
    assert (state["config"]["task"], state["config"]["grader"]) == ("custom", grader)


def test_help_shows_every_default(capsys):
    import dataclasses
    with pytest.raises(SystemExit):
        parse_config(["--help"])
    out = " ".join(capsys.readouterr().out.split())  # unwrapped
    assert out.count("(default:") >= sum(f.default is not None for f in dataclasses.fields(Config))
    assert "batch (default: True)" in out and "(default: 0.6)" in out  # --whiten, --temperature
    assert "runs/<dataset>-<estimator>-k<K>-s<seed>" in out and "not transformers'" in out
