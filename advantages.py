"""Advantages: GAE over step values, then one advantage per token.

Public API: gae(rewards, values, *, gamma, lam). rewards has shape (T,), values (T + 1,) with the terminal value last.
    delta_t = r_t + gamma * V_{t+1} - V_t,    A_t = sum_k (gamma * lam)^k delta_{t+k}
VinePPO (paper): gamma = 1, lam = 0, so A_i = r_i + V(s_{i+1}) - V(s_i). With lam = 1, A_t = return_t - V_t.

The baselines of the paper's comparison, all feeding the same PPO update (`--estimator`):
    critic: PPO's learned critic (critic.py), GAE over tokens (lam = 1: A_t = G - V_t) -> critic_advantages
    grpo:   one advantage per response, (r - mean) / std over the prompt's group  -> group_baseline_advantages
    rloo:   one advantage per response, r minus the mean of the group's others    -> group_baseline_advantages

Sections 4 and 5 of train.py are `values_for` and `advantages_for`: the only places that branch on --estimator.

Shapes: T = steps of one response, L = tokens of one response, N = all response tokens of a batch, B = responses of a
batch, R = response columns (right-padded).
"""
from functools import partial

import torch

import dist
from ablations import free_samples
from ablations.branching import policy_entropies
from ablations.silent_groups import silent_advantages, vine_responses
from ablations.vine_temperature import vine_temperature
from critic import critic_values
from ppo import batch_logprobs, pad_rows
from values import estimate_values, step_token_starts


def gae(rewards: torch.Tensor, values: torch.Tensor, *, gamma: float, lam: float) -> torch.Tensor:
    """Generalized advantage estimates (T,) from rewards (T,) and values (T + 1,)."""
    deltas = rewards + gamma * values[1:] - values[:-1]  # (T,)
    advantages = torch.zeros_like(deltas)  # (T,)
    running = 0.0
    for t in reversed(range(len(deltas))):
        running = deltas[t] + gamma * lam * running
        advantages[t] = running
    return advantages


def step_rewards(n_steps: int, reward: float) -> torch.Tensor:
    """(T,) zeros, except the last step, which carries the response's reward."""
    rewards = torch.zeros(n_steps)  # (T,)
    rewards[-1] = reward
    return rewards


def token_advantages(step_advantages: torch.Tensor, token_step: list[int]) -> torch.Tensor:
    """(L,) each token takes its step's advantage; token_step[t] is token t's step (EOS: the last step)."""
    return step_advantages[torch.tensor(token_step, dtype=torch.long)]  # (L,)


def token_step_index(n_tokens: int, starts: list[int]) -> list[int]:
    """For each response token, the index of its step (EOS and trailing tokens belong to the last step)."""
    index, step = [], 0
    for t in range(n_tokens):
        while step + 1 < len(starts) and t >= starts[step + 1]:
            step += 1
        index.append(step)
    return index


def vine_advantages(*, values: list[list[float]], rewards: list[float], token_steps: list[list[int]], gamma: float,
                    lam: float) -> list[torch.Tensor]:
    """Per-token advantages of each response from its MC step values (values[i]: T_i + 1 entries)."""
    out = []
    for v, r, token_step in zip(values, rewards, token_steps):
        step_adv = gae(step_rewards(len(v) - 1, r), torch.tensor(v, dtype=torch.float32), gamma=gamma, lam=lam)
        out.append(token_advantages(step_adv, token_step))  # (L,)
    return out


def critic_advantages(*, values: list[torch.Tensor], rewards: list[float], gamma: float, lam: float):
    """Token-level GAE from the value head's V (L,) per response; the reward sits on the last token.
    Returns (advantages, returns), lists of (L,) tensors; returns = advantages + V are the value targets."""
    advantages, returns = [], []
    for v, r in zip(values, rewards):
        adv = gae(step_rewards(len(v), r), torch.cat([v, torch.zeros(1)]), gamma=gamma, lam=lam)  # (L,)
        advantages.append(adv)
        returns.append(adv + v)
    return advantages, returns


def group_baseline_advantages(*, rewards: list[float], groups: list[int], lengths: list[int], kind: str):
    """One advantage per response, repeated over its `lengths[i]` tokens. groups[i] names response i's prompt.
    kind "grpo": (r - group mean) / (group std + 1e-4); kind "rloo": r - mean of the other responses of the group."""
    r = torch.tensor(rewards, dtype=torch.float32)  # (B,)
    g = torch.tensor(groups)  # (B,)
    out = []
    for i in range(len(r)):
        same = r[g == g[i]]  # the group's rewards, response i included
        if kind == "grpo":
            adv = (r[i] - same.mean()) / ((same.std() if len(same) > 1 else 0.0) + 1e-4)
        else:
            adv = r[i] - (same.sum() - r[i]) / max(len(same) - 1, 1) if len(same) > 1 else torch.tensor(0.0)
        out.append(torch.full((lengths[i],), float(adv)))
    return out


def whiten(advantages: list[torch.Tensor]) -> list[torch.Tensor]:
    """Normalise all response tokens of the batch together to mean 0, std 1 (under torchrun: of the global batch)."""
    flat = torch.cat(advantages).double()  # (N,)
    n, total, squares = dist.all_sum(torch.stack([torch.tensor(float(flat.numel())), flat.sum(), (flat ** 2).sum()]))
    mean = total / n
    std = ((squares - n * mean ** 2).clamp(min=0) / (n - 1)).sqrt() if n > 1 else torch.tensor(1.0)
    return [((a - mean) / (std + 1e-8)).float() for a in advantages]


