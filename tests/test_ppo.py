"""ppo_loss against a direct per-token computation, padding helpers, and one real update step."""
import math

import pytest
import torch

from ppo import pad_episodes, pad_rows, ppo_loss, ppo_update, trim


def direct_loss(logp, old, ref, adv, mask, clip, kl_coef):
    total, n, clipped = 0.0, 0, 0
    for b in range(len(logp)):
        for t in range(len(logp[b])):
            if not mask[b][t]:
                continue
            ratio = math.exp(logp[b][t] - old[b][t])
            surrogate = min(ratio * adv[b][t], max(min(ratio, 1 + clip), 1 - clip) * adv[b][t])
            d = ref[b][t] - logp[b][t]
            kl = min(max(math.exp(d) - d - 1, 0.0), 10.0)
            total += -surrogate + kl_coef * kl
            n += 1
            clipped += abs(ratio - 1) > clip
    return total / n, clipped / n


def test_ppo_loss_matches_direct_computation():
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(3, 5, generator=g) * 3
    old = logp + (torch.rand(3, 5, generator=g) - 0.5) * 0.8  # some ratios outside [0.8, 1.2]
    ref = logp + (torch.rand(3, 5, generator=g) - 0.5)
    adv = torch.randn(3, 5, generator=g)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]])
    loss, stats = ppo_loss(logprobs=logp, old_logprobs=old, ref_logprobs=ref, advantages=adv, mask=mask,
                           clip=0.2, kl_coef=0.1)
    expected, clipfrac = direct_loss(logp.tolist(), old.tolist(), ref.tolist(), adv.tolist(), mask.tolist(), 0.2, 0.1)
    assert abs(loss.item() - expected) < 1e-5 and abs(stats["clipfrac"] - clipfrac) < 1e-6 and 0 < clipfrac < 1


def test_ppo_loss_gradient_sign():
    """With ratio 1 the surrogate's gradient pushes log-probs up where A > 0 and down where A < 0."""
    logp = torch.zeros(1, 2, requires_grad=True)
    loss, stats = ppo_loss(logprobs=logp, old_logprobs=torch.zeros(1, 2), ref_logprobs=torch.zeros(1, 2),
                           advantages=torch.tensor([[1.0, -1.0]]), mask=torch.ones(1, 2), clip=0.2, kl_coef=0.0)
    loss.backward()
    assert logp.grad[0, 0] < 0 < logp.grad[0, 1]  # gradient descent raises the first, lowers the second
    assert stats["ratio"] == 1.0 and stats["approx_kl"] == 0.0 and stats["kl_ref"] == 0.0


def test_padding_and_trim():
    ids, attn, resp, P = pad_episodes([[5, 6, 7], [8]], [[1, 2], [3, 4, 9]], pad_id=0)
    assert P == 3 and ids.tolist() == [[5, 6, 7, 1, 2, 0], [0, 0, 8, 3, 4, 9]]
    assert attn.tolist() == [[1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1]] and resp.tolist() == [[1, 1, 0], [1, 1, 1]]
    batch = {"input_ids": ids, "attention_mask": attn, "response_mask": resp, "advantages": pad_rows(
        [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0, 5.0])], 3)}
    sub, p = trim(batch, torch.tensor([1]), P)
    assert p == 1 and sub["input_ids"].tolist() == [[8, 3, 4, 9]] and sub["advantages"].tolist() == [[3, 4, 5]]


def test_ppo_update_raises_logprob_of_advantaged_response(smol):
    """One real update on SmolLM2: the response with A > 0 becomes more likely, the one with A < 0 less."""
    import copy
    from model import Scorer
    from ppo import batch_logprobs, micro_batches
    model, tokenizer = smol
    policy = copy.deepcopy(model).requires_grad_(True)
    prompt = tokenizer("Q: 2+2?\nA:").input_ids
    good, bad = tokenizer(" 4").input_ids, tokenizer(" 5").input_ids
    ids, attn, resp, P = pad_episodes([prompt, prompt], [good, bad], pad_id=tokenizer.pad_token_id)
    batch = {"input_ids": ids, "attention_mask": attn, "response_mask": resp,
             "advantages": pad_rows([torch.ones(len(good)), -torch.ones(len(bad))], resp.shape[1])}
    groups = micro_batches(2, size=1)
    scorer = Scorer(policy)
    batch["old_logprobs"] = batch["ref_logprobs"] = batch_logprobs(scorer, batch, P, groups=groups, temperature=1.0)[0]
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-5)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    stats = ppo_update(Scorer(policy), optimizer, scheduler, batch, P, groups=groups, epochs=1, minibatch_size=2,
                       clip=0.2, kl_coef=1e-4, temperature=1.0)
    after = batch_logprobs(Scorer(policy), batch, P, groups=micro_batches(2, size=2), temperature=1.0)[0]
    assert stats["optimizer_steps"] == 1 and stats["skipped"] == 0 and stats["ratio"] == 1.0
    change = ((after - batch["old_logprobs"]) * resp).sum(1)  # change of each response's total log-prob
    assert change[0] > 0 > change[1]


def test_value_loss_is_clipped_like_ppo():
    from ppo import value_loss
    old = torch.tensor([[0.5, 0.5]])
    values = torch.tensor([[0.9, 0.55]], requires_grad=True)  # first moved beyond the 0.2 clip range, second within
    returns = torch.tensor([[1.0, 0.0]])
    loss, stats = value_loss(values=values, old_values=old, returns=returns, mask=torch.ones(1, 2), value_clip=0.2)
    # token 1: max((0.9-1)^2, (0.7-1)^2) = 0.09; token 2: max(0.55^2, 0.55^2) = 0.3025 -> 0.5 * mean
    assert loss.item() == pytest.approx(0.5 * (0.09 + 0.3025) / 2) and stats["value_clipfrac"] == 0.5
    loss.backward()
    assert values.grad[0, 0] == 0  # the clipped branch is the max: no gradient through the moved value
