"""gae against a plain reference loop; token advantages; whitening."""
import math

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


def test_vine_responses_are_decided_on_the_others_of_the_group():
    """A response gets vines where the other responses of its group all got one reward: every response of a silent
    group, the one response that alone differs, a group of one; none where the others differ among themselves."""
    from ablations.silent_groups import vine_responses
    rewards = [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0]
    groups = [0, 0, 0, 1, 1, 1, 2, 2, 2, 2, 3]
    assert vine_responses(rewards=rewards, groups=groups) == [True, False, False, True, True, True,
                                                              False, False, False, False, True]
    assert vine_responses(rewards=[1.0, 0.0], groups=[0, 0]) == [True, True]  # each one's other agrees with itself


def exact_toy(q: float, s: tuple[float, float], table: list[list[float]]):
    """A two-step response on one prompt: action a (P(a = 1) = q, logit theta_1), then b (P(b = 1 | a) = s[a], logit
    theta_2a), reward table[a][b]. Returns the trajectories (a, b, probability, reward, score function (3,)), the exact
    state values V(prompt) and V(a), and the true policy gradient of E[r] (3,)."""
    trajectories = []
    for a in (0, 1):
        for b in (0, 1):
            prob = (q if a else 1 - q) * (s[a] if b else 1 - s[a])
            score = torch.zeros(3, dtype=torch.float64)
            score[0], score[1 + a] = a - q, b - s[a]
            trajectories.append((a, b, prob, table[a][b], score))
    value_a = [s[a] * table[a][1] + (1 - s[a]) * table[a][0] for a in (0, 1)]
    value_0 = (1 - q) * value_a[0] + q * value_a[1]
    gradient = sum(prob * r * score for _, _, prob, r, score in trajectories)
    return trajectories, value_0, value_a, gradient


def expected_vine_update(toy, select, *, n: int = 8, K: int = 9):
    """The expected update of response 0 of a group of n under a vine rule: over its trajectory and the others'
    rewards (2^(n-1) patterns, exact), `select(rewards, groups)[0]` times its step advantages (vine_advantages over
    the exact values, in_group_units) times the score functions of its two steps."""
    from itertools import product
    from ablations.silent_groups import in_group_units
    from advantages import vine_advantages
    trajectories, value_0, value_a, _ = toy
    p = sum(prob * r for _, _, prob, r, _ in trajectories)
    update = torch.zeros(3, dtype=torch.float64)
    for a, b, prob, r, score in trajectories:
        chance = 0.0  # that response 0 is selected, over the others' rewards
        for others in product((0.0, 1.0), repeat=n - 1):
            if select([r, *others], [0] * n)[0]:
                chance += math.prod(p if o else 1 - p for o in others)
        steps = vine_advantages(values=[[value_0, value_a[a], 0.0]], rewards=[r], token_steps=[[0, 1]], gamma=1.0,
                                lam=0.0)
        steps = in_group_units(steps, prompt_values=[value_0], K=K)[0].double()  # (2,) one token per step
        step_scores = torch.zeros(2, 3, dtype=torch.float64)
        step_scores[0, 0], step_scores[1, 1 + a] = score[0], score[1 + a]
        update += prob * chance * (steps @ step_scores)
    return update


def test_the_silent_rule_keeps_the_expected_update_on_the_policy_gradient():
    """On an exact two-step toy (five hard prompts, groups of 8, exact values): deciding vines on the other responses
    (vine_responses) gives an expected update parallel to the true policy gradient; deciding on the whole group's
    silence, the response's own reward included (the rule before), does not: its own reward selects its credit."""
    from ablations.silent_groups import vine_responses
    whole_group = lambda rewards, groups: [len(set(rewards)) == 1] * len(rewards)  # noqa: E731
    prompts = [(0.3, (0.1, 0.5), [[0, 1], [0, 1]]), (0.2, (0.2, 0.6), [[0, 0], [0, 1]]),
               (0.5, (0.05, 0.3), [[0, 1], [0, 1]]), (0.1, (0.5, 0.9), [[0, 0], [1, 1]]),
               (0.1, (0.1, 0.6), [[0, 1], [1, 0]])]
    cosine = lambda x, y: float(x @ y / (x.norm() * y.norm()))  # noqa: E731
    old = []
    for q, s, table in prompts:
        toy = exact_toy(q, s, table)
        gradient = toy[3]
        assert cosine(expected_vine_update(toy, lambda r, g: vine_responses(rewards=r, groups=g)), gradient) > 0.999
        old.append(cosine(expected_vine_update(toy, whole_group), gradient))
    assert min(old) < 0.99, old