def values_for(estimator: str, *, episodes, rewards: list[float], batch: dict, P: int, micro: list, sampler, scorer,
               tokenizer, cfg, seed: int, critic=None):
    """train.py's section 4. vine: split every response into steps and estimate the value of the state before each
    step from K vines (values.estimate_values). critic: the value of every response token, from the separate
    critic's forward (`critic`, critic.SeparateCritic) or with --critic head from the policy's forward pass that gives
    the old log-probs (kept in `batch` for the update). grpo / rloo: no values. The ablations each join at one line
    here: --step-split entropy:F (ablations/branching.py), --vines-where silent (ablations/silent_groups.py: the
    responses without vines get None), --free-samples (ablations/free_samples.py), --vine-temperature
    (ablations/vine_temperature.py).
    Returns (values, step starts (vine) or None, stats for the metrics line)."""
    if estimator == "vine":
        entropies = [None] * len(episodes.samples)
        if cfg.step_split.startswith("entropy:"):  # branch where the policy is least sure
            entropies = policy_entropies(scorer, batch, P, micro=micro, responses=episodes.responses,
                                         temperature=cfg.temperature, top_p=cfg.top_p)
        starts = [step_token_starts(s.token_ids, s.text, tokenizer=tokenizer, task=cfg.task, split=cfg.step_split,
                                    logprobs=s.logprobs, entropies=e) for s, e in zip(episodes.samples, entropies)]
        vined = list(range(len(starts)))  # the paper: every response gets vines
        if cfg.vines_where != "all":  # only where the group's others agree
            vined = [i for i, others_agree in enumerate(vine_responses(rewards=rewards, groups=episodes.groups))
                     if others_agree]
        estimate = estimate_values
        if cfg.free_samples != "off":  # the group's own responses as samples of a state's value too
            estimate = partial(free_samples.estimate_values, free_samples=cfg.free_samples)
        temperature = cfg.temperature  # the paper: vines at the rollouts' temperature
        if cfg.vine_temperature != 0:  # vines at a temperature of their own
            temperature = vine_temperature(rollout=cfg.temperature, vine=cfg.vine_temperature)
        pick = lambda items: [items[i] for i in vined]  # noqa: E731
        estimated, stats = estimate(
            sampler=sampler, prompts=pick(episodes.prompts), responses=pick(episodes.responses),
            step_starts=pick(starts), rewards=pick(rewards), answers=pick(episodes.answers), grader=cfg.grader,
            K=cfg.k, temperature=temperature, top_p=cfg.top_p, max_new_tokens=cfg.max_new_tokens,
            max_value_steps=cfg.max_value_steps or None, seed=seed, k_mode=cfg.k_mode, k_round=cfg.k_round,
            k_max=cfg.k_max, k_ci=cfg.k_ci)
        values = [None] * len(starts)  # None: a response without vines (--vines-where silent)
        for i, v in zip(vined, estimated):
            values[i] = v
        stats["steps_per_response"] = dist.mean(list(map(len, starts)))
        stats["value_mean"] = dist.mean([v for vs in estimated for v in vs[:-1]])
        return values, starts, stats
    if estimator == "critic":
        batch["old_logprobs"], token_values, batch["log_mass"] = batch_logprobs(
            scorer, batch, P, groups=micro, temperature=cfg.temperature, top_p=cfg.top_p)  # (B, R) each
        if critic is not None:
            token_values = critic_values(critic, batch, P, groups=micro)  # (B, R), no gradient into the policy
        values = [token_values[i, :len(r)] for i, r in enumerate(episodes.responses)]
        return values, None, {"value_mean": dist.mean(torch.cat(values).tolist())}
    return None, None, {}


def advantages_for(estimator: str, *, values, starts, rewards: list[float], episodes, batch: dict, cfg):
    """train.py's section 5. vine: GAE over the step values, every token of a step gets its step's advantage (with
    --vines-where silent: the vined responses their vines' in grpo's units, the others grpo's:
    ablations/silent_groups.py). critic: GAE over the token values (and the value targets, into `batch`). grpo /
    rloo: one advantage per response from its group's rewards. The advantages (whitened over the batch with
    --whiten) go into batch["advantages"] (B, R); returns the raw ones, one (L,) tensor per response, for the log."""
    responses, R = episodes.responses, batch["response_mask"].shape[1]
    if estimator == "vine":
        token_steps = [token_step_index(len(r), st) for r, st in zip(responses, starts)]
        vined = [i for i, v in enumerate(values) if v is not None]  # every response; --vines-where silent: theirs
        advantages = vine_advantages(values=[values[i] for i in vined], rewards=[rewards[i] for i in vined],
                                     token_steps=[token_steps[i] for i in vined], gamma=cfg.gamma, lam=cfg.lam)
        if cfg.vines_where != "all":  # the responses without vines: grpo's, from their group's contrast
            grpo = group_baseline_advantages(rewards=rewards, groups=episodes.groups,
                                             lengths=list(map(len, responses)), kind="grpo")
            advantages = silent_advantages(advantages, vined=vined, values=values, grpo=grpo, K=cfg.k)
    elif estimator == "critic":
        advantages, returns = critic_advantages(values=values, rewards=rewards, gamma=cfg.gamma, lam=cfg.lam)
        batch["old_values"], batch["returns"] = pad_rows(values, R), pad_rows(returns, R)  # (B, R) each
    else:
        advantages = group_baseline_advantages(rewards=rewards, groups=episodes.groups,
                                               lengths=list(map(len, responses)), kind=estimator)
    batch["advantages"] = pad_rows(whiten(advantages) if cfg.whiten else advantages, R)  # (B, R)
    return advantages
