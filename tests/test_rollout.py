"""The transformers sampler on the real SmolLM2: greedy tokens against a reference computation, seeding, limits,
continuous batching against the static loop."""
from functools import partial

import pytest
import torch

from engine.continuous import Row, sort_by_age
from engine.decoding import gumbel, sample_tokens
from engine import HFSampler
from rollout import GenerateSampler, Sample, cut_at_stop
from sampling import Request


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
    lps = [-0.1, -0.2, -0.3, -0.4]
    assert cut_at_stop([1, 4, 0, 1], logprobs=lps, tokenizer=tok, stop_ids={0}, stop_strings=[],
                       limit=10) == Sample([1, 4, 0], "ab", True, [-0.1, -0.2, -0.3])
    assert cut_at_stop([1, 4, 1], logprobs=lps[:3], tokenizer=tok, stop_ids={0}, stop_strings=[],
                       limit=2) == Sample([1, 4], "ab", False, [-0.1, -0.2])
    cut = cut_at_stop([1, 2, 3, 4], logprobs=lps, tokenizer=tok, stop_ids={0}, stop_strings=["\n\n\nProblem:"],
                      limit=10)
    assert cut == Sample([1, 2, 3], "a\n\n\nProblem:", True, [-0.1, -0.2, -0.3])


@pytest.mark.slow  # the real SmolLM2's decode, several passes
def test_prefix_reuse_gives_the_same_tokens_as_fresh_prefill(smol, prompts):
    """Vines from a copied KV cache equal vines from their own prefill: greedy, and sampled with the same seed."""
    model, tokenizer = smol
    seq = prompts[0] + tokenizer("12 + 30 = 42.\nSo the answer is 42.", add_special_tokens=False).input_ids
    lens = [len(prompts[0]), len(prompts[0]) + 4, len(prompts[0]) + 9]
    reuse, fresh = HFSampler(model, tokenizer), HFSampler(model, tokenizer, reuse_prefixes=False)
    for temperature in (0.0, 0.6):
        a = reuse.sample_prefixes([seq] * 3, lens, n=3, temperature=temperature, top_p=0.9, max_new_tokens=10, seed=5)
        b = fresh.sample_prefixes([seq] * 3, lens, n=3, temperature=temperature, top_p=0.9, max_new_tokens=10, seed=5)
        assert [[s.token_ids for s in g] for g in a] == [[s.token_ids for s in g] for g in b]
    small_prefills = HFSampler(model, tokenizer, prefill_tokens=1)  # one sequence per prefill pass, narrower ones too
    mixed = ([seq, prompts[1], seq], [lens[0], len(prompts[1]), lens[2]])
    c = small_prefills.sample_prefixes(*mixed, n=2, temperature=0.6, top_p=0.9, max_new_tokens=10, seed=5)
    d = fresh.sample_prefixes(*mixed, n=2, temperature=0.6, top_p=0.9, max_new_tokens=10, seed=5)
    assert [[s.token_ids for s in g] for g in c] == [[s.token_ids for s in g] for g in d]
    greedy = reuse.sample_prefixes([seq] * 3, lens, n=1, temperature=0.0, top_p=1.0, max_new_tokens=6)
    for L, group in zip(lens, greedy):
        assert group[0].token_ids == reference_greedy(model, seq[:L], 6, reuse.stop_ids)


@pytest.mark.slow  # the real SmolLM2's decode, several passes
def test_rows_sample_the_same_whatever_shares_their_batch(smol, prompts):
    """Finished rows leave the batch and batches are regrouped; a row's tokens must not depend on either."""
    model, tokenizer = smol
    kwargs = dict(n=2, temperature=0.6, top_p=0.9, max_new_tokens=[3, 20, 12], seed=9)
    small = HFSampler(model, tokenizer, batch_size=2).sample(prompts, **kwargs)
    big = HFSampler(model, tokenizer, batch_size=64).sample(prompts, **kwargs)
    alone = HFSampler(model, tokenizer).sample(prompts[:1], **{**kwargs, "max_new_tokens": 3})  # same row keys
    assert [[s.token_ids for s in g] for g in small] == [[s.token_ids for s in g] for g in big]
    assert [s.token_ids for s in alone[0]] == [s.token_ids for s in big[0]]
    assert all(len(s.token_ids) <= 3 for s in big[0]) and any(len(s.token_ids) > 3 for s in big[1])


