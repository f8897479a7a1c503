"""Data loading from a temporary folder and from the real ../shared/data, and prompt formatting."""
import json

import pytest

from conftest import needs_data
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
    monkeypatch.delenv("VINEPPO_DATA_DIR", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(SystemExit, match="pass --data-dir"):
        load_split("math", "train")
    with pytest.raises(SystemExit, match="unknown dataset"):
        load_split("svamp", "train", data_dir=str(tmp_path))


def test_hub_rows_are_cached_for_offline_runs(tmp_path, monkeypatch):
    """The first load from the Hub writes its rows to $VINEPPO_CACHE/data; later loads read them with no network."""
    import data
    monkeypatch.delenv("VINEPPO_DATA_DIR", raising=False)
    monkeypatch.setenv("VINEPPO_CACHE", str(tmp_path))
    monkeypatch.setattr(data, "hub_reachable", lambda: True)
    monkeypatch.setattr(data, "hub_rows", lambda dataset, split: [dict(r, extra="dropped") for r in MATH_ROWS])
    first = load_split("math", "test")
    assert [e["answer"] for e in first] == ["2", "\\frac{1}{2}"]
    assert json.loads((tmp_path / "data" / "math" / "test.jsonl").read_text().splitlines()[0]) == MATH_ROWS[0]
    monkeypatch.setattr(data, "hub_reachable", lambda: pytest.fail("the cache needs no network"))
    assert load_split("math", "test") == first


def test_unreachable_hub_fails_at_once(tmp_path, monkeypatch):
    """A host that refuses the connection: one quick check, no retry storm, a one-line error naming --data-dir."""
    import time
    monkeypatch.delenv("VINEPPO_DATA_DIR", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("VINEPPO_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_ENDPOINT", "https://127.0.0.1")  # nothing listens on 443 here
    started = time.perf_counter()
    with pytest.raises(SystemExit) as e:
        load_split("gsm8k", "train")
    assert time.perf_counter() - started < 5
    assert str(e.value).startswith("error: gsm8k/train: the Hugging Face Hub is unreachable") and "--data-dir" in str(
        e.value) and "\n" not in str(e.value)


def test_empty_split_is_a_one_line_error(tmp_path):
    write_jsonl(tmp_path / "gsm8k" / "train.jsonl", ["", "  "])
    with pytest.raises(SystemExit, match="train.jsonl: no rows"):
        load_split("gsm8k", "train", data_dir=str(tmp_path))


@needs_data
@pytest.mark.parametrize("dataset, split, rows", [("gsm8k", "train", 7473), ("gsm8k", "test", 1319),
                                                  ("math", "train", 4500), ("math", "test", 500)])
def test_real_data(data_dir, dataset, split, rows):
    examples = load_split(dataset, split, data_dir=str(data_dir))
    assert len(examples) == rows and all(e["answer"] and e["question"] for e in examples)
    if dataset == "gsm8k":
        assert examples[0]["answer"] == examples[0]["solution"].split("####")[-1].strip()


class PlainTokenizer:  # a tokenizer without a chat template, like the paper's SFT checkpoints
    chat_template = None


def test_prompts(smol):
    _, tokenizer = smol
    chat = make_prompt("What is 2+3?", dataset="gsm8k", tokenizer=tokenizer)
    assert "What is 2+3?" in chat and "####" in chat and chat.endswith("<|im_start|>assistant\n")
    assert "\\boxed" in make_prompt("x", dataset="math", tokenizer=tokenizer)
    sft = make_prompt("What is 2+3?", dataset="math", tokenizer=tokenizer, prompt_format="sft")
    assert sft == "[MATH_TASK] Problem:\nWhat is 2+3?\n\nSolution:" == SFT_TEMPLATE.format(question="What is 2+3?")
    assert make_prompt("q", dataset="gsm8k", tokenizer=PlainTokenizer()) == SFT_TEMPLATE.format(question="q")
