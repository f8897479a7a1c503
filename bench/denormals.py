"""Subnormal floats on a CPU: how many a trained run's AdamW state holds, and what they cost the PPO section.

    python -m bench.denormals --checkpoint research/replication/results/pipeline/grpo-s2/ckpt-000019      (about 3 minutes on 2 cores)

A float32 below 1.2e-38 is subnormal; x86 cores compute with one far slower than with a normal number unless
flush-to-zero is on (torch.set_flush_denormal(True), off by default); GPUs take them at full speed. AdamW's second
moment holds the squares of gradients, and the gradient of a token the model all but rules out is tiny, so a run's
exp_avg_sq collects subnormals as it trains. This loads a checkpoint (its fp32 weights, its AdamW state with
weights_only), counts the subnormals in exp_avg / exp_avg_sq (and in which parameters most are), then times, with
flush-to-zero off and on in alternation (A B A B, the same state restored before each; one untimed pair first):
  step      one optimizer.step() from the saved state, the gradient set to the saved exp_avg (a real gradient's size
            and pattern);
  backward  forward + backward of the response tokens' log-likelihood of --batch arith problems with their worked
            solutions (bf16 autocast where the CPU has native bf16, as train.py).
Last line: subnormal_frac=<of exp_avg_sq> step_off_vs_on=<seconds off / on> backward_off_vs_on=<the same>.
"""
import argparse
from pathlib import Path

import torch

from bench.timing import best_time
from checkpoint import load_trainer_state
from data import encode_prompt, load_split
from model import Scorer, load_model, load_tokenizer, pick_dtype
from ppo import pad_episodes


def subnormal_counts(state: dict, names: list[str]) -> dict:
    """{moment: (elements, subnormals, {parameter name: subnormals})} over an AdamW state_dict's per-parameter
    state; `names` are the parameters' names in the optimizer's order."""
    tiny = torch.finfo(torch.float32).tiny
    out = {}
    for moment in ("exp_avg", "exp_avg_sq"):
        total, count, where = 0, 0, {}
        for i, s in state["state"].items():
            t = s[moment].abs()
            n = int(((t > 0) & (t < tiny)).sum())
            total, count = total + t.numel(), count + n
            if n:
                where[names[i]] = n
        out[moment] = (total, count, where)
    return out


def nll_backward(scorer, input_ids, attention_mask, response_mask, P: int):
    """Forward and backward of the mean negative log-likelihood of the response tokens (B episodes, R tokens)."""
    logp, _, _, _ = scorer(input_ids, attention_mask, response_start=P, temperature=1.0)  # (B, R)
    (-(logp * response_mask).sum() / response_mask.sum()).backward()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="a train.py checkpoint folder (ckpt-NNNNNN)")
    parser.add_argument("--repeats", type=int, default=3, help="timed pairs (off, on) of each kind")
    parser.add_argument("--batch", type=int, default=8, help="episodes in the timed forward + backward")
    args = parser.parse_args()
    if args.repeats < 1 or args.batch < 1:
        parser.error(f"--repeats and --batch must be at least 1 (got {args.repeats}, {args.batch})")
    source = Path(args.checkpoint)
    if not (source / "trainer_state.pt").exists():
        raise SystemExit(f"error: --checkpoint {source}: no trainer_state.pt there (not a train.py checkpoint)")
    device = torch.device("cpu")
    policy = load_model(str(source), device=device, dtype=torch.float32)
    tokenizer = load_tokenizer(str(source))
    state = load_trainer_state(source)["optimizer"]
    if len(state["param_groups"]) != 1:
        raise SystemExit(f"error: --checkpoint {source}: a critic run's state (value head); pass a vine or grpo one")
    names = [n for n, _ in policy.named_parameters()]
    counts = subnormal_counts(state, names)
    for moment, (total, count, where) in counts.items():
        top = ", ".join(f"{n} {c}" for n, c in sorted(where.items(), key=lambda x: -x[1])[:3])
        print(f"{moment}: {count} of {total} subnormal ({count / total:.2%}); most in: {top or '-'}")

    params = list(policy.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-6)
    examples = load_split("arith", "test", data_dir=None)[:args.batch]
    prompts = [encode_prompt(e["question"], grader="arith", tokenizer=tokenizer) for e in examples]
    responses = [tokenizer(e["solution"], add_special_tokens=False).input_ids for e in examples]
    input_ids, attention_mask, response_mask, P = pad_episodes(prompts, responses, pad_id=tokenizer.pad_token_id)
    scorer = Scorer(policy, dtype=pick_dtype("auto", device))

    seconds = {(kind, flush): [] for kind in ("step", "backward") for flush in (False, True)}
    for repeat in range(args.repeats + 1):  # the first pass only warms up (allocator, kernels): not timed
        for flush in (False, True):
            torch.set_flush_denormal(flush)
            optimizer.load_state_dict(state)  # the saved moments, before every timed step
            for p in params:
                p.grad = optimizer.state[p]["exp_avg"].clone()
            step = best_time(optimizer.step, repeats=1)
            optimizer.zero_grad(set_to_none=True)
            backward = best_time(lambda: nll_backward(scorer, input_ids, attention_mask, response_mask, P), repeats=1)
            optimizer.zero_grad(set_to_none=True)
            if repeat:
                seconds["step", flush].append(step)
                seconds["backward", flush].append(backward)
    torch.set_flush_denormal(False)
    best = {k: min(v) for k, v in seconds.items()}
    for kind in ("step", "backward"):
        print(f"{kind}: flush-to-zero off {best[kind, False]:.2f} s, on {best[kind, True]:.2f} s (best of "
              f"{args.repeats}; all: off {[round(s, 2) for s in seconds[kind, False]]}, on "
              f"{[round(s, 2) for s in seconds[kind, True]]})")
    total, count, _ = counts["exp_avg_sq"]
    print(f"subnormal_frac={count / total:.4f} step_off_vs_on={best['step', False] / best['step', True]:.2f} "
          f"backward_off_vs_on={best['backward', False] / best['backward', True]:.2f}")


if __name__ == "__main__":
    main()