@pytest.fixture(scope="module")
def states(smol, prompts):
    """Five states of three sequences (three prefixes of one), each its own budget."""
    _, tokenizer = smol
    seq = prompts[0] + tokenizer("12 + 30 = 42.\nSo the answer is 42.", add_special_tokens=False).input_ids
    return ([seq, seq, seq, prompts[1], prompts[2]],
            [len(prompts[0]), len(prompts[0]) + 4, len(seq), len(prompts[1]), len(prompts[2])], [20, 12, 3, 16, 8])


@pytest.mark.slow  # the real SmolLM2's decode, several passes
def test_continuous_batching_samples_the_static_loops_tokens(smol, states):
    """fp32, EOS on, 4 decode slots for 15 rows: finished rows' slots are refilled by rows that start at step 0 beside
    rows far into theirs; with group_tokens=1 the prefill pool holds one sequence at a time (prefilled as places free
    up); with the rows sorted by age every 3 steps and the suffix read in blocks of 2 slots. Every row's tokens equal
    the static loop's, row for row; log-probs to rounding."""
    model, tokenizer = smol
    seqs, lens, budgets = states
    kwargs = dict(n=3, temperature=0.6, top_p=0.9, max_new_tokens=budgets, seed=7)
    static = HFSampler(model, tokenizer, batch_size=4, continuous=False).sample_prefixes(seqs, lens, **kwargs)
    lengths = [len(s.token_ids) for g in static for s in g]
    assert len(set(lengths)) > 3 and sum(s.finished and len(s.token_ids) < b for g, b in zip(static, budgets)
                                         for s in g) >= 3  # rows end at many different steps, some at EOS
    for sampler in (HFSampler(model, tokenizer, batch_size=4), HFSampler(model, tokenizer, batch_size=4,
                                                                         group_tokens=1),
                    HFSampler(model, tokenizer, batch_size=4, suffix_block=2, resort_every=3)):
        out = sampler.sample_prefixes(seqs, lens, **kwargs)
        assert [[s.token_ids for s in g] for g in out] == [[s.token_ids for s in g] for g in static]
        for a, b in zip([s for g in out for s in g], [s for g in static for s in g]):
            torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-4, rtol=0)


def second_round(request, samples, *, log):
    """on_done for the test below: keep the samples; even states ask for a second round of 2 (its own seed)."""
    log[(request.state, request.round)] = [s.token_ids for s in samples]
    return [Request(request.state, 2, 100 + request.state, round=1)] if request.round == 0 and request.state % 2 == 0 \
        else []


@pytest.mark.slow  # the real SmolLM2's decode, several passes
def test_requests_added_while_decoding_sample_as_in_static_passes(smol, states):
    """Requests that on_done returns join the running batch at once (continuous) or wait for the next pass (static):
    the same rows, the same tokens; in the continuous loop a second round ends before the first round does."""
    model, tokenizer = smol
    seqs, lens, budgets = states
    logs = []
    for continuous in (False, True):
        logs.append({})
        HFSampler(model, tokenizer, batch_size=4, continuous=continuous).sample_requests(
            seqs, lens, [Request(i, 3, 7) for i in range(len(seqs))], on_done=partial(second_round, log=logs[-1]),
            temperature=0.6, top_p=0.9, max_new_tokens=budgets)
    assert logs[0] == logs[1] and len(logs[0]) == 5 + 3
    order = [round_ for _, round_ in logs[1]]  # the continuous loop's, in the order the requests ended
    assert order.index(1) < len(order) - 1 - order[::-1].index(0)


def test_sort_by_age_moves_each_rows_suffix_with_it():
    """Oldest row first; each row's own suffix columns (keys and values, every layer) land in its new slot."""
    g = torch.Generator().manual_seed(0)
    lengths = [3, 9, 1, 9, 5, 2]  # len(ids) of the row in each slot; two of the same age keep their order
    batch = [Row(state=i, parent=0, prefix_len=4, budget=10, seed=0, key=i, request=0, index=i, ids=[7] * n)
             for i, n in enumerate(lengths)]
    keys, values = torch.randn(2, 6, 3, 4, 10, generator=g), torch.randn(2, 6, 3, 10, 4, generator=g)  # (L, B, Hkv, D, Ws)
    before = {r.state: (keys[:, b, ..., :len(r.ids)].clone(), values[:, b, :, :len(r.ids)].clone())
              for b, r in enumerate(batch)}
    out = sort_by_age(batch, keys, values)
    assert [r.state for r in out] == [1, 3, 4, 0, 5, 2]
    for b, r in enumerate(out):
        assert torch.equal(keys[:, b, ..., :len(r.ids)], before[r.state][0])
        assert torch.equal(values[:, b, :, :len(r.ids)], before[r.state][1])


