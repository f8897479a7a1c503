"""sft.py: the loss (masking, per-instance mean, padding-invariance), the step order, flag checks, and one smoke run
with the real model whose output folder transformers loads and train.py starts from."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from model import load_tokenizer
from sft import parse_sft_config, sft_loss, sft_target, step_examples

REPO = Path(__file__).resolve().parent.parent


def test_loss_ignores_masked_tokens():
    logprobs = torch.tensor([[-1.0, -3.0, -50.0]])  # the last position is padding (or prompt): huge, but masked
    mask = torch.tensor([[1, 1, 0]])
    assert sft_loss(logprobs=logprobs, mask=mask).item() == pytest.approx(2.0)


def test_loss_is_per_instance_mean_then_batch_mean():
    # a short instance (1 token, NLL 4) and a long one (4 tokens, NLL 1 each) weigh the same: (4 + 1) / 2
    logprobs = torch.tensor([[-4.0, 0.0, 0.0, 0.0], [-1.0, -1.0, -1.0, -1.0]])
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 1]])
    assert sft_loss(logprobs=logprobs, mask=mask).item() == pytest.approx(2.5)  # a token mean would give 8 / 5


def test_loss_is_padding_invariant_and_skips_empty_rows():
    row = torch.tensor([[-0.5, -1.5]])
    padded = torch.cat([row, torch.full((1, 5), -9.0)], dim=1)  # the same instance padded by 5 more positions
    mask, padded_mask = torch.ones(1, 2), torch.cat([torch.ones(1, 2), torch.zeros(1, 5)], dim=1)
    assert sft_loss(logprobs=padded, mask=padded_mask).item() == pytest.approx(
        sft_loss(logprobs=row, mask=mask).item())
    with_empty = torch.cat([padded, torch.full((1, 7), -9.0)])  # a row with no target token is left out
    assert sft_loss(logprobs=with_empty, mask=torch.cat([padded_mask, torch.zeros(1, 7)])).item() == pytest.approx(1.0)


def test_loss_gradient_is_per_instance_mean():
    logprobs = torch.zeros(2, 4, requires_grad=True)
    sft_loss(logprobs=logprobs, mask=torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])).backward()
    assert logprobs.grad.tolist() == [[-0.25, -0.25, 0, 0], [-0.125] * 4]  # each row: -1 / (2 x its tokens)


def test_step_examples_are_a_permutation_per_epoch_and_repeatable():
    n, bs = 10, 3  # 3 full batches an epoch, one example dropped
    epoch = [i for s in range(3) for i in step_examples(s, n=n, batch_size=bs, seed=0)]
    assert len(set(epoch)) == 9 and step_examples(1, n=n, batch_size=bs, seed=0) == epoch[3:6]
    assert step_examples(3, n=n, batch_size=bs, seed=0) != epoch[:3]  # the next epoch is shuffled afresh


def test_targets_drop_calculator_annotations_and_follow_the_prompt_format(smol_path):
    """GSM8K's <<a=b>> annotations are not in the target (the official SFT data has them removed); after the paper's
    "Solution:" the target starts on a new line and ends with one, then EOS; the chat format adds no newline."""
    tokenizer = load_tokenizer(smol_path)
    example = {"solution": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72"}
    chat = sft_target(example, tokenizer=tokenizer, prompt_format="chat")
    paper = sft_target(example, tokenizer=tokenizer, prompt_format="sft")
    assert chat[-1] == paper[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(chat[:-1]) == "Natalia sold 48/2 = 24 clips in May.\n#### 72"
    assert tokenizer.decode(paper[:-1]) == "\nNatalia sold 48/2 = 24 clips in May.\n#### 72\n"


def test_bad_flags_are_one_line(capsys, monkeypatch):
    for argv, says in ((["--batch-size", "6", "--micro-batch-size", "4"], "multiple of --micro-batch-size"),
                       (["--lr", "0"], "--lr must be above 0"), (["--dataset", "nope"], "--dataset nope"),
                       (["--resume", "--overwrite"], "contradict")):
        with pytest.raises(SystemExit):
            parse_sft_config(argv + ["--device", "cpu"])
        assert says in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "2")  # under torchrun --batch-size is global: each rank needs whole micro-batches
    with pytest.raises(SystemExit):
        parse_sft_config(["--batch-size", "4", "--micro-batch-size", "4", "--device", "cpu"])
    assert "x the number of ranks (2)" in capsys.readouterr().err
    parse_sft_config(["--batch-size", "8", "--micro-batch-size", "4", "--device", "cpu"])


def test_defaults_on_cpu():
    cfg = parse_sft_config(["--dataset", "arith", "--device", "cpu"])
    assert (cfg.batch_size, cfg.micro_batch_size, cfg.grader, cfg.task, cfg.out_dir) == (
        16, 4, "number", "arith", "runs/sft-arith-s0")


@pytest.mark.slow
def test_smoke_sft_then_train(tmp_path, smol_path):
    from transformers import AutoModelForCausalLM
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    out = tmp_path / "SFT"
    cmd = [sys.executable, "sft.py", "--dataset", "arith", "--max-steps", "2", "--batch-size", "2",
           "--micro-batch-size", "1", "--eval-size", "2", "--eval-samples", "1", "--max-new-tokens", "16",
           "--lr", "5e-5", "--out-dir", str(out)]
    run = subprocess.run(cmd, cwd=REPO, env=env, text=True, capture_output=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "step 2/2 (100.0%)" in run.stdout and "tok/s" in run.stdout and "eval pass@1" in run.stdout
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [0, 1, 2]
    assert "eval_accuracy" in records[0] and "eval_accuracy" in records[2]  # before and after
    assert all(r["loss"] > 0 and r["tokens"] > 0 for r in records[1:])
    assert (out / "latest").read_text() == "ckpt-000002"
    model = AutoModelForCausalLM.from_pretrained(out)
    assert next(model.parameters()).dtype == torch.float32
    base = AutoModelForCausalLM.from_pretrained(smol_path)
    assert not torch.equal(model.lm_head.weight, base.lm_head.weight)  # it was trained
    again = subprocess.run(cmd, cwd=REPO, env=env, text=True, capture_output=True, timeout=60)
    assert again.returncode != 0 and "already holds a run" in again.stderr  # no silent overwrite
    train = subprocess.run([sys.executable, "train.py", "--model", str(out), "--dataset", "arith", "--iterations", "1",
                            "--k", "2", "--prompts-per-iter", "2", "--samples-per-prompt", "2", "--max-new-tokens",
                            "16", "--eval-size", "2", "--eval-samples", "1", "--sampler", "hf",
                            "--out-dir", str(tmp_path / "RL")], cwd=REPO, env=env, text=True, capture_output=True,
                           timeout=600)
    assert train.returncode == 0, train.stdout + train.stderr
    assert "iteration 1/1" in train.stdout


def test_the_validation_split_is_in_neither_train_nor_test():
    from data import load_split
    for dataset in ("arith", "chain"):
        train, test, validation = (load_split(dataset, split, arith_ops=4) for split in ("train", "test", "validation"))
        questions = {e["question"] for e in validation}
        assert len(validation) == 500 and not questions & {e["question"] for e in train + test}
    with pytest.raises(SystemExit, match="unknown split validation of gsm8k"):
        load_split("gsm8k", "validation")


def test_stop_at_a_validation_pass1_ends_the_run_there(tmp_path, monkeypatch, capsys):
    """--stop-at: greedy pass@1 on validation problems every --stop-every steps; the run ends (test evaluation, final
    model) at the first check that reaches it. Its evaluations are stubbed (a scripted validation pass@1), the rest
    (a tiny scratch model's SFT steps, checkpoints, the saved folder) is real."""
    import sft
    seen = []

    def scripted(sampler, tokenizer, examples, cfg, *, seed, keep=None):
        if cfg.eval_temperature == 0 and cfg.eval_samples == 1 and examples[0]["where"].endswith("validation problem 1"):
            seen.append(len(examples))
            return 0.2 * len(seen), 0.02  # 0.2 at step 4, 0.4 at step 8, ...
        return 0.5, 0.02
    monkeypatch.setattr(sft, "evaluate", scripted)
    cfg = parse_sft_config(["--device", "cpu", "--dataset", "chain", "--arith-ops", "2", "--prompt-format", "plain",
                            "--model", "scratch", "--scratch-layers", "1", "--scratch-width", "16", "--scratch-heads",
                            "2", "--max-steps", "20", "--batch-size", "4", "--micro-batch-size", "4", "--lr", "1e-3",
                            "--stop-at", "0.35", "--stop-every", "4", "--stop-size", "7", "--eval-size", "3",
                            "--max-new-tokens", "16", "--threads", "1", "--out-dir", str(tmp_path / "sft")])
    sft.main(cfg)
    records = [json.loads(line) for line in (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()]
    assert seen == [7, 7] and [r["iteration"] for r in records] == list(range(9))  # stopped at step 8, not 20
    assert [r.get("validation_accuracy") for r in records if "validation_accuracy" in r] == [0.2, 0.4]
    assert records[-1]["stopped_at_target"] == 8 and records[-1]["eval_accuracy"] == 0.5
    assert (tmp_path / "sft" / "config.json").exists()
    with pytest.raises(SystemExit):
        parse_sft_config(["--device", "cpu", "--dataset", "gsm8k", "--stop-at", "0.5"])
    assert "--stop-at takes a pass@1 in [0, 1], with --dataset arith or chain only" in capsys.readouterr().err


def test_keep_best_ends_with_the_best_validation_checkpoint(tmp_path, monkeypatch, capsys):
    """--keep-best: validation pass@1 every --stop-every steps and at the last; the final model is the checkpoint of
    the best one (its weights, not the last step's), and a swap of best/ cut off by a kill is finished on the next
    start. Validation is scripted (0.2, 0.6, 0.4, 0.3: best at step 4 of 8); training and saving are real."""
    import sft
    from safetensors.torch import load_file
    scores = iter([0.2, 0.6, 0.4, 0.3])

    def scripted(sampler, tokenizer, examples, cfg, *, seed, keep=None):
        if examples[0]["where"].endswith("validation problem 1"):
            return next(scores), 0.02
        return 0.5, 0.02
    monkeypatch.setattr(sft, "evaluate", scripted)
    last_step, real_load_best = {}, sft.load_best

    def load_best(out_dir, policy):  # the weights of step 7, just before the best replaces them
        last_step.update({k: v.detach().clone() for k, v in policy.state_dict().items()})
        real_load_best(out_dir, policy)
    monkeypatch.setattr(sft, "load_best", load_best)
    out = tmp_path / "sft"
    argv = ["--device", "cpu", "--dataset", "chain", "--arith-ops", "2", "--prompt-format", "plain", "--model",
            "scratch", "--scratch-layers", "1", "--scratch-width", "16", "--scratch-heads", "2", "--max-steps", "7",
            "--batch-size", "4", "--micro-batch-size", "4", "--lr", "1e-2", "--keep-best", "--stop-every", "2",
            "--stop-size", "5", "--eval-size", "3", "--max-new-tokens", "16", "--threads", "1", "--out-dir", str(out)]
    sft.main(parse_sft_config(argv))
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    checked = [(r["iteration"], r["validation_accuracy"]) for r in records if "validation_accuracy" in r]
    assert checked == [(2, 0.2), (4, 0.6), (6, 0.4), (7, 0.3)]  # every 2 steps and the last
    assert records[-1]["best_step"] == 4 and json.loads((out / "best" / "best.json").read_text())["step"] == 4
    final, best = load_file(out / "model.safetensors"), load_file(out / "best" / "model.safetensors")
    assert final.keys() == best.keys() and all(torch.equal(final[k], best[k]) for k in final)
    assert any(not torch.equal(last_step[k], best[k]) for k in best)  # steps 5-7 moved the weights (lr 1e-2)
    (out / "best").rename(out / "best.old")  # a kill between the two renames of swap_best
    assert sft.best_so_far(out, upto=7)["step"] == 4 and (out / "best").exists() and not (out / "best.old").exists()
    with pytest.raises(SystemExit):
        parse_sft_config(["--device", "cpu", "--dataset", "gsm8k", "--keep-best"])
    assert "--keep-best checks the validation split of arith or chain" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_sft_config(["--device", "cpu", "--dataset", "arith", "--chain-bug", "borrow"])
    assert "--chain-bug borrow takes --dataset chain" in capsys.readouterr().err


def test_keep_best_killed_between_the_best_and_its_checkpoint_resumes_without_the_abandoned_best(tmp_path,
                                                                                                  monkeypatch):
    """A kill after a new best is written and before the checkpoint of its step: best/ must not hold a step past the
    checkpoint a resume starts from. The resumed run here replays differently (validation scripted 0.5 at step 4
    where the killed run saw 0.6, as a replay on another CPU kind may): its final model is its own step-4 best, not
    the abandoned run's."""
    import sft
    scores = {"killed": iter([0.2, 0.6]), "resumed": iter([0.5, 0.4, 0.3])}
    phase = ["killed"]

    def scripted(sampler, tokenizer, examples, cfg, *, seed, keep=None):
        return (next(scores[phase[0]]), 0.02) if examples[0]["where"].endswith("validation problem 1") else (0.5, 0.02)

    class Killed(Exception):
        pass
    real_save = sft.Saver.save

    def save(self):  # SIGKILL, in effect, at the checkpoint of step 4 (the new best's)
        if phase[0] == "killed" and self.completed == 4:
            raise Killed
        real_save(self)
    monkeypatch.setattr(sft, "evaluate", scripted)
    monkeypatch.setattr(sft.Saver, "save", save)
    out = tmp_path / "sft"
    argv = ["--device", "cpu", "--dataset", "chain", "--arith-ops", "2", "--prompt-format", "plain", "--model",
            "scratch", "--scratch-layers", "1", "--scratch-width", "16", "--scratch-heads", "2", "--max-steps", "7",
            "--batch-size", "4", "--micro-batch-size", "4", "--lr", "1e-2", "--keep-best", "--stop-every", "2",
            "--stop-size", "5", "--eval-size", "3", "--max-new-tokens", "16", "--threads", "1", "--save-every", "100",
            "--out-dir", str(out)]
    with pytest.raises(Killed):
        sft.main(parse_sft_config(argv))
    assert (out / "latest").read_text().split()[0] == "ckpt-000002"
    assert json.loads((out / "best" / "best.json").read_text())["step"] == 2  # never past the checkpoint
    phase[0] = "resumed"
    sft.main(parse_sft_config([*argv, "--resume"]))
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(r["iteration"], r["validation_accuracy"]) for r in records if "validation_accuracy" in r] == [
        (2, 0.2), (4, 0.5), (6, 0.4), (7, 0.3)]
    assert json.loads((out / "best" / "best.json").read_text()) == {"step": 4, "validation_accuracy": 0.5}
    assert records[-1]["best_step"] == 4 and not (out / ".tmp-best").exists()


def test_resume_refuses_a_changed_run_defining_flag_and_names_it(tmp_path, capsys):
    """A tiny scratch SFT of 2 steps, then --resume with another --seed and --max-length (run-defining) and another
    --lr (free to change): refused in one line naming both defining flags, the run left as it was."""
    import sft
    base = ["--device", "cpu", "--dataset", "chain", "--arith-ops", "1", "--prompt-format", "plain", "--model",
            "scratch", "--scratch-layers", "1", "--scratch-width", "16", "--scratch-heads", "2", "--batch-size", "4",
            "--micro-batch-size", "4", "--eval-size", "2", "--eval-samples", "1", "--max-new-tokens", "8", "--threads",
            "1", "--out-dir", str(tmp_path / "sft")]
    sft.main(parse_sft_config([*base, "--max-steps", "2"]))
    before = (tmp_path / "sft" / "metrics.jsonl").read_text()
    with pytest.raises(SystemExit) as e:
        sft.main(parse_sft_config([*base, "--max-steps", "3", "--resume", "--seed", "1", "--max-length", "512",
                                   "--lr", "1e-3"]))
    message = str(e.value)
    assert "--seed 0 -> 1" in message and "--max-length 1024 -> 512" in message and "--lr" not in message
    assert "\n" not in message.strip() and (tmp_path / "sft" / "metrics.jsonl").read_text() == before
