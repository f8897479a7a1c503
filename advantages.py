"""Advantages: GAE over step values, then one advantage per token.

Public API: gae(rewards, values, *, gamma, lam). rewards has shape (T,), values (T + 1,) with the terminal value last.
    delta_t = r_t + gamma * V_{t+1} - V_t,    A_t = sum_k (gamma * lam)^k delta_{t+k}
VinePPO (paper): gamma = 1, lam = 0, so A_i = r_i + V(s_{i+1}) - V(s_i). With lam = 1, A_t = return_t - V_t.

Shapes: T = steps of one response, L = tokens of one response, N = all response tokens of a batch.
"""
import torch


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


def vine_advantages(*, values: list[list[float]], rewards: list[float], token_steps: list[list[int]], gamma: float,
                    lam: float) -> list[torch.Tensor]:
    """Per-token advantages of each response from its MC step values (values[i]: T_i + 1 entries)."""
    out = []
    for v, r, token_step in zip(values, rewards, token_steps):
        step_adv = gae(step_rewards(len(v) - 1, r), torch.tensor(v, dtype=torch.float32), gamma=gamma, lam=lam)
        out.append(token_advantages(step_adv, token_step))  # (L,)
    return out


def whiten(advantages: list[torch.Tensor]) -> list[torch.Tensor]:
    """Normalise all response tokens of the batch together to mean 0, std 1."""
    flat = torch.cat(advantages)  # (N,)
    mean, std = flat.mean(), flat.std() if flat.numel() > 1 else torch.tensor(1.0)
    return [(a - mean) / (std + 1e-8) for a in advantages]
