"""AdamW's step on the policy's fp32 master weights: torch's default multi-tensor ("foreach") loop against its fused
kernel (`fused=True`, what train.py and sft.py use), on the same parameters, gradients and moments.

    python -m bench.adamw                      (about a minute on 2 cores)

Both optimizers start from the same state (one step taken, so both moments are nonzero), then step in alternation
(A B A B, the state restored before each; one untimed pair first); best of --repeats each. The updates they make are
compared too: the largest difference between the two optimizers' new weights, against the step's own size.
Last line: adamw_fused_vs_foreach=<seconds foreach / fused> max_update_diff=<...> max_update=<...>.
"""
import argparse
import copy

import torch

from bench.timing import best_time
from model import DEFAULT_MODEL, load_model


def restore(optimizer, kind: str, *, params, weights, state: dict):
    """Put `params` back to `weights` and load `state` into `optimizer`, with its own kind's flag (load_state_dict
    would otherwise take the saved foreach / fused flags)."""
    with torch.no_grad():
        for p, w in zip(params, weights):
            p.copy_(w)
    loaded = copy.deepcopy(state)
    loaded["param_groups"][0].update(foreach=kind == "foreach", fused=kind == "fused")
    optimizer.load_state_dict(loaded)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL, help="whose parameters to step (Hub id, folder or .gguf)")
    parser.add_argument("--repeats", type=int, default=3, help="timed pairs (best of these)")
    parser.add_argument("--lr", type=float, default=1e-6, help="AdamW learning rate (train.py's default)")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1 (got {args.repeats})")
    policy = load_model(args.model, device=torch.device("cpu"), dtype=torch.float32)
    params = list(policy.parameters())
    generator = torch.Generator().manual_seed(0)
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator) * 1e-3  # (shape of the parameter)
    start_weights = [p.detach().clone() for p in params]
    optimizers = {kind: torch.optim.AdamW(params, lr=args.lr, **{kind: True}) for kind in ("foreach", "fused")}
    optimizers["foreach"].step()  # moments of one step, shared by both
    state = copy.deepcopy(optimizers["foreach"].state_dict())
    after = {}
    seconds = {kind: float("inf") for kind in optimizers}
    for repeat in range(args.repeats + 1):  # the first pair only warms up: not timed
        for kind, optimizer in optimizers.items():
            restore(optimizer, kind, params=params, weights=start_weights, state=state)
            took = best_time(optimizer.step, repeats=1)
            if repeat:
                seconds[kind] = min(seconds[kind], took)
            after[kind] = [p.detach().clone() for p in params]
    diff = max((a - b).abs().max().item() for a, b in zip(after["foreach"], after["fused"]))
    size = max((a - w).abs().max().item() for a, w in zip(after["foreach"], start_weights))
    print(f"{sum(p.numel() for p in params) / 1e6:.1f}M fp32 parameters: step foreach {seconds['foreach']:.3f}s, "
          f"fused {seconds['fused']:.3f}s (best of {args.repeats})")
    print(f"adamw_fused_vs_foreach={seconds['foreach'] / seconds['fused']:.2f} max_update_diff={diff:.2e} "
          f"max_update={size:.2e}")


if __name__ == "__main__":
    main()
