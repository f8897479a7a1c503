"""parse_config: a folder --dataset and --grader, the derived task, each bad flag as one line, the model found offline
(or one line saying how to get it), and what --resume compares."""
import json

import pytest

import model as model_mod
from config import Config, config_changes, parse_config


def one_error_line(argv, capsys) -> str:
    """parse_config(argv) must stop; returns its one error line (below a one-line usage that points to --help)."""
    with pytest.raises(SystemExit) as e:
        parse_config(argv)
    assert e.value.code == 2
    usage, error = capsys.readouterr().err.strip().splitlines()
    assert usage.endswith("[flags] (--help lists every flag and its default)") and ": error: " in error
    return error.split(": error: ", 1)[1]


@pytest.mark.parametrize("argv, message", [
    (["--lr", "0"], "--lr must be above 0 (got 0.0)"),
    (["--lr=-1e-6"], "--lr must be above 0 (got -1e-06)"),
    (["--warmup-ratio", "1"], "--warmup-ratio must be in [0, 1) (got 1.0)"),
    (["--value-lr", "0", "--estimator", "critic"], "--value-lr must be above 0 (got 0.0)"),
    (["--gamma", "1.5"], "--gamma must be in [0, 1] (got 1.5)"),
    (["--gamma", "-0.1"], "--gamma must be in [0, 1] (got -0.1)"),
    (["--lam", "2"], "--lam must be in [0, 1] (got 2.0)"),
    (["--lam", "nan"], "--lam must be in [0, 1] (got nan)"),
    (["--clip", "0"], "--clip must be above 0 (got 0.0)"),
    (["--kl-coef=-1e-4"], "--kl-coef must be 0 (off) or above (got -0.0001)"),
    (["--estimator", "grpo", "--samples-per-prompt", "1"],
     "--estimator grpo compares each response with the others of its problem: it needs --samples-per-prompt 2 or more "
     "(got 1)"),
    (["--estimator", "rloo", "--samples-per-prompt", "1"],
     "--estimator rloo compares each response with the others of its problem: it needs --samples-per-prompt 2 or more "
     "(got 1)"),
    (["--dataset", "svamp"], "--dataset svamp: not gsm8k, math, arith, chain, nor a folder holding train.jsonl and test.jsonl"),
    (["--chain-filler", "4"], "--chain-filler takes 0 or more filler lines, with --dataset chain only (got 4 with "
                              "--dataset gsm8k)"),
    (["--dataset", "chain", "--chain-filler", "-1"], "--chain-filler takes 0 or more filler lines, with --dataset "
                                                     "chain only (got -1 with --dataset chain)"),
    # free samples: topup with a reward-driven stopping rule is biased; free samples without vines do nothing
    *[(["--free-samples", "topup", "--k-mode", mode],
       f"--free-samples topup takes --k-mode fixed only (got {mode}): with adaptive or official K, how many vines a "
       "state gets would depend on the rewards of the responses whose values they set (a bias, "
       "research/free_samples); budget shares vines over all states, not state by state")
      for mode in ("budget", "adaptive", "official")],
    (["--free-samples", "add", "--estimator", "grpo"],
     "--free-samples add feeds vines, which --estimator grpo does not sample: drop it, or use "
     "--estimator vine"),
    (["--free-samples", "topup", "--estimator", "critic"],
     "--free-samples topup feeds vines, which --estimator critic does not sample: drop it, or use "
     "--estimator vine"),
    # vines where the group is silent, and its comparator
    (["--vines-where", "silent", "--estimator", "rloo"],
     "--vines-where silent says where to sample vines, which --estimator rloo does not sample: drop it, or use "
     "--estimator vine"),
    (["--resample-silent", "8"], "--resample-silent takes 0 (off) or more fresh responses, with --estimator grpo or "
                                 "rloo on one process (got 8 with --estimator vine, 1 rank(s))"),
    (["--resample-silent=-1", "--estimator", "grpo"], "--resample-silent takes 0 (off) or more fresh responses, with "
                                                      "--estimator grpo or rloo on one process (got -1 with "
                                                      "--estimator grpo, 1 rank(s))"),
    (["--resample-silent", "100000", "--estimator", "grpo"],
     "--resample-silent takes at most 16 x --samples-per-prompt = 64 fresh responses per silent group (got 100000): "
     "with every group silent the batch would grow past 17 times its 4 x 4 episodes"),
    (["--vines-where", "silent", "--free-samples", "topup"],
     "--free-samples topup with --vines-where silent: in a vined group the other responses through a state got the "
     "group's reward by selection, so as free samples they would pull every value toward it; drop one of the two"),
])
def test_each_bad_flag_is_one_line(argv, message, capsys):
    assert one_error_line(["--device", "cpu", *argv], capsys) == message


