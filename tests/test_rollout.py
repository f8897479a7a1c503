"""The transformers sampler on the real SmolLM2: greedy tokens against a reference computation, seeding, limits."""
import pytest
import torch

from rollout import HFSampler, Sample, cut_at_stop


def reference_greedy(model, prompt, steps, stop_ids):
    """Greedy decoding the slow, obvious way: a full forward pass over the whole sequence for every token."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            token = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            ids.append(token)
            if token in stop_ids:
                break
    return ids[len(prompt):]


@pytest.fixture(scope="module")
def prompts(smol):
    _, tokenizer = smol
    texts = ["<|im_start|>user\nWhat is 12 + 30? Answer briefly.<|im_end|>\n<|im_start|>assistant\n",
             "The capital of France is", "1, 2, 3, 4,"]
    return [tokenizer(t, add_special_tokens=False).input_ids for t in texts]


def test_greedy_matches_reference(smol, prompts):
    model, tokenizer = smol
    sampler = HFSampler(model, tokenizer, batch_size=8)
    out = sampler.sample(prompts, n=1, temperature=0.0, top_p=1.0, max_new_tokens=12)
    for prompt, group in zip(prompts, out):
        assert group[0].token_ids == reference_greedy(model, prompt, 12, sampler.stop_ids)


def test_sampling_is_seeded_and_respects_limits(smol, prompts):
    model, tokenizer = smol
    sampler = HFSampler(model, tokenizer, batch_size=4)
    a = sampler.sample(prompts, n=3, temperature=0.6, top_p=0.9, max_new_tokens=[5, 7, 9], seed=1)
    b = sampler.sample(prompts, n=3, temperature=0.6, top_p=0.9, max_new_tokens=[5, 7, 9], seed=1)
    assert [[s.token_ids for s in g] for g in a] == [[s.token_ids for s in g] for g in b]
    for group, limit in zip(a, [5, 7, 9]):
        assert len(group) == 3
        for s in group:
            assert len(s.token_ids) <= limit and (s.finished or len(s.token_ids) == limit)
            assert s.text == tokenizer.decode(s.token_ids, skip_special_tokens=True)
            assert not s.finished or s.token_ids[-1] in sampler.stop_ids
    c = sampler.sample(prompts, n=3, temperature=0.6, top_p=0.9, max_new_tokens=[5, 7, 9], seed=2)
    assert [[s.token_ids for s in g] for g in a] != [[s.token_ids for s in g] for g in c]


def test_sample_prefixes_continues_the_prefix(smol, prompts):
    model, tokenizer = smol
    sampler = HFSampler(model, tokenizer)
    seq = prompts[2] + tokenizer(" 5, 6, 7,", add_special_tokens=False).input_ids
    lens = [len(prompts[2]), len(seq)]
    out = sampler.sample_prefixes([seq, seq], lens, n=1, temperature=0.0, top_p=1.0, max_new_tokens=4)
    for L, group in zip(lens, out):
        assert group[0].token_ids == reference_greedy(model, seq[:L], 4, sampler.stop_ids)


class FakeTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join({1: "a", 2: "\n\n\nProb", 3: "lem:", 4: "b", 0: ""}[i] for i in ids)


def test_cut_at_stop():
    tok = FakeTokenizer()
    assert cut_at_stop([1, 4, 0, 1], tokenizer=tok, stop_ids={0}, stop_strings=[], limit=10) == Sample([1, 4, 0], "ab", True)
    assert cut_at_stop([1, 4, 1], tokenizer=tok, stop_ids={0}, stop_strings=[], limit=2) == Sample([1, 4], "ab", False)
    cut = cut_at_stop([1, 2, 3, 4], tokenizer=tok, stop_ids={0}, stop_strings=["\n\n\nProblem:"], limit=10)
    assert cut == Sample([1, 2, 3], "a\n\n\nProblem:", True)
