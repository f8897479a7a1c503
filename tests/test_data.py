"""Data loading: the shipped copies (checksums, row counts, no network), a temporary folder, a folder data set of
your own, the Hub path; and prompt formatting."""
import gzip
import hashlib
import json
import re
import shutil
import socket

import pytest

import data
from data import SFT_TEMPLATE, load_split, make_prompt


def write_jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))


GSM_ROWS = [{"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
            {"question": "What is 1,000 + 1?", "answer": "1000 + 1 = 1001\n#### 1,001"}]
MATH_ROWS = [{"problem": "What is $1+1$?", "solution": "It is $\\boxed{2}$.", "answer": "2"},
             {"problem": "Simplify $\\frac{2}{4}$.", "solution": "We get $\\boxed{\\frac{1}{2}}$."}]


def test_load_from_folder(tmp_path):
    write_jsonl(tmp_path / "gsm8k" / "train.jsonl", GSM_ROWS)
    write_jsonl(tmp_path / "math" / "test.jsonl", MATH_ROWS)
    gsm = load_split("gsm8k", "train", data_dir=str(tmp_path))
    assert [e["answer"] for e in gsm] == ["7", "1,001"] and gsm[0]["question"] == GSM_ROWS[0]["question"]
    math = load_split("math", "test", data_dir=str(tmp_path))
    assert [e["answer"] for e in math] == ["2", "\\frac{1}{2}"]  # `answer` field, else the last \boxed{}


def test_folder_may_be_the_dataset_folder_itself(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", GSM_ROWS)
    assert len(load_split("gsm8k", "train", data_dir=str(tmp_path))) == 2


def test_env_var_names_the_folder(tmp_path, monkeypatch):
    write_jsonl(tmp_path / "gsm8k" / "test.jsonl", GSM_ROWS)
    monkeypatch.setenv("VINEPPO_DATA_DIR", str(tmp_path))
    assert len(load_split("gsm8k", "test")) == 2


@pytest.mark.parametrize("bad_line, message", [
    ("{not json", "not valid JSON"),
    (json.dumps({"question": "q", "answer": "no final marker"}), "malformed gsm8k row"),
    (json.dumps({"answer": "#### 3"}), "malformed gsm8k row"),
    (json.dumps([1, 2]), "malformed gsm8k row"),
    (json.dumps({"question": "q", "answer": 3}), "malformed gsm8k row"),
])
def test_malformed_line_names_file_and_line(tmp_path, bad_line, message):
    path = tmp_path / "gsm8k" / "train.jsonl"
    write_jsonl(path, GSM_ROWS + [bad_line])
    with pytest.raises(SystemExit) as e:
        load_split("gsm8k", "train", data_dir=str(tmp_path))
    assert f"{path}:3" in str(e.value) and message in str(e.value) and "\n" not in str(e.value)


def test_missing_folder_and_offline_errors(tmp_path, monkeypatch):
    with pytest.raises(SystemExit, match="no gsm8k/test.jsonl there"):
        load_split("gsm8k", "test", data_dir=str(tmp_path / "nowhere"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("VINEPPO_CACHE", str(tmp_path / "cache"))
    with pytest.raises(SystemExit, match="drop --data-dir for the shipped copy"):
        load_split("math", "train", data_dir="hub")
    with pytest.raises(SystemExit, match="not gsm8k, math, arith, chain, nor a folder"):
        load_split("svamp", "train", data_dir=str(tmp_path))


def test_hub_rows_are_cached_for_offline_runs(tmp_path, monkeypatch):
    """The first load from the Hub writes its rows to $VINEPPO_CACHE/data; later loads read them with no network."""
    monkeypatch.setenv("VINEPPO_CACHE", str(tmp_path))
    monkeypatch.setattr(data, "hub_reachable", lambda: True)
    monkeypatch.setattr(data, "hub_rows", lambda dataset, split: [dict(r, extra="dropped") for r in MATH_ROWS])
    first = load_split("math", "test", data_dir="hub")
    assert [e["answer"] for e in first] == ["2", "\\frac{1}{2}"]
    assert json.loads((tmp_path / "data" / "math" / "test.jsonl").read_text().splitlines()[0]) == MATH_ROWS[0]
    monkeypatch.setattr(data, "hub_reachable", lambda: pytest.fail("the cache needs no network"))
    monkeypatch.setenv("VINEPPO_DATA_DIR", "hub")  # the variable may name the Hub too
    assert load_split("math", "test") == first


def test_unreachable_hub_fails_at_once(tmp_path, monkeypatch):
    """A host that refuses the connection: one quick check, no retry storm, a one-line error naming --data-dir."""
    import time
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("VINEPPO_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_ENDPOINT", "https://127.0.0.1")  # nothing listens on 443 here
    started = time.perf_counter()
    with pytest.raises(SystemExit) as e:
        load_split("gsm8k", "train", data_dir="hub")
    assert time.perf_counter() - started < 5
    assert str(e.value).startswith("error: gsm8k/train: --data-dir hub, but the Hugging Face Hub is unreachable") \
        and "--data-dir DIR" in str(e.value) and "\n" not in str(e.value)


def test_empty_split_is_a_one_line_error(tmp_path):
    write_jsonl(tmp_path / "gsm8k" / "train.jsonl", ["", "  "])
    with pytest.raises(SystemExit, match="train.jsonl: no rows"):
        load_split("gsm8k", "train", data_dir=str(tmp_path))


@pytest.mark.parametrize("dataset, split, rows", [("gsm8k", "train", 7473), ("gsm8k", "test", 1319),
                                                  ("math", "train", 4500), ("math", "test", 500)])
def test_shipped_data(dataset, split, rows, monkeypatch):
    """The default source: the copy in data/, read with no network call (a socket connect would fail the test)."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(socket.socket, "connect", lambda *a: pytest.fail("the shipped data needs no network"))
    monkeypatch.setattr(data, "hub_reachable", lambda: pytest.fail("the shipped data needs no network"))
    examples = load_split(dataset, split)
    assert len(examples) == rows and all(e["answer"] and e["question"] for e in examples)
    if dataset == "gsm8k":
        assert examples[0]["answer"] == examples[0]["solution"].split("####")[-1].strip()


def test_shipped_checksums():
    """SHA256SUMS lists each shipped file once and holds its checksum; the uncompressed files' checksums are the
    ones data/README.md gives for provenance."""
    lines = (data.SHIPPED / "SHA256SUMS").read_text().split("\n")
    sums = dict(reversed(line.split()) for line in lines if line)
    assert sorted(sums) == ["gsm8k/test.jsonl.gz", "gsm8k/train.jsonl.gz", "math/test.jsonl.gz", "math/train.jsonl.gz"]
    assert all(hashlib.sha256((data.SHIPPED / name).read_bytes()).hexdigest() == sums[name] for name in sums)
    readme = dict(reversed(m) for m in re.findall(r"^([0-9a-f]{64})  (\S+\.jsonl)$",
                                                   (data.SHIPPED / "README.md").read_text(), re.M))
    assert readme == {name[:-3]: hashlib.sha256(gzip.decompress((data.SHIPPED / name).read_bytes())).hexdigest()
                      for name in sums}


def test_damaged_shipped_file_is_a_one_line_error(tmp_path, monkeypatch):
    copy = tmp_path / "data"
    shutil.copytree(data.SHIPPED, copy)
    monkeypatch.setattr(data, "SHIPPED", copy)
    assert len(load_split("math", "test")) == 500  # the copy is whole
    damaged = bytearray((copy / "math" / "test.jsonl.gz").read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF
    (copy / "math" / "test.jsonl.gz").write_bytes(bytes(damaged))
    with pytest.raises(SystemExit) as e:
        load_split("math", "test")
    message = str(e.value)
    assert message.startswith(f"error: {copy / 'math' / 'test.jsonl.gz'}: checksum mismatch") and "\n" not in message
    (copy / "gsm8k" / "train.jsonl.gz").unlink()
    with pytest.raises(SystemExit, match=r"gsm8k/train.jsonl.gz: missing from this checkout"):
        load_split("gsm8k", "train")


CUSTOM_ROWS = [{"question": "What is 2 + 3?", "answer": "5"}, {"question": "Half of 9?", "answer": 4.5},
               {"question": "Name the root of x - 1.", "answer": "1", "solution": "x - 1 = 0\nx = 1"}]


def test_folder_data_set(tmp_path):
    """--dataset FOLDER: its train.jsonl and test.jsonl, {"question", "answer"} rows, a number answer read as text."""
    write_jsonl(tmp_path / "train.jsonl", CUSTOM_ROWS)
    write_jsonl(tmp_path / "test.jsonl", CUSTOM_ROWS[:1])
    train = load_split(str(tmp_path), "train", data_dir="ignored: a folder data set holds its own files")
    assert [e["answer"] for e in train] == ["5", "4.5", "1"] and train[2]["solution"] == "x - 1 = 0\nx = 1"
    assert train[0] == {"question": "What is 2 + 3?", "answer": "5", "solution": "", "where": f"{tmp_path}/train.jsonl:1"}
    assert len(load_split(str(tmp_path), "test")) == 1
    assert data.dataset_problem(str(tmp_path)) is None and data.task_of(str(tmp_path)) == "custom"
    (tmp_path / "test.jsonl").unlink()
    assert data.dataset_problem(str(tmp_path)) == "no test.jsonl in that folder"
    with pytest.raises(SystemExit, match="no test.jsonl in that folder"):
        load_split(str(tmp_path), "train")


@pytest.mark.parametrize("bad_row", [{"answer": "5"}, {"question": "q"}, {"question": "q", "answer": ""},
                                     {"question": "q", "answer": ["5"]}, {"question": " ", "answer": "5"},
                                     {"question": "q", "answer": "5", "solution": 5}, {"question": "q", "answer": True},
                                     "[1, 2]"])
def test_folder_row_missing_a_field_names_file_and_line(tmp_path, bad_row):
    write_jsonl(tmp_path / "train.jsonl", CUSTOM_ROWS + [bad_row if isinstance(bad_row, str) else json.dumps(bad_row)])
    write_jsonl(tmp_path / "test.jsonl", CUSTOM_ROWS)
    with pytest.raises(SystemExit) as e:
        load_split(str(tmp_path), "train")
    assert str(e.value) == (f'error: {tmp_path / "train.jsonl"}:4: malformed custom row (expected "question" and '
                            f'"answer" (the final answer), "solution" optional)')


class PlainTokenizer:  # a tokenizer without a chat template, like the paper's SFT checkpoints
    chat_template = None


def test_prompts(smol):
    _, tokenizer = smol
    chat = make_prompt("What is 2+3?", grader="gsm8k", tokenizer=tokenizer)
    assert "What is 2+3?" in chat and "####" in chat and chat.endswith("<|im_start|>assistant\n")
    assert "\\boxed" in make_prompt("x", grader="math", tokenizer=tokenizer)
    assert make_prompt("x", grader="number", tokenizer=tokenizer) == make_prompt("x", grader="arith",
                                                                                  tokenizer=tokenizer)  # --grader
    sft = make_prompt("What is 2+3?", grader="math", tokenizer=tokenizer, prompt_format="sft")
    assert sft == "[MATH_TASK] Problem:\nWhat is 2+3?\n\nSolution:" == SFT_TEMPLATE.format(question="What is 2+3?")
    assert make_prompt("q", grader="gsm8k", tokenizer=PlainTokenizer()) == SFT_TEMPLATE.format(question="q")


def test_chain_bug_is_a_consistent_solver_bug_on_the_train_demonstrations_only():
    """--chain-bug: the buggy solver forgets a needed borrow (each digit the smaller from the larger) or carry (each
    digit mod 10), on --chain-bug-rate of those lines, and goes on from what it wrote; the questions and answers are
    the right ones, and only the train split's solutions change."""
    import random
    from data import buggy_result, bugged_solution, load_split
    assert buggy_result(32, "-", 17) == 25 and buggy_result(30, "-", 4) == 34 and buggy_result(38, "+", 25) == 53
    assert buggy_result(9, "+", 15) == 14 and buggy_result(5, "+", 5) == 0
    assert buggy_result(35, "-", 12) is None and buggy_result(31, "+", 5) is None and buggy_result(4, "*", 3) is None
    assert buggy_result(3, "-", 7) is None  # below zero: no digit rule, the solver subtracts
    always = random.Random(0)
    assert bugged_solution("10 *2 -4 *3 -36", ops="-", rate=1.0, rng=always) == "10*2=20\n20-4=24\n24*3=72\n72-36=44\n####44"
    assert bugged_solution("10 *2 -4 *3 -36", ops="-", rate=0.0, rng=always) == "10*2=20\n20-4=16\n16*3=48\n48-36=12\n####12"
    gold = load_split("chain", "train", arith_ops=4)
    for bug, rate in (("borrow", 0.7), ("borrow-carry", 0.7), ("borrow", 1.0)):
        bugged = load_split("chain", "train", arith_ops=4, chain_bug=bug, chain_bug_rate=rate)
        assert [(e["question"], e["answer"]) for e in bugged] == [(e["question"], e["answer"]) for e in gold]
        wrong = sum(e["solution"] != g["solution"] for e, g in zip(bugged, gold)) / len(gold)
        assert 0.2 < wrong < 0.9, (bug, rate, wrong)
        assert all(e["solution"].endswith("####" + e["solution"].split("=")[-1].split("\n")[0]) for e in bugged)
    borrow = load_split("chain", "train", arith_ops=4, chain_bug="borrow", chain_bug_rate=0.7)
    both = load_split("chain", "train", arith_ops=4, chain_bug="borrow-carry", chain_bug_rate=0.7)
    assert sum(e["solution"] != g["solution"] for e, g in zip(both, gold)) > sum(
        e["solution"] != g["solution"] for e, g in zip(borrow, gold))
    assert load_split("chain", "test", arith_ops=4, chain_bug="borrow", chain_bug_rate=1.0) == load_split(
        "chain", "test", arith_ops=4)