def test_unknown_grader_is_one_line(capsys):  # argparse's own wording (its quoting differs between versions)
    assert one_error_line(["--grader", "exact"], capsys).startswith("argument --grader: invalid choice: 'exact'")


def test_edges_are_accepted():
    cfg = parse_config(["--device", "cpu", "--gamma", "0", "--lam", "1", "--kl-coef", "0", "--estimator", "grpo",
                        "--samples-per-prompt", "2"])
    assert (cfg.gamma, cfg.lam, cfg.kl_coef, cfg.samples_per_prompt) == (0.0, 1.0, 0.0, 2)
    assert parse_config(["--device", "cpu", "--samples-per-prompt", "1"]).samples_per_prompt == 1  # vine: fine


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


def test_hub_model_offline_is_one_line(tmp_path, monkeypatch, capsys):
    """Offline (HF_HUB_OFFLINE=1, as in every test), a Hub id outside the HF cache: one line naming the ways out."""
    from huggingface_hub import constants
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    message = one_error_line(["--device", "cpu", "--model", "Qwen/Qwen2.5-0.5B-Instruct"], capsys)
    assert message.startswith("--model Qwen/Qwen2.5-0.5B-Instruct: not in the Hugging Face cache")
    assert "--model FOLDER" in message and str(tmp_path / "hf") in message and "HF_HUB_OFFLINE=1" in message
    with pytest.raises(SystemExit) as e:  # the same line where the model is loaded
        model_mod.resolve_model.__wrapped__("Qwen/Qwen2.5-0.5B-Instruct")
    assert str(e.value) == "error: " + message


def test_hub_model_in_the_cache_is_found_offline(tmp_path, monkeypatch):
    from huggingface_hub import constants
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    snapshot = tmp_path / "hf" / "models--org--tiny" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("abc123")
    assert parse_config(["--device", "cpu", "--model", "org/tiny"]).model == "org/tiny"
    assert model_mod.resolve_model.__wrapped__("org/tiny") == str(snapshot)


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


def test_help_lists_the_papers_flags_first_in_groups(capsys):
    """--help in argparse groups (config.GROUPS, sft.SFT_GROUPS), every flag in exactly one; the paper's first."""
    import sft
    from config import GROUPS, parse_dataclass
    for argv_parse, first in ((parse_config, "the paper and its baselines:"), (sft.parse_sft_config,
                                                                                 "supervised fine-tuning:")):
        with pytest.raises(SystemExit):
            argv_parse(["--help"])
        text = capsys.readouterr().out
        titles = [line for line in text.splitlines() if line.endswith(":") and not line.startswith(" ")]
        assert titles[titles.index("options:") + 1] == first, titles  # after argparse's own "options:"
    assert GROUPS["the paper and its baselines"][:2] == ["estimator", "k"]
    with pytest.raises(ValueError, match="miss"):
        parse_dataclass(Config, [], groups={"one": ["dataset"]})


def test_sft_and_train_grade_a_folder_alike(tmp_path):
    """--grader auto reads both splits of a folder in train.py and sft.py alike (sft.py once read test.jsonl only): a
    folder whose test answers are numbers but one train answer is not is graded as math by both."""
    from sft import parse_sft_config
    folder = write_folder(tmp_path / "mixed", ["12", "7"])
    (tmp_path / "mixed" / "train.jsonl").write_text(json.dumps({"question": "q", "answer": "\\frac{1}{2}"}) + "\n")
    args = ["--device", "cpu", "--dataset", folder, "--out-dir", str(tmp_path / "out")]
    assert parse_config(args).grader == parse_sft_config(args).grader == "math"
