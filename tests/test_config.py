"""parse_config: a folder --dataset and --grader, the derived task, and what --resume compares."""
import json

import pytest

from config import config_changes, parse_config


def one_error_line(argv, capsys) -> str:
    """parse_config(argv) must stop; returns its one error line (argparse prints the usage above it)."""
    with pytest.raises(SystemExit) as e:
        parse_config(argv)
    assert e.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0].startswith("usage:") and [l for l in lines if "error:" in l] == [lines[-1]]
    return lines[-1].split("error: ", 1)[1]


def test_unknown_grader_is_one_line(capsys):  # argparse's own wording (its quoting differs between versions)
    assert one_error_line(["--grader", "exact"], capsys).startswith("argument --grader: invalid choice: 'exact'")


def test_unknown_data_set_is_one_line(capsys):
    assert one_error_line(["--dataset", "svamp"], capsys) == \
        "--dataset svamp: not gsm8k, math, arith, nor a folder holding train.jsonl and test.jsonl"


def test_builtin_data_sets_derive_task_and_grader():
    for dataset, grader, iterations in (("gsm8k", "number", 650), ("math", "math", 1000), ("arith", "number", 200)):
        cfg = parse_config(["--device", "cpu", "--dataset", dataset])
        assert (cfg.task, cfg.grader, cfg.iterations) == (dataset, grader, iterations)
    assert parse_config(["--device", "cpu", "--dataset", "gsm8k", "--grader", "math"]).grader == "math"


def write_folder(path, answers):
    path.mkdir(parents=True, exist_ok=True)
    for split in ("train", "test"):
        (path / f"{split}.jsonl").write_text("".join(json.dumps({"question": f"q{i}", "answer": a}) + "\n"
                                                     for i, a in enumerate(answers)))
    return str(path)


def test_folder_data_set_flags(tmp_path):
    numbers = write_folder(tmp_path / "sums", ["12", "1,234", "-5", 0.5, "3/4"])
    cfg = parse_config(["--device", "cpu", "--dataset", numbers])
    assert (cfg.task, cfg.grader, cfg.iterations, cfg.max_value_steps) == ("custom", "number", 650, 25)
    assert cfg.out_dir == "runs/sums-vine-k9-s0"
    assert parse_config(["--device", "cpu", "--dataset", numbers, "--grader", "math"]).grader == "math"
    algebra = write_folder(tmp_path / "algebra", ["12", "\\frac{1}{2}"])  # one answer not a plain number: math
    assert parse_config(["--device", "cpu", "--dataset", algebra + "/"]).grader == "math"
    assert parse_config(["--device", "cpu", "--dataset", algebra + "/"]).out_dir == "runs/algebra-vine-k9-s0"


def test_folder_data_set_errors(tmp_path, capsys):
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "train.jsonl").write_text(json.dumps({"question": "q", "answer": "1"}) + "\n")
    assert one_error_line(["--dataset", str(tmp_path / "half")], capsys) == \
        f"--dataset {tmp_path / 'half'}: no test.jsonl in that folder"
    bad = write_folder(tmp_path / "bad", ["1", "2"])
    with open(f"{bad}/test.jsonl", "a") as f:
        f.write(json.dumps({"question": "no answer"}) + "\n")
    with pytest.raises(SystemExit) as e:  # a bad row, found while parsing (auto reads the answers), before any write
        parse_config(["--dataset", bad, "--out-dir", str(tmp_path / "out")])
    assert str(e.value) == (f'error: {bad}/test.jsonl:3: malformed custom row (expected "question" and "answer" (the '
                            f'final answer), "solution" optional)')
    assert not (tmp_path / "out").exists()


def test_resume_refuses_a_changed_data_set_or_grader(tmp_path):
    import dataclasses
    folder = write_folder(tmp_path / "sums", ["1", "2"])
    saved = dataclasses.asdict(parse_config(["--device", "cpu", "--dataset", folder]))
    assert config_changes(saved, parse_config(["--device", "cpu", "--dataset", folder])) == ([], [])
    defining, _ = config_changes(saved, parse_config(["--device", "cpu", "--dataset", "gsm8k"]))
    assert defining == [f"--dataset {folder} -> gsm8k"]  # the task and the out-dir follow; neither is compared
    defining, _ = config_changes(saved, parse_config(["--device", "cpu", "--dataset", folder, "--grader", "math"]))
    assert defining == ["--grader number -> math"]
    old = {k: v for k, v in dataclasses.asdict(parse_config(["--device", "cpu"])).items() if k not in ("grader", "task")}
    assert config_changes(old, parse_config(["--device", "cpu"])) == ([], [])  # a checkpoint from before --grader