def vines_where_cfg(where: str):
    from config import parse_config
    return parse_config(["--device", "cpu", "--estimator", "vine", "--vines-where", where, "--no-whiten"])


def test_vines_where_silent_gives_vines_where_the_others_agree_and_grpo_elsewhere(monkeypatch):
    """values_for asks vines only for the responses whose group's others agree (vine_responses); advantages_for gives
    them their step advantages in grpo's units (in_group_units: their prompt state's value, held half a vine from 0)
    and the other responses grpo's advantages; with `all` every response gets its vines' (the paper)."""
    from types import SimpleNamespace
    import advantages as adv
    asked = []

    def scripted_values(*, responses, rewards, **_):
        asked.append(list(rewards))
        return [[0.0, 1 / 3, 0.0] if r == 0 else [0.5, 1.0, 0.0] for r in rewards], {}
    monkeypatch.setattr(adv, "estimate_values", scripted_values)
    monkeypatch.setattr(adv, "step_token_starts", lambda *a, **k: [0, 2])
    rewards = [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0]  # group 0: one right; 1: all wrong; 2: two each
    groups = [0, 0, 0, 1, 1, 1, 2, 2, 2, 2]
    n = len(rewards)
    samples = [SimpleNamespace(token_ids=[5] * 4, text="a\nb", logprobs=[0.0] * 4) for _ in rewards]
    episodes = SimpleNamespace(samples=samples, prompts=[[1]] * n, responses=[[5] * 4] * n, answers=["1"] * n,
                               groups=groups)
    batch = {"response_mask": torch.ones(n, 4)}
    cfg = vines_where_cfg("silent")
    values, starts, _ = adv.values_for("vine", episodes=episodes, rewards=rewards, batch=batch, P=1, micro=[],
                                       sampler=None, scorer=None, tokenizer=None, cfg=cfg, seed=0)
    vined = [0, 3, 4, 5]
    assert asked == [[1.0, 0.0, 0.0, 0.0]] and [i for i, v in enumerate(values) if v is not None] == vined
    out = adv.advantages_for("vine", values=values, starts=starts, rewards=rewards, episodes=episodes, batch=batch,
                             cfg=cfg)
    grpo = adv.group_baseline_advantages(rewards=rewards, groups=groups, lengths=[4] * n, kind="grpo")
    assert all(torch.equal(out[i], grpo[i]) for i in range(n) if i not in vined) and out[6][0] > 0 > out[8][0]
    right = torch.tensor([0.5, 0.5, 0.0, 0.0]) / (0.5 + 1e-4)  # p = 0.5; steps of 2 tokens each
    p = 1 / 18  # the all-wrong prompt's value 0, held half a vine (K = 9) from 0
    wrong = torch.tensor([1 / 3, 1 / 3, -1 / 3, -1 / 3]) / ((p * (1 - p)) ** 0.5 + 1e-4)
    assert torch.allclose(out[0], right) and all(torch.allclose(out[i], wrong) for i in (3, 4, 5))
    asked.clear()
    values, starts, _ = adv.values_for("vine", episodes=episodes, rewards=rewards, batch=batch, P=1, micro=[],
                                       sampler=None, scorer=None, tokenizer=None, cfg=vines_where_cfg("all"), seed=0)
    assert asked == [rewards] and None not in values



def test_vine_temperature_is_the_rollouts_unless_set():
    """--vine-temperature: 0 keeps the paper's (the rollouts' temperature); a value above 0 replaces it; below 0 is
    refused at parse time."""
    from ablations.vine_temperature import vine_temperature
    from config import parse_config
    assert vine_temperature(rollout=0.6, vine=0.0) == 0.6 and vine_temperature(rollout=0.6, vine=0.3) == 0.3
    assert parse_config(["--device", "cpu"]).vine_temperature == 0.0
    with pytest.raises(SystemExit):
        parse_config(["--device", "cpu", "--vine-temperature", "-1"])
