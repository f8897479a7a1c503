"""Mixed precision: the dtype choice, fp32 master weights under bf16 compute, the bf16 sampler (every decode path in
both dtypes), the sampler's own log-probs, the mismatch metrics and truncated importance sampling."""
import copy
import math

import pytest
import torch

import model as model_mod
from engine.decoding import decode_attention, prefix_layout, suffix_layout
from model import Scorer
from ppo import (batch_logprobs, micro_batches, pad_episodes, pad_rows, ppo_loss, ppo_update, sampler_mismatch,
                 tis_weights)
from engine import HFSampler
from rollout import GenerateSampler


def test_pick_dtype_reads_the_cpu_features(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    for caps, expected in (({"avx512_bf16": True}, torch.bfloat16), ({"amx_bf16": True}, torch.bfloat16),
                           ({"bf16": True}, torch.bfloat16), ({"avx512_bf16": False, "avx2": True}, torch.float32),
                           ({}, torch.float32)):
        monkeypatch.setattr(torch.cpu, "get_capabilities", lambda caps=caps: caps)
        assert model_mod.pick_dtype("auto", cpu) == expected, caps
        assert model_mod.pick_dtype("float32", cpu) == torch.float32
        assert model_mod.pick_dtype("bfloat16", cpu) == torch.bfloat16
    assert model_mod.pick_dtype("auto", cuda) == torch.bfloat16


@pytest.fixture(scope="module")
def smol_two_layers(smol):
    """The real SmolLM2 cut to its first 2 of 30 decoder layers: its own weights, shapes and kernels at a fifteenth of
    the compute. What the AdamW test guards against (a 1e-6 step lost to bf16 rounding of a weight) is per weight,
    not per depth. (Kernels rounding differently per shape need the whole depth to show: the next test uses it.)"""
    model, tokenizer = smol
    short = copy.deepcopy(model)
    short.model.layers = short.model.layers[:2]
    short.config.num_hidden_layers = 2
    if getattr(short.config, "layer_types", None):
        short.config.layer_types = short.config.layer_types[:2]
    return short, tokenizer


def tiny_batch(tokenizer):
    prompts = [tokenizer("Q: 2 + 3?\nA:").input_ids, tokenizer("Q: what is 7 times 6?\nA:").input_ids]
    responses = [tokenizer(" 2 + 3 = 5.\n#### 5").input_ids, tokenizer(" 7 * 6 = 42.\n#### 42").input_ids]
    ids, attn, resp, P = pad_episodes(prompts, responses, pad_id=tokenizer.pad_token_id)
    return {"input_ids": ids, "attention_mask": attn, "response_mask": resp}, P


def fraction_moved_by_one_step(model, tokenizer, *, weights: torch.dtype, compute: torch.dtype) -> float:
    """One PPO/AdamW step at lr 1e-6 on a copy of `model` stored in `weights`, computing in `compute`: the fraction
    of parameter entries whose gradient is clearly non-zero (|g| > 1e-7, so that AdamW's first step is ~lr) that
    actually changed."""
    policy = copy.deepcopy(model).to(weights).requires_grad_(True)
    batch, P = tiny_batch(tokenizer)
    batch["old_logprobs"], _, _ = batch_logprobs(Scorer(policy, dtype=compute), batch, P, groups=micro_batches(2, size=2),
                                              temperature=1.0)
    batch["ref_logprobs"] = batch["old_logprobs"]
    batch["advantages"] = pad_rows([torch.ones(n) for n in batch["response_mask"].sum(1).tolist()],
                                   batch["response_mask"].shape[1])
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-6, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    grads = {}
    optimizer.register_step_pre_hook(
        lambda *_: grads.update({n: p.grad.clone() for n, p in policy.named_parameters()}))
    stats = ppo_update(Scorer(policy, dtype=compute), optimizer, scheduler, batch, P, groups=micro_batches(2, size=2),
                       epochs=1, minibatch_size=2, clip=0.2, kl_coef=1e-4, temperature=1.0)
    assert stats["optimizer_steps"] == 1
    has_grad = changed = 0
    for name, p in policy.named_parameters():
        assert p.dtype == weights, name
        g = grads[name].abs() > 1e-7
        has_grad += int(g.sum())
        changed += int((p.detach() != before[name])[g].sum())
    assert has_grad > 1e6
    return changed / has_grad


def test_one_adamw_step_at_lr_1e6_moves_the_fp32_master_weights(smol_two_layers):
    """bf16 compute over fp32 master weights moves (almost) every parameter that has a gradient, as fp32 does. The
    control is the bug this guards against: bf16 weights updated in place lose a 1e-6 step to rounding."""
    model, tokenizer = smol_two_layers
    fp32 = fraction_moved_by_one_step(model, tokenizer, weights=torch.float32, compute=torch.float32)
    mixed = fraction_moved_by_one_step(model, tokenizer, weights=torch.float32, compute=torch.bfloat16)
    bf16_weights = fraction_moved_by_one_step(model, tokenizer, weights=torch.bfloat16, compute=torch.bfloat16)
    assert fp32 > 0.999 and mixed > 0.999, (fp32, mixed)
    assert bf16_weights < 0.2, bf16_weights


@pytest.mark.slow  # the real SmolLM2's forward and backward in bf16 (cut to 2 layers, no shape's rounding differs)
def test_fixed_micro_batches_make_the_bf16_ratio_start_at_one(smol):
    """In bf16 the same tokens scored in differently padded micro-batches differ (kernels round differently per
    shape); scored in the same micro-batches they repeat exactly, so PPO's first ratio is exactly 1."""
    model, tokenizer = smol
    batch, P = tiny_batch(tokenizer)
    for key in ("input_ids", "attention_mask", "response_mask"):
        batch[key] = torch.cat([batch[key], batch[key].flip(0)])  # 4 episodes
    bf16 = Scorer(model, dtype=torch.bfloat16)
    together = batch_logprobs(bf16, batch, P, groups=micro_batches(4, size=4), temperature=1.0)[0]
    alone = batch_logprobs(bf16, batch, P, groups=micro_batches(4, size=1), temperature=1.0)[0]
    assert not torch.equal(together * batch["response_mask"], alone * batch["response_mask"])
    policy = copy.deepcopy(model).requires_grad_(True)
    groups = micro_batches(4, size=2)
    scorer = Scorer(policy, dtype=torch.bfloat16)
    batch["old_logprobs"], _, _ = batch_logprobs(scorer, batch, P, groups=groups, temperature=1.0)
    batch["ref_logprobs"] = batch["old_logprobs"]
    batch["advantages"] = batch["response_mask"].float()
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-6)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    stats = ppo_update(scorer, optimizer, scheduler, batch, P, groups=groups, epochs=1, minibatch_size=4,
                       clip=0.2, kl_coef=1e-4, temperature=1.0)
    assert stats["optimizer_steps"] == 1 and stats["ratio"] == 1.0 and stats["approx_kl"] == 0.0, stats


