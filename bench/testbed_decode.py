"""The testbed's decode against its limit: our sampler's tokens/s for one iteration's rollouts and vines of the
testbed model (research/grid.py SETTINGS: 64 prompts x 8, up to 64 tokens, T 0.6, top-p 0.9, K = 9 at every line), on
one thread as the testbed's runs have it, beside the matmul limit at those shapes (bench.sampler's method), and where
the time goes.

    python -m bench.testbed_decode --model runs/testbed/sft            (about a minute)
    python -m bench.testbed_decode --model runs/testbed/sft --profile  (and a cProfile of the vines, by own time)

The limit: a generated token costs one pass through every weight matrix; bench.timing.decode_step_matmul_seconds
times exactly those matmuls at the decode batch (the sampler's 512 rows); limit = rows / that time. Attention, the
norms, the sampling and Python are what the rest of a step costs. The last line: rollout_frac=<rollout tok/s / limit>
vine_frac=<vine tok/s / limit> (with --json PATH, every figure).
"""
import argparse
import cProfile
import hashlib
import io
import json
import pstats
import random
import time

import torch

from ablations.free_samples import estimate_values
from bench.timing import decode_step_matmul_seconds, matmul_gflops
from data import encode_prompt, load_split
from engine import HFSampler
from grader import grade
from model import load_model, load_tokenizer
from values import step_token_starts


def one_iteration(sampler, tokenizer, *, prompts: int, seed: int, free_samples: str = "off") -> dict:
    """Seconds and tokens of one testbed iteration's rollouts and vines (fixed K = 9), as train.py samples them, and
    a digest of the rollouts' tokens and the values (the same digest: the same samples, bit for bit)."""
    examples = random.Random(seed).sample(load_split("chain", "train", arith_ops=4), prompts)
    ids = [encode_prompt(e["question"], grader="chain", tokenizer=tokenizer, prompt_format="plain") for e in examples]
    t0 = time.perf_counter()
    groups = sampler.sample(ids, n=8, temperature=0.6, top_p=0.9, max_new_tokens=64, seed=seed)
    rollout_s = time.perf_counter() - t0
    samples = [s for g in groups for s in g]
    answers = [e["answer"] for e, g in zip(examples, groups) for _ in g]
    t0 = time.perf_counter()
    values, stats = estimate_values(
        sampler=sampler, prompts=[p for p, g in zip(ids, groups) for _ in g], responses=[s.token_ids for s in samples],
        step_starts=[step_token_starts(s.token_ids, s.text, tokenizer=tokenizer, task="chain") for s in samples],
        rewards=[grade(s.text, a, grader="chain", truncated=not s.finished) for s, a in zip(samples, answers)],
        answers=answers, grader="chain", K=9, temperature=0.6, top_p=0.9, max_new_tokens=64, seed=seed + 1,
        free_samples=free_samples)
    vine_s = time.perf_counter() - t0
    rollout_tokens = sum(len(s.token_ids) for s in samples)
    return {"rollout_s": rollout_s, "rollout_tokens": rollout_tokens, "rollout_tok_s": rollout_tokens / rollout_s,
            "vine_s": vine_s, "vine_tokens": stats["vine_tokens"], "vines": stats["vines"],
            "states": stats["value_states"], "vine_tok_s": stats["vine_tokens"] / vine_s,
            "samples_sha256": hashlib.sha256(repr(([s.token_ids for s in samples], values)).encode()).hexdigest()}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="runs/testbed/sft", help="the testbed's SFT model folder")
    parser.add_argument("--prompts", type=int, default=64, help="prompts of the iteration (8 responses each)")
    parser.add_argument("--batch", type=int, default=512, help="decode rows (train.py --gen-batch-size)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", action="store_true", help="also profile the vines (cProfile, top 25 by own time)")
    parser.add_argument("--json", default=None, help="write every figure here")
    args = parser.parse_args()
    torch.set_num_threads(1)  # as the testbed's runs (--threads 1)
    tokenizer = load_tokenizer(args.model)
    model = load_model(args.model, device=torch.device("cpu"), dtype=torch.float32, frozen=True)
    sampler = HFSampler(model, tokenizer, dtype=torch.float32, batch_size=args.batch)
    one_iteration(sampler, tokenizer, prompts=8, seed=args.seed + 100)  # warm up
    step_s, gflop = decode_step_matmul_seconds(model, args.batch)
    report = {"model": args.model, "threads": 1, "batch": args.batch,
              "params": sum(p.numel() for p in model.parameters()),
              "matmul_gflops_1024": matmul_gflops(1024, 1024, 1024), "step_matmul_s": step_s,
              "gflop_per_token": gflop / args.batch, "limit_tok_s": args.batch / step_s,
              **one_iteration(sampler, tokenizer, prompts=args.prompts, seed=args.seed)}
    print(f"{report['params'] / 1e6:.2f}M parameters, {report['gflop_per_token'] * 1e3:.2f} MFLOP a token; matmuls at "
          f"{args.batch} rows: {step_s * 1e3:.2f} ms a step, limit {report['limit_tok_s']:.0f} tok/s (1024^3 matmul "
          f"{report['matmul_gflops_1024']:.0f} GFLOP/s)")
    print(f"rollouts: {report['rollout_tokens']} tokens in {report['rollout_s']:.2f} s = {report['rollout_tok_s']:.0f} "
          f"tok/s; vines: {report['vines']} vines of {report['states']} states, {report['vine_tokens']} tokens in "
          f"{report['vine_s']:.2f} s = {report['vine_tok_s']:.0f} tok/s")
    if args.profile:
        profiler = cProfile.Profile()
        profiler.enable()
        one_iteration(sampler, tokenizer, prompts=args.prompts, seed=args.seed)
        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
        print(text.getvalue())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    print(f"rollout_frac={report['rollout_tok_s'] / report['limit_tok_s']:.3f} "
          f"vine_frac={report['vine_tok_s'] / report['limit_tok_s']:.3f}")


if __name__ == "__main__":
    main()
