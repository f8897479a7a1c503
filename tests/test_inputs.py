"""What a model can take, asked before a run writes anything (data.input_problem): the character tokenizer writes
every prompt format it accepts and every task without <unk>; a format, a data row or a length it cannot take is a
one-line error naming it, in train.py and sft.py alike. And each run records the weights it started from
(checkpoint.record_start)."""
import json
import subprocess
import sys

import pytest

from conftest import REPO
from data import input_problem, load_split, make_prompt, prompt_chars, task_chars
from model import char_tokenizer, new_scratch_model

TASKS = {"chain": dict(arith_ops=4), "arith": dict(arith_ops=2), "gsm8k": {}, "math": {}}


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("prompt_format", ["plain", "sft"])
def test_the_character_tokenizer_writes_every_format_and_task_without_unk(task, prompt_format):
    examples = load_split(task, "train", **TASKS[task])[:2000] + load_split(task, "test", **TASKS[task])
    grader = "math" if task == "math" else "number"
    tokenizer = char_tokenizer(task_chars(examples) + prompt_chars(prompt_format, grader=grader))
    for e in examples[:300] + examples[-300:]:
        text = make_prompt(e["question"], grader=grader, tokenizer=tokenizer, prompt_format=prompt_format) + \
            e["solution"] + "\n\n"  # a blank line too: "\n\n" is two tokens, not one <unk>
        ids = tokenizer(text, add_special_tokens=False).input_ids
        assert tokenizer.unk_token_id not in ids and len(ids) == len(text) and tokenizer.decode(ids) == text
    assert input_problem(tokenizer, examples=examples, prompt_format=prompt_format, grader=grader,
                         max_new_tokens=64, max_positions=None) is None
    with pytest.raises(ValueError, match="no chat template"):
        prompt_chars("chat", grader=grader)


def test_what_a_tokenizer_cannot_take_is_one_line_naming_it(tmp_path):
    chain = load_split("chain", "train", arith_ops=4)
    plain = char_tokenizer(task_chars(chain) + prompt_chars("plain", grader="chain"))
    ask = dict(examples=chain, grader="chain", max_new_tokens=64, max_positions=512)
    assert input_problem(plain, prompt_format="plain", **ask) is None
    for fmt in ("sft", "chat"):  # chat falls back to the sft template: a character tokenizer has no chat template
        problem = input_problem(plain, prompt_format=fmt, **ask)
        assert problem.startswith(f"--prompt-format {fmt}: the model's tokenizer cannot write its characters '")
        assert "M" in problem and "\n" not in problem
    rows = [{"question": "1 +1", "answer": "2"}, {"question": "2 +2", "answer": "4"}, {"question": "Ü ≠ 3", "answer": "3"}]
    for split in ("train", "test"):
        (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    folder = load_split(str(tmp_path), "train")
    assert input_problem(plain, prompt_format="plain", **{**ask, "examples": folder}) == (
        f"{tmp_path}/train.jsonl:3: characters the model's tokenizer cannot write (they would be <unk>): 'Ü≠'")
    long = load_split("chain", "test", arith_ops=200)
    problem = input_problem(plain, prompt_format="plain", **{**ask, "examples": long})
    assert problem.startswith("--dataset chain --arith-ops 200: test problem ") and problem.endswith(
        "tokens; with --max-new-tokens 64 that is past the model's 512 positions")


@pytest.mark.slow  # real train.py / sft.py processes
def test_train_and_sft_refuse_what_the_model_cannot_take_before_writing(tmp_path):
    model = new_scratch_model(tmp_path / "m", chars=task_chars(load_split("chain", "train", arith_ops=2))
                              + prompt_chars("plain", grader="chain"), layers=1, width=16, heads=2, seed=0)
    common = ["--device", "cpu", "--dataset", "chain", "--arith-ops", "2", "--model", str(model)]
    for script, flags, message in (
            ("train.py", ["--out-dir", str(tmp_path / "rl")], "--prompt-format chat: the model's tokenizer cannot"),
            ("train.py", ["--prompt-format", "plain", "--max-new-tokens", "600", "--out-dir", str(tmp_path / "rl")],
             "that is past the model's 512 positions"),
            ("sft.py", ["--prompt-format", "sft", "--out-dir", str(tmp_path / "sft")],
             "--prompt-format sft: the model's tokenizer cannot")):
        run = subprocess.run([sys.executable, script, *common, *flags], cwd=REPO, capture_output=True, text=True,
                             timeout=300)
        assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr[-2000:]
        assert run.stderr.strip().startswith("error: ") and message in run.stderr
        assert len(run.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "rl").exists()  # train.py refused before it wrote anything


def test_a_run_records_its_start_and_resumes_only_from_it(tmp_path):
    from checkpoint import record_start, weights_sha256
    chars = "0123456789+-*=#\n"
    a = new_scratch_model(tmp_path / "a", chars=chars, layers=1, width=16, heads=2, seed=0)
    b = new_scratch_model(tmp_path / "b", chars=chars, layers=1, width=16, heads=2, seed=1)
    run = tmp_path / "run"
    record_start(run, model=str(a), folder=str(a), resumed=False)
    start = json.loads((run / "start.json").read_text())
    assert start["model_sha256"] == start["reference_sha256"] == weights_sha256(a) != weights_sha256(b)
    record_start(run, model=str(a), folder=str(a), resumed=True)  # the same weights: fine
    with pytest.raises(SystemExit, match=r"^error: --resume: --model .* is not the model .* started from"):
        record_start(run, model=str(b), folder=str(b), resumed=True)