def naive_attention(q, keys, values):
    """softmax(q k^T) v for one row: q (H, D), keys/values (n, Hkv, D); grouped heads share their KV head."""
    H, D = q.shape
    G = H // keys.shape[1]
    k, v = keys.repeat_interleave(G, 1).float(), values.repeat_interleave(G, 1).float()  # (n, H, D)
    w = torch.softmax(torch.einsum("hd,nhd->hn", q.float(), k), -1)  # (H, n)
    return torch.einsum("hn,nhd->hd", w, v)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("ragged, block", [(False, 32), (True, 32), (True, 2)])
def test_decode_attention_equals_plain_softmax_attention(dtype, tol, shared, ragged, block):
    """Both layouts (each row its own sequence; several rows continuing prefixes of one sequence, some stopping
    early in it) against the obvious computation, in fp32 and bf16; rows at one step (the static loop) or each at
    its own (continuous batching), with junk in the suffix columns a row must not read; and with the suffix read
    in blocks of 2 slots, each to its own furthest row's step (suffix_layout's blocks)."""
    g = torch.Generator().manual_seed(0)
    L, Hkv, G, D = 2, 2, 3, 8
    lens = [5, 7, 4] if not shared else [6, 3, 6, 5]  # prefix length of each row
    seq_lens = [5, 7, 4] if not shared else [6, 5]
    slots = [0, 1, 2] if not shared else [0, 0, 0, 1]
    W, B = max(seq_lens), len(slots)
    steps = ([1, 0, 6, 5] if ragged else [3] * 4)[:B]  # each row's own step: the suffix column it writes
    suffix = suffix_layout(steps, device=torch.device("cpu"), block=block)
    assert (suffix["blocks"] is not None) == (block == 2)  # blocks of 2: 2 + 7 columns a row, not 7
    keys = torch.randn(L, len(seq_lens), Hkv, D, W, generator=g).to(dtype)  # right-aligned, transposed cache
    values = torch.randn(L, len(seq_lens), Hkv, D, W, generator=g).to(dtype)
    cache = {"keys": keys, "values": values, "lens": seq_lens, "width": W}
    suffix_keys = torch.randn(L, B, Hkv, D, 8, generator=g)  # transposed; fp32 whatever the model's dtype. Past a
    suffix_values = torch.randn(L, B, Hkv, 8, D, generator=g)  # row's step: what an earlier row left, never read
    layout = prefix_layout(slots=slots, lens=lens, cache=cache, heads_per_kv=G)
    q = torch.randn(B, Hkv * G, 1, D, generator=g).to(dtype)
    k, v = (torch.randn(B, Hkv, 1, D, generator=g).to(dtype) for _ in range(2))
    for layer in range(L):
        out = decode_attention(layer, q, k, v, scale=1.0, prefix=layout, prefix_keys=keys, prefix_values=values,
                               suffix_keys=suffix_keys, suffix_values=suffix_values,
                               suffix=suffix)
        assert out.dtype == dtype and out.shape == (B, Hkv * G, 1, D)
        for r in range(B):
            s, start, step = slots[r], W - seq_lens[slots[r]], steps[r]
            torch.testing.assert_close(suffix_keys[layer, r, :, :, step], k[r, :, 0].float())  # written at its step
            pk = keys[layer, s, :, :, start:start + lens[r]].permute(2, 0, 1)  # (n, Hkv, D)
            pv = values[layer, s, :, :, start:start + lens[r]].permute(2, 0, 1)
            all_k = torch.cat([pk, suffix_keys[layer, r, :, :, :step + 1].permute(2, 0, 1)])
            all_v = torch.cat([pv, suffix_values[layer, r, :, :step + 1].transpose(0, 1)])
            torch.testing.assert_close(out[r, :, 0].float(), naive_attention(q[r, :, 0], all_k, all_v),
                                       atol=tol, rtol=tol)


