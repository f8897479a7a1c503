"""--critic head: PPO's critic as a value head on the policy's own trunk, the ablation of the paper's separate critic
(critic.py, `--critic separate`, the default of `--estimator critic`).

    V(s_t) = w . h_t + b        h_t: the *policy's* last hidden state at the last token of state s_t

The head starts at zero (every V is 0 at first) and keeps fp32 master weights like the policy's. Its clipped value
loss, x `--vf-coef`, is added to the policy's loss, so its gradient flows into the policy's weights: the policy and
its critic share a trunk (the official code, like the paper, gives the critic a network of its own). It joins the
paper's path where train.setup opens it (`open_value_head`, one call); from there it travels as `value_head`:
model.Scorer returns its V from the policy's forward (advantages.values_for reads them), ppo.ppo_update adds its loss,
ppo.policy_optimizer gives it `--value-lr`, and checkpoint.save_checkpoint writes it as ckpt-*/value_head.pt (loaded
without running code: `load_value_head`).
"""
from pathlib import Path

import torch

from checkpoint import load_tensors


def new_value_head(model) -> torch.nn.Linear:
    """A zero-initialised value head for `model`'s trunk: final hidden state -> V, on the model's device."""
    head = torch.nn.Linear(model.config.hidden_size, 1)
    torch.nn.init.zeros_(head.weight)
    torch.nn.init.zeros_(head.bias)
    return head.to(device=model.device)


def load_value_head(source: Path | None, value_head):
    """The head's weights from a checkpoint folder's value_head.pt (weights only), before dist.wrap shards it."""
    if source is not None and value_head is not None:
        value_head.load_state_dict(load_tensors(source / "value_head.pt", "a value head"))


def open_value_head(policy, *, source: Path | None) -> torch.nn.Linear:
    """train.py's head: a new one on `policy`'s trunk, or the one saved in the checkpoint `source` being resumed."""
    head = new_value_head(policy)
    load_value_head(source, head)
    return head