def test_gumbel_noise_is_a_pure_function_and_uniform():
    rows, ids = torch.arange(4), torch.arange(1000).expand(4, -1)
    a = gumbel(seed=1, rows=rows, step=3, token_ids=ids)
    assert torch.equal(a, gumbel(seed=1, rows=rows, step=3, token_ids=ids))
    assert torch.equal(a[2:], gumbel(seed=1, rows=rows[2:], step=3, token_ids=ids[2:]))  # independent of batch
    assert not torch.equal(a, gumbel(seed=2, rows=rows, step=3, token_ids=ids))
    assert not torch.equal(a, gumbel(seed=1, rows=rows, step=4, token_ids=ids))
    mixed = gumbel(seed=torch.tensor([1, 2, 1, 2]), rows=rows, step=torch.tensor([3, 3, 4, 3]), token_ids=ids)
    for r, (seed, step) in enumerate([(1, 3), (2, 3), (1, 4), (2, 3)]):  # each row its own seed and step
        assert torch.equal(mixed[r], gumbel(seed=seed, rows=rows, step=step, token_ids=ids)[r])
    u = torch.exp(-torch.exp(-a.double()))  # back to uniforms
    assert abs(u.mean().item() - 0.5) < 0.02 and abs(u.var().item() - 1 / 12) < 0.005
    counts = torch.histc(u.float(), bins=10, min=0, max=1)
    assert counts.min() > 300 and counts.max() < 500  # 4000 draws, 400 expected per bin