@pytest.fixture(scope="module")
def prompts(smol):
    _, tokenizer = smol
    texts = ["<|im_start|>user\nNina has 14 shells. She finds 5 more. How many now?<|im_end|>\n<|im_start|>assistant\n",
             "<|im_start|>user\nWhat is 12 + 30? Answer briefly.<|im_end|>\n<|im_start|>assistant\n"]
    return [tokenizer(t, add_special_tokens=False).input_ids for t in texts]


def response_batch(prompts, groups, tokenizer):
    samples = [s for g in groups for s in g]
    ids, attn, resp, P = pad_episodes([p for p, g in zip(prompts, groups) for _ in g], [s.token_ids for s in samples],
                                      pad_id=tokenizer.pad_token_id)
    return {"input_ids": ids, "attention_mask": attn, "response_mask": resp}, P, samples


def loop_prefix_layout(*, slots, lens, cache, heads_per_kv):
    """prefix_layout as it was written before it was vectorised (a row at a time): the reference it must equal."""
    s0, s1, B = min(slots), max(slots) + 1, len(slots)
    members = [[] for _ in range(s1 - s0)]
    for r, s in enumerate(slots):
        members[s - s0].append(r)
    R, W = max(map(len, members)), cache["width"]
    c0 = min(W - cache["lens"][s] for s in range(s0, s1))
    gather, row_place = torch.full((s1 - s0, R), B), torch.empty(B, dtype=torch.long)
    allowed = torch.zeros(s1 - s0, R, W - c0, dtype=torch.bool)
    allowed[:, :, -1] = True
    for p, rows in enumerate(members):
        first = W - cache["lens"][s0 + p] - c0
        for j, r in enumerate(rows):
            gather[p, j], row_place[r] = r, p * R + j
            allowed[p, j] = False
            allowed[p, j, first:first + lens[r]] = True
    return {"c0": c0, "gather": gather, "row_place": row_place, "allowed": allowed}


