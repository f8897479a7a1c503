"""The paper's PPO baseline critic: a separate value network (`--estimator critic`, `--critic separate`, the default).

It is a second copy of the starting model (`--model`, like the policy and the reference) without its output layer,
with a linear value head on the last hidden state:

    V(s_t) = w . h_t + b        h_t: the critic trunk's last hidden state at the last token of state s_t

The head starts at zero (w = 0, b = 0: every V is 0 at first, as `--critic head`'s; the official code draws w from
a normal with std 1/sqrt(H + 1), a departure docs/critic.md explains). The critic has its own AdamW
(`--value-lr`, default `--lr` as the official configuration; the policy's warmup and decay) and is trained by the
clipped value loss alone (ppo.value_loss, `--value-clip`), epochs x minibatches of the same batch as the policy's
update; no gradient of it reaches the policy, and the policy's loss carries no value term. Section 4 of train.py asks
it for V before every response token (`critic_values`); section 6 trains it after the policy (`critic_update`).
`--critic head` is the ablation this project used before: a value head on the policy's own trunk, whose loss
(x `--vf-coef`) flows into the policy's weights (ablations/critic_head.py).

Compute as the policy's: bf16 under autocast over fp32 master weights (the head in fp32); DDP or FSDP2 under torchrun
(dist.wrap); saved inside each checkpoint as ckpt-*/critic/, a Hugging Face folder (safetensors) plus
value_head.safetensors (checkpoint.save_critic), loaded without running code.

Shapes: B = episodes, P = prompt columns (left-padded), R = response columns, T = P + R, H = hidden size.
"""
import math
from dataclasses import dataclass
from pathlib import Path

import torch

import dist
from model import autocast, resolve_model
from ppo import make_optimizer, minibatch_groups, minibatch_tokens, trim, value_loss
from runlog import pause_point

HEAD_FILE = "value_head.safetensors"  # beside the trunk's HF files in ckpt-*/critic/