@pytest.mark.parametrize("vocab, top_p", [(50, 0.9), (300, 0.9), (300, 1.0)])
def test_top_p_sampling_matches_the_nucleus_distribution(vocab, top_p):
    """Empirical frequencies over many rows equal the renormalised nucleus probabilities. vocab 300 with flat-ish
    logits needs more than the 64 first candidates, which exercises the full-sort fallback."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(vocab, generator=g) * (3.0 if vocab == 50 else 0.3)
    probs = torch.softmax(logits / 0.7, -1)
    order = probs.argsort(descending=True)
    keep = torch.zeros(vocab, dtype=torch.bool)
    keep[order[(probs[order].cumsum(0) - probs[order]) < top_p]] = True
    nucleus = torch.where(keep, probs, 0.0) / probs[keep].sum()
    rows = 20000
    tokens, logprobs = sample_tokens(logits.expand(rows, -1), temperature=0.7, top_p=top_p, seed=0,
                                     rows=torch.arange(rows), step=0)
    torch.testing.assert_close(logprobs, nucleus[tokens].log())  # the distribution sampled from: the nucleus
    freq = torch.bincount(tokens, minlength=vocab).float() / rows
    assert freq[~keep].sum() == 0
    assert (freq - nucleus).abs().max() < 4 * (nucleus.max() / rows) ** 0.5 + 1e-3


def test_generate_sampler_still_works(smol, prompts):
    model, tokenizer = smol
    out = GenerateSampler(model, tokenizer).sample(prompts[:2], n=1, temperature=0.0, top_p=1.0, max_new_tokens=8)
    for prompt, group in zip(prompts, out):
        assert group[0].token_ids == reference_greedy(model, prompt, 8, HFSampler(model, tokenizer).stop_ids)


def test_evaluation_adds_greedy_pass1_only_with_eval_greedy(monkeypatch):
    """rollout.evaluation: the sampled pass@1 always; with --eval-greedy also greedy (temperature 0, one sample)."""
    import rollout
    from config import parse_config
    calls = []

    def scripted(sampler, tokenizer, examples, cfg, *, seed, keep=None):
        calls.append((cfg.eval_temperature, cfg.eval_samples))
        return (0.5, 0.02) if cfg.eval_temperature else (0.4, 0.03)
    monkeypatch.setattr(rollout, "evaluate", scripted)
    cfg = parse_config(["--device", "cpu", "--eval-samples", "16", "--eval-temperature", "0.35"])
    assert rollout.evaluation(None, None, [], cfg, seed=0) == {"eval_accuracy": 0.5, "eval_se": 0.02}
    cfg = parse_config(["--device", "cpu", "--eval-samples", "16", "--eval-temperature", "0.35", "--eval-greedy"])
    assert rollout.evaluation(None, None, [], cfg, seed=0) == {"eval_accuracy": 0.5, "eval_se": 0.02,
                                                               "eval_greedy_accuracy": 0.4, "eval_greedy_se": 0.03}
    assert calls == [(0.35, 16), (0.35, 16), (0.0, 1)]


def test_resample_silent_grows_only_the_silent_groups_and_counts_what_it_found():
    """--resample-silent M: M fresh responses to the prompt of each group with one outcome, joined to its group
    (same prompt, answer, group index), graded; a mixed group is left as it was; the stats count the silent groups
    and the share the fresh responses gave contrast."""
    from types import SimpleNamespace
    from ablations.silent_groups import resample_silent
    from rollout import Episodes
    asked = []

    class Scripted:
        def sample(self, prompts, *, n, temperature, top_p, max_new_tokens, seed):
            asked.append((prompts, n))
            return [[SimpleNamespace(text=f"####{'7' if p == [2] and i == 0 else '0'}", token_ids=[9], finished=True)
                     for i in range(n)] for p in prompts]
    sample = lambda text: SimpleNamespace(text=text, token_ids=[9], finished=True)  # noqa: E731
    episodes = Episodes(prompts=[[1], [1], [2], [2], [3], [3]], samples=[sample("x")] * 6,
                        answers=["5", "5", "7", "7", "8", "8"], groups=[0, 0, 1, 1, 2, 2])
    rewards = [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]  # group 0 mixed, 1 and 2 all wrong
    cfg = SimpleNamespace(temperature=0.6, top_p=0.9, max_new_tokens=8, grader="chain")
    grown, grown_rewards, stats = resample_silent(Scripted(), episodes, rewards, extra=3, cfg=cfg, seed=0)
    assert asked == [([[2], [3]], 3)]
    assert grown.groups == [0, 0, 1, 1, 2, 2, 1, 1, 1, 2, 2, 2] and grown.answers[6:] == ["7"] * 3 + ["8"] * 3
    assert grown.prompts[6:] == [[2]] * 3 + [[3]] * 3
    assert grown_rewards == rewards + [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert stats == {"resampled_groups": 2, "silent_before_frac": pytest.approx(2 / 3), "resample_found_frac": 0.5}
    same = resample_silent(Scripted(), episodes, rewards, extra=0, cfg=cfg, seed=0)
    assert same[0] is episodes and same[1] is rewards and len(asked) == 1
    assert same[2] == {"resampled_groups": 0, "silent_before_frac": pytest.approx(2 / 3), "resample_found_frac": 0.0}


def test_a_grown_batch_takes_exactly_the_plain_batchs_steps_in_near_equal_minibatches():
    """--resample-silent: a batch grown past prompts x samples is split into exactly the plain batch's number of
    minibatches (8 for 512 episodes in minibatches of 64, micro-batches of 32), the largest at most twice the
    smallest, every episode in one; the sizes the grid met (544, 1322, 1538) and every size up to 4,000."""
    from ablations.silent_groups import plain_steps
    from ppo import micro_batches, minibatch_groups
    steps = plain_steps(episodes=512, minibatch=64, micro=32)
    assert steps == 8 and plain_steps(episodes=16, minibatch=8, micro=2) == 2
    assert len(minibatch_groups(micro_batches(512, size=32), 64)) == 8  # the plain batch, bundled as before
    for n in (544, 1322, 1538, *range(513, 4001, 7)):
        minibatches = minibatch_groups(micro_batches(n, size=32), 64, steps=steps)
        sizes = [sum(len(idx) for idx in mb) for mb in minibatches]
        assert len(minibatches) == 8 and max(sizes) <= 2 * min(sizes), (n, sizes)
        assert sorted(torch.cat([idx for mb in minibatches for idx in mb]).tolist()) == list(range(n))