@pytest.mark.parametrize("seed", range(6))
def test_prefix_layout_equals_the_row_by_row_reference(seed):
    g = torch.Generator().manual_seed(seed)
    places, W = 7, 40
    cache = {"keys": torch.zeros(2, places, 2, 4, W), "width": W,
             "lens": [int(x) for x in torch.randint(0, W + 1, (places,), generator=g)]}
    slots = [int(x) for x in torch.randint(1, places, (int(torch.randint(1, 60, (1,), generator=g)),), generator=g)]
    slots = [s for s in slots if cache["lens"][s] > 0] or [max(range(places), key=cache["lens"].__getitem__)]
    lens = [int(torch.randint(1, cache["lens"][s] + 1, (1,), generator=g)) for s in slots]
    layout = prefix_layout(slots=slots, lens=lens, cache=cache, heads_per_kv=3)
    ref = loop_prefix_layout(slots=slots, lens=lens, cache=cache, heads_per_kv=3)
    S, R = ref["gather"].shape
    assert layout["c0"] == ref["c0"] and torch.equal(layout["gather"], ref["gather"])
    assert torch.equal(layout["row_place"], ref["row_place"])
    assert torch.equal(layout["bias"].view(S, 2, R, 3, -1)[:, 0, :, 0] == 0, ref["allowed"])


@pytest.mark.parametrize("kind", ["hf", "generate"])
def test_sampler_logprobs_are_the_trainers_in_fp32(smol, prompts, kind):
    """Each sampled token's log-prob as the sampler reports it equals the trainer's under the same distribution (the
    sampling temperature's softmax over the top-p nucleus) when both run in fp32: the mismatch metrics start from
    zero. The full softmax is a different number (by -log of the nucleus mass)."""
    model, tokenizer = smol
    sampler = (HFSampler if kind == "hf" else GenerateSampler)(model, tokenizer)
    groups = sampler.sample(prompts, n=2, temperature=0.6, top_p=0.9, max_new_tokens=20, seed=3)
    batch, P, samples = response_batch(prompts, groups, tokenizer)
    assert all(len(s.logprobs) == len(s.token_ids) for s in samples)
    trainer, _, log_mass = batch_logprobs(Scorer(model), batch, P, groups=micro_batches(len(samples), size=4),
                                          temperature=0.6, top_p=0.9)
    mine = pad_rows([torch.tensor(s.logprobs) for s in samples], batch["response_mask"].shape[1])
    gap = sampler_mismatch(trainer_logprobs=trainer - log_mass, sampler_logprobs=mine, mask=batch["response_mask"])
    assert gap["mismatch_abs_logp"] < 1e-3 and gap["mismatch_ratio_out"] == 0, gap
    full = sampler_mismatch(trainer_logprobs=trainer, sampler_logprobs=mine, mask=batch["response_mask"])
    assert full["mismatch_abs_logp"] > 3 * gap["mismatch_abs_logp"] + 1e-3, (full, gap)


@pytest.mark.slow  # the real SmolLM2's forward and backward in two dtypes
def test_bf16_sampler_copy_sync_and_mismatch(smol, prompts):
    """The bf16 sampler decodes from its own bf16 copy, which sync refreshes from the fp32 policy; its prefix-reuse
    path gives the tokens of a fresh prefill; its log-probs differ from the fp32 trainer's by a small, measured
    amount."""
    model, tokenizer = smol
    sampler = HFSampler(model, tokenizer, dtype=torch.bfloat16)
    assert sampler.model is not model and next(sampler.model.parameters()).dtype == torch.bfloat16
    assert next(model.parameters()).dtype == torch.float32  # the policy itself is untouched
    groups = sampler.sample(prompts, n=2, temperature=0.6, top_p=0.9, max_new_tokens=24, seed=3)
    batch, P, samples = response_batch(prompts, groups, tokenizer)
    trainer, _, log_mass = batch_logprobs(Scorer(model), batch, P, groups=micro_batches(len(samples), size=4),
                                          temperature=0.6, top_p=0.9)
    mine = pad_rows([torch.tensor(s.logprobs) for s in samples], batch["response_mask"].shape[1])
    gap = sampler_mismatch(trainer_logprobs=trainer - log_mass, sampler_logprobs=mine, mask=batch["response_mask"])
    assert 1e-4 < gap["mismatch_abs_logp"] < 0.1 and gap["mismatch_ratio_out"] < 0.05, gap

    seq = prompts[1] + tokenizer("12 + 30 = 42.\nSo the answer is 42.", add_special_tokens=False).input_ids
    lens = [len(prompts[1]), len(prompts[1]) + 4, len(prompts[1]) + 9]
    fresh = HFSampler(model, tokenizer, dtype=torch.bfloat16, reuse_prefixes=False)
    a = sampler.sample_prefixes([seq] * 3, lens, n=3, temperature=0.6, top_p=0.9, max_new_tokens=10, seed=5)
    b = fresh.sample_prefixes([seq] * 3, lens, n=3, temperature=0.6, top_p=0.9, max_new_tokens=10, seed=5)
    assert [[s.token_ids for s in g] for g in a] == [[s.token_ids for s in g] for g in b]

    policy = copy.deepcopy(model)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.01 * torch.randn_like(p))
    sampler.sync(policy)
    for (name, mine_p), theirs in zip(sampler.model.named_parameters(), policy.parameters()):
        assert torch.equal(mine_p, theirs.to(torch.bfloat16)), name


