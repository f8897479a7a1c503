"""bench/sampler.py's real-vines section (bench/vines.py) on a tiny random-weight model: it runs end to end on GSM8K train
rows, and the static and continuous loops give the same fp32 values and vine tokens (the identity its line reports)."""
from types import SimpleNamespace

import pytest
import torch


@pytest.mark.parametrize("dtype, repeat, runs", [("bfloat16", False, 7), ("float32", True, 7)])
def test_real_vines_runs_and_the_two_fp32_loops_agree(smol_path, capsys, dtype, repeat, runs):
    """In bf16: five runs in bf16, then the fp32 pair; in fp32 the five runs hold the fp32 pair already, and with
    repeat the pair runs again at the end (A B ... B A)."""
    from bench.vines import real_vines
    from model import load_tokenizer
    from bench.shapes import random_model
    tokenizer = load_tokenizer(smol_path)
    model = random_model("tiny", tokenizer=tokenizer, device=torch.device("cpu"))
    args = SimpleNamespace(gen_batch_size=16, data_dir=None, vine_prompts=1, vine_samples=2, vine_max_new_tokens=24,
                           vine_dtype=dtype, vine_repeat=repeat)
    ratios = real_vines(model, tokenizer, args)
    assert set(ratios) == {"continuous_vs_static", "adaptive_vs_fixed_seconds"}
    assert all(v > 0 for v in ratios.values())
    out = capsys.readouterr().out
    assert "fp32 values and vine tokens identical: True" in out
    assert out.count("real vines, ") == runs  # the timed runs, each with its states, vines and tokens
    name = {"bfloat16": "bf16", "float32": "fp32"}[dtype]
    assert f"real vines, continuous {name} adaptive:0.45" in out and "continuous vs static" in out
    loops = [line.split()[2] for line in out.splitlines() if line.startswith("real vines, ")]  # static / continuous
    assert loops[:2] + loops[-2:] == ["static", "continuous"] + (["continuous", "static"] if repeat else
                                                                  ["static", "continuous"])  # the fp32 pair last
    assert ("mean of two runs" in out) == repeat


def test_subnormal_counts_by_hand():
    from bench.denormals import subnormal_counts
    tiny = torch.finfo(torch.float32).tiny
    state = {"state": {0: {"exp_avg": torch.tensor([1.0, 0.0]), "exp_avg_sq": torch.tensor([tiny / 4, tiny, 0.0])},
                       1: {"exp_avg": torch.tensor([-tiny / 2]), "exp_avg_sq": torch.tensor([1e-45, 2.0])}}}
    counts = subnormal_counts(state, ["a", "b"])
    assert counts["exp_avg_sq"] == (5, 2, {"a": 1, "b": 1})  # tiny itself is normal, 0 is not subnormal
    assert counts["exp_avg"] == (3, 1, {"b": 1})  # a negative subnormal counts
