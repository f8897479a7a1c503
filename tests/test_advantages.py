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


def test_silent_responses_marks_the_groups_with_one_outcome():
    from advantages import silent_responses
    assert silent_responses(rewards=[1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0], groups=[0, 0, 1, 1, 2, 2, 3]) == [
        False, False, True, True, True, True, True]


def test_in_group_units_divides_by_the_sd_of_what_the_groups_vines_saw():
    """p = the mean of a group's state values; each of its advantages / (sqrt(p (1 - p)) + 1e-4); a group whose
    vines found nothing keeps its zeros."""
    from advantages import in_group_units
    values = [[0.0, 0.5, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]  # two responses of group 0, one of group 1
    advantages = [torch.tensor([0.5, -0.5]), torch.tensor([0.0, 0.0]), torch.tensor([0.0])]
    out = in_group_units(advantages, values=values, groups=[0, 0, 1])
    p = 0.5 / 4
    assert torch.allclose(out[0], torch.tensor([0.5, -0.5]) / ((p * (1 - p)) ** 0.5 + 1e-4))
    assert torch.equal(out[1], torch.zeros(2)) and torch.equal(out[2], torch.zeros(1))


def vines_where_cfg(where: str):
    from config import parse_config
    return parse_config(["--device", "cpu", "--estimator", "vine", "--vines-where", where, "--no-whiten"])


def test_vines_where_silent_gives_mixed_groups_grpo_and_silent_ones_their_vines(monkeypatch):
    """values_for asks vines only for the silent groups' responses; advantages_for gives a mixed group grpo's
    advantages and a silent group its step advantages in grpo's units (in_group_units); with `all` every response
    gets its vines' (the paper)."""
    from types import SimpleNamespace
    import advantages as adv
    asked = []

    def scripted_values(*, responses, rewards, **_):
        asked.append(list(rewards))
        return [[0.0, 1 / 3, 0.0] if r == 0 else [1.0, 1.0, 0.0] for r in rewards], {}
    monkeypatch.setattr(adv, "estimate_values", scripted_values)
    monkeypatch.setattr(adv, "step_token_starts", lambda *a, **k: [0, 2])
    rewards, groups = [1.0, 0.0, 0.0, 0.0], [0, 0, 1, 1]  # group 0 mixed, group 1 all wrong
    samples = [SimpleNamespace(token_ids=[5] * 4, text="a\nb", logprobs=[0.0] * 4) for _ in rewards]
    episodes = SimpleNamespace(samples=samples, prompts=[[1]] * 4, responses=[[5] * 4] * 4, answers=["1"] * 4,
                               groups=groups)
    batch = {"response_mask": torch.ones(4, 4)}
    cfg = vines_where_cfg("silent")
    values, starts, _ = adv.values_for("vine", episodes=episodes, rewards=rewards, batch=batch, P=1, micro=[],
                                       sampler=None, scorer=None, tokenizer=None, cfg=cfg, seed=0)
    assert asked == [[0.0, 0.0]] and values[:2] == [None, None]
    out = adv.advantages_for("vine", values=values, starts=starts, rewards=rewards, episodes=episodes, batch=batch,
                             cfg=cfg)
    grpo = adv.group_baseline_advantages(rewards=rewards, groups=groups, lengths=[4] * 4, kind="grpo")
    assert torch.equal(out[0], grpo[0]) and torch.equal(out[1], grpo[1]) and out[0][0] > 0 > out[1][0]
    p = 1 / 6  # the mean of group 1's state values: 0 and 1/3 for each of its two responses
    step = torch.tensor([1 / 3, 1 / 3, -1 / 3, -1 / 3]) / ((p * (1 - p)) ** 0.5 + 1e-4)  # steps of 2 tokens each
    assert torch.allclose(out[2], step) and torch.allclose(out[3], step)
    asked.clear()
    values, starts, _ = adv.values_for("vine", episodes=episodes, rewards=rewards, batch=batch, P=1, micro=[],
                                       sampler=None, scorer=None, tokenizer=None, cfg=vines_where_cfg("all"), seed=0)
    assert asked == [rewards] and None not in values