def test_bf16_greedy_follows_a_bf16_forward(smol, prompts):
    """Greedy bf16 decoding (KV caches, shared-prefix attention, sampling) against full forward passes of the same
    bf16 weights: the log-probs agree closely and so do most tokens (exact ties can flip between kernels)."""
    model, tokenizer = smol
    sampler = HFSampler(model, tokenizer, dtype=torch.bfloat16)
    out = sampler.sample(prompts, n=1, temperature=0.0, top_p=1.0, max_new_tokens=16)
    for prompt, group in zip(prompts, out):
        s = group[0]
        with torch.no_grad():
            logits = sampler.model(torch.tensor([prompt + s.token_ids])).logits[0, len(prompt) - 1:-1].float()
        reference = torch.log_softmax(logits, -1)
        forward_logp = reference[torch.arange(len(s.token_ids)), torch.tensor(s.token_ids)]
        assert (forward_logp - torch.tensor(s.logprobs)).abs().mean() < 0.05
        agree = (reference.argmax(-1) == torch.tensor(s.token_ids)).float().mean()
        assert agree >= 0.85, agree


def test_tis_weights_and_weighted_loss_by_hand():
    old = torch.tensor([[math.log(0.5), math.log(0.2), math.log(0.9)]])
    sampler = torch.tensor([[math.log(0.25), math.log(0.4), math.log(0.3)]])
    w = tis_weights(old_logprobs=old, sampler_logprobs=sampler, cap=2.5)
    torch.testing.assert_close(w, torch.tensor([[2.0, 0.5, 2.5]]))  # 0.5/0.25, 0.2/0.4, 0.9/0.3 = 3 capped
    logp = torch.log(torch.tensor([[0.6, 0.2, 0.9]]))
    adv, mask = torch.tensor([[1.0, -1.0, 2.0]]), torch.ones(1, 3)
    kwargs = dict(logprobs=logp, old_logprobs=old, ref_logprobs=old, advantages=adv, mask=mask, clip=0.2, kl_coef=0.0)
    plain, _ = ppo_loss(**kwargs)
    weighted, _ = ppo_loss(**kwargs, tis_weights=w)
    ratio = torch.tensor([1.2, 1.0, 1.0])  # 0.6 / 0.5 sits on the clip edge
    torch.testing.assert_close(plain, -(ratio * adv[0]).mean())
    torch.testing.assert_close(weighted, -(w[0] * ratio * adv[0]).mean())


def test_sampler_mismatch_by_hand():
    trainer = torch.log(torch.tensor([[0.5, 0.2, 0.9, 0.1]]))
    sampler = torch.log(torch.tensor([[0.5, 0.5, 0.3, 0.7]]))
    mask = torch.tensor([[1, 1, 1, 0]])
    gap = sampler_mismatch(trainer_logprobs=trainer, sampler_logprobs=sampler, mask=mask)
    r = torch.tensor([1.0, 0.4, 3.0])  # pi_trainer / pi_sampler on the three real tokens
    assert gap["mismatch_abs_logp"] == pytest.approx(r.log().abs().mean().item(), abs=1e-6)
    assert gap["mismatch_kl"] == pytest.approx((r - 1 - r.log()).mean().item(), abs=1e-6)
    assert gap["mismatch_ratio_out"] == pytest.approx(2 / 3)  # 0.4 and 3.0 are outside [0.5, 2]