class Critic(torch.nn.Module):
    """A decoder trunk (a transformers base model: hidden states, no output layer) and a linear value head."""

    def __init__(self, trunk, head: torch.nn.Linear, *, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.trunk, self.head, self.dtype = trunk, head, dtype

    def decoder_layers(self):
        """The trunk's decoder layers: FSDP2's units (dist.wrap)."""
        return self.trunk.layers

    def forward(self, input_ids, attention_mask, *, response_start: int):
        """V of the state before every response token (B, R): values[:, t] from the hidden state at the token before
        response token t. input_ids, attention_mask (B, T), the prompt left-padded to P = response_start columns."""
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # (B, T) real positions despite padding
        with autocast(input_ids.device, self.dtype):
            hidden = self.trunk(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                use_cache=False).last_hidden_state[:, response_start - 1:-1]  # (B, R, H)
        return self.head(hidden.float()).squeeze(-1)  # (B, R), the head in fp32


def load_critic(folder: str, *, device: torch.device, dtype: torch.dtype, trust_remote_code: bool = False) -> Critic:
    """The critic from a model folder: its trunk (fp32 master weights), and the head from value_head.safetensors when
    the folder has one (a checkpoint's critic/), else a zero head (a new critic from --model)."""
    from safetensors.torch import load_file
    from transformers import AutoModel
    try:
        trunk = AutoModel.from_pretrained(folder, dtype=torch.float32, trust_remote_code=trust_remote_code)
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise SystemExit(f"error: critic: could not load {folder} ({first[:200]})") from None
    head = torch.nn.Linear(trunk.config.hidden_size, 1)
    torch.nn.init.zeros_(head.weight)
    torch.nn.init.zeros_(head.bias)
    saved = Path(folder) / HEAD_FILE
    if saved.is_file():
        try:
            head.load_state_dict(load_file(saved))  # safetensors: plain tensors, no code
        except Exception as e:
            raise SystemExit(f"error: {saved}: not a value head this program wrote ({type(e).__name__})") from None
    return Critic(trunk, head, dtype=dtype).to(device)


@dataclass
class SeparateCritic:
    """What train.py holds of a separate critic: the Critic (`model`), the module that trains it (`module`: the model,
    or its DDP / FSDP2 wrapper), its AdamW and schedule, and its learning rate (--value-lr)."""
    model: Critic
    module: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object
    lr: float


def open_critic(cfg, *, source: Path | None, device: torch.device, dtype: torch.dtype) -> SeparateCritic | None:
    """train.py's critic with --critic separate (else None): from the checkpoint being resumed (source/critic) or a
    fresh copy of --model, wrapped for the ranks, with its own AdamW over the same number of steps as the policy's."""
    if cfg.critic != "separate":
        return None
    folder = str(source / "critic") if source is not None else resolve_model(cfg.model)
    model = load_critic(folder, device=device, dtype=dtype, trust_remote_code=cfg.trust_remote_code)
    module = dist.wrap(model, fsdp=cfg.fsdp)  # before the optimizer: FSDP2 replaces the parameters by shards
    optimizer, scheduler = make_optimizer([{"params": model.parameters(), "lr": cfg.value_lr}],
                                          weight_decay=cfg.weight_decay, total_steps=cfg.total_steps,
                                          warmup_ratio=cfg.warmup_ratio, decay=cfg.lr_decay)
    return SeparateCritic(model, module, optimizer, scheduler, cfg.value_lr)


@torch.no_grad()
def critic_values(critic: SeparateCritic, batch: dict, P: int, *, groups: list[torch.Tensor]) -> torch.Tensor:
    """The critic's V (B, R) before every response token of the batch, micro-batch by micro-batch (`groups`)."""
    device = next(critic.module.parameters()).device
    critic.module.eval()
    out = torch.zeros(batch["response_mask"].shape)  # (B, R)
    for idx in groups:
        mb, p = trim(batch, idx, P)
        v = critic.module(mb["input_ids"].to(device), mb["attention_mask"].to(device), response_start=p)  # (b, r)
        out[idx, :v.shape[1]] = v.float().cpu()
    return out


def value_update(critic: SeparateCritic, batch: dict, P: int, *, groups: list[torch.Tensor], epochs: int,
                 minibatch_size: int, value_clip: float, max_grad_norm: float) -> dict:
    """Epochs x minibatches of AdamW steps on the clipped value loss, minibatches as ppo.ppo_update makes them (this
    rank's minibatch_size; the loss a token mean over the global minibatch, gradients summed over ranks).
    batch: input_ids, attention_mask (B, T); response_mask, old_values, returns (B, R). Returns mean stats over the
    steps: value_loss, value_clipfrac, value_grad_norm."""
    device = next(critic.module.parameters()).device
    critic.module.train()
    minibatches = minibatch_groups(groups, minibatch_size)
    totals, steps, skipped = {}, 0, 0
    for _ in range(epochs):
        for m in torch.randperm(len(minibatches)).tolist():
            n_tokens, acc = minibatch_tokens(batch, minibatches[m]), {}
            for j, idx in enumerate(minibatches[m]):
                mb, p = trim(batch, idx, P)
                mb = {k: v.to(device) for k, v in mb.items()}
                with dist.sync_gradients(critic.module, j == len(minibatches[m]) - 1):  # all-reduce on the last one
                    values = critic.module(mb["input_ids"], mb["attention_mask"], response_start=p)  # (b, r)
                    loss, stats = value_loss(values=values, old_values=mb["old_values"], returns=mb["returns"],
                                             mask=mb["response_mask"], value_clip=value_clip)
                    weight = mb["response_mask"].sum().item() / n_tokens  # token-mean over the global minibatch
                    (loss * weight * dist.world()).backward()
                for k, v in stats.items():
                    acc[k] = acc.get(k, 0.0) + v * weight
            acc = dict(zip(acc, dist.all_sum(torch.tensor(list(acc.values()))).tolist()))  # global token means
            if not math.isfinite(acc["value_loss"]):  # as the policy's update: a step that would poison the weights
                critic.optimizer.zero_grad(set_to_none=True)
                skipped += 1
                continue
            acc["value_grad_norm"] = torch.nn.utils.clip_grad_norm_(critic.model.parameters(), max_grad_norm).item()
            critic.optimizer.step()
            critic.scheduler.step()
            critic.optimizer.zero_grad(set_to_none=True)
            steps += 1
            pause_point("critic", critic.scheduler.last_epoch)  # the crash test's: killed inside the critic's update
            for k, v in acc.items():
                totals[k] = totals.get(k, 0.0) + v
    return {**{k: v / max(steps, 1) for k, v in totals.items()}, "value_steps": steps, "value_skipped": skipped}


def critic_update(critic: SeparateCritic | None, batch: dict, P: int, *, groups: list[torch.Tensor], cfg) -> dict:
    """train.py's section 6, second half: with --critic separate, the critic's value update on the batch the policy
    just trained on (value_update); nothing otherwise."""
    if critic is None:
        return {}
    return value_update(critic, batch, P, groups=groups, epochs=cfg.epochs,
                        minibatch_size=cfg.minibatch_size // dist.world(), value_clip=cfg.value_clip,
                        max_grad_norm=cfg.max_grad_norm)
