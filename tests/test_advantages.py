"""gae against a plain reference loop; token advantages; whitening."""
import pytest
import torch

from advantages import (critic_advantages, gae, group_baseline_advantages, step_rewards, token_advantages,
                        vine_advantages, whiten)


def reference_gae(rewards, values, gamma, lam):
    """Textbook definition, written as plainly as possible: A_t = sum_k (gamma lam)^k delta_{t+k}."""
    T = len(rewards)
    deltas = [rewards[t] + gamma * values[t + 1] - values[t] for t in range(T)]
    return [sum((gamma * lam) ** k * deltas[t + k] for k in range(T - t)) for t in range(T)]


@pytest.mark.parametrize("gamma, lam", [(1.0, 0.0), (1.0, 1.0), (0.9, 0.95), (0.99, 0.5)])
def test_gae_matches_reference(gamma, lam):
    g = torch.Generator().manual_seed(0)
    rewards, values = torch.rand(7, generator=g), torch.rand(8, generator=g)
    values[-1] = 0.0
    expected = torch.tensor(reference_gae(rewards.tolist(), values.tolist(), gamma, lam))
    torch.testing.assert_close(gae(rewards, values, gamma=gamma, lam=lam), expected)


def test_lambda_zero_is_one_step_td_and_lambda_one_is_return_minus_value():
    rewards = step_rewards(4, 1.0)
    values = torch.tensor([0.2, 0.5, 0.4, 0.9, 0.0])
    td = gae(rewards, values, gamma=1.0, lam=0.0)
    torch.testing.assert_close(td, torch.tensor([0.3, -0.1, 0.5, 0.1]))  # V(s_{i+1}) + r_i - V(s_i)
    mc = gae(rewards, values, gamma=1.0, lam=1.0)
    torch.testing.assert_close(mc, 1.0 - values[:-1])  # return (1 for every step) minus value


def test_step_rewards_and_token_advantages():
    assert step_rewards(3, 1.0).tolist() == [0.0, 0.0, 1.0]
    adv = token_advantages(torch.tensor([0.5, -0.25]), [0, 0, 1, 1, 1])
    assert adv.tolist() == [0.5, 0.5, -0.25, -0.25, -0.25]


def test_vine_advantages_end_to_end():
    # Two steps: V(s0) = 0.25, V(s1) = 0.75, terminal 0, reward 1 -> A = [0.5, 0.25].
    out = vine_advantages(values=[[0.25, 0.75, 0.0]], rewards=[1.0], token_steps=[[0, 0, 1, 1]], gamma=1.0, lam=0.0)
    assert out[0].tolist() == [0.5, 0.5, 0.25, 0.25]


def test_whiten():
    out = whiten([torch.tensor([1.0, 2.0]), torch.tensor([3.0])])
    flat = torch.cat(out)
    assert abs(flat.mean().item()) < 1e-6 and abs(flat.std().item() - 1) < 1e-5
    assert torch.cat(whiten([torch.zeros(3)])).abs().max() == 0  # all-zero advantages stay zero


def test_grpo_and_rloo_one_advantage_per_response():
    rewards, groups, lengths = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0], [0, 0, 0, 0, 1, 1], [2, 3, 1, 2, 2, 1]
    grpo = group_baseline_advantages(rewards=rewards, groups=groups, lengths=lengths, kind="grpo")
    std = torch.tensor([1.0, 0.0, 0.0, 1.0]).std().item()  # group 0: mean 0.5
    assert [len(a) for a in grpo] == lengths
    assert grpo[0].tolist() == pytest.approx([0.5 / (std + 1e-4)] * 2) and grpo[1][0] == pytest.approx(-0.5 / (std + 1e-4))
    assert grpo[4].tolist() == [0.0, 0.0]  # all right: no signal
    rloo = group_baseline_advantages(rewards=rewards, groups=groups, lengths=lengths, kind="rloo")
    assert rloo[0].tolist() == pytest.approx([1 - 1 / 3] * 2) and rloo[1][0] == pytest.approx(0 - 2 / 3)
    assert rloo[5].tolist() == [0.0]


def test_critic_advantages_lambda_one_is_return_minus_value():
    values = [torch.tensor([0.2, 0.4, 0.9])]
    adv, ret = critic_advantages(values=values, rewards=[1.0], gamma=1.0, lam=1.0)
    torch.testing.assert_close(adv[0], torch.tensor([0.8, 0.6, 0.1]))
    torch.testing.assert_close(ret[0], torch.ones(3))  # the value targets: the return, 1 at every token
    adv0, _ = critic_advantages(values=values, rewards=[1.0], gamma=1.0, lam=0.0)
    torch.testing.assert_close(adv0[0], torch.tensor([0.2, 0.5, 0.1]))  # one-step TD over tokens
