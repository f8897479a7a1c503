"""Section 5 of bench/sampler.py, real vines: one default CPU iteration's MC values (GSM8K train responses sampled with EOS
on, their states as train.py estimates them), timed on the static decode loop against continuous batching, in the
sampler's dtype (--vine-dtype; auto: what train.py's --dtype auto picks here, bf16 where the device has native bf16
matmuls, else fp32) and in fp32, and fixed K = 9 against adaptive and budget K on the same states. bench/sampler.py's
docstring says what each figure is; `python -m bench.sampler --only-vines` runs this part alone.
"""
import random
import time

import torch

from data import encode_prompt, load_split
from engine import HFSampler
from grader import grade
from model import pick_dtype
from sampling import row_seed
from values import estimate_values, step_token_starts


def vine_iteration(sampler, tokenizer, *, data_dir, prompts: int, samples: int, max_new_tokens: int,
                   seed: int = 0) -> dict:
    """A default CPU iteration's rollouts (GSM8K train prompts, `samples` responses each, EOS on) and their steps:
    the keyword arguments of estimate_values, bar the vine-count rule."""
    examples = random.Random(seed).choices(load_split("gsm8k", "train", data_dir=data_dir), k=prompts)
    prompt_ids = [encode_prompt(e["question"], grader="gsm8k", tokenizer=tokenizer) for e in examples]
    groups = sampler.sample(prompt_ids, n=samples, temperature=0.6, top_p=0.9, max_new_tokens=max_new_tokens,
                            seed=row_seed(seed, 0))
    rows = [(p, e["answer"], s) for p, e, g in zip(prompt_ids, examples, groups) for s in g]
    return dict(prompts=[p for p, _, _ in rows], responses=[s.token_ids for _, _, s in rows],
                step_starts=[step_token_starts(s.token_ids, s.text, tokenizer=tokenizer, task="gsm8k")
                             for _, _, s in rows],
                rewards=[grade(s.text, a, grader="gsm8k", truncated=not s.finished) for _, a, s in rows],
                answers=[a for _, a, _ in rows], grader="gsm8k", K=9, temperature=0.6, top_p=0.9,
                max_new_tokens=max_new_tokens, max_value_steps=25, seed=row_seed(seed, 1))


def timed_values(sampler, iteration: dict, **rule) -> tuple[float, list, dict]:
    """(seconds, values, stats) of estimate_values on `iteration` with the vine-count rule `rule`."""
    start = time.perf_counter()
    values, stats = estimate_values(sampler=sampler, **iteration, **rule)
    return time.perf_counter() - start, values, stats


def real_vines(model, tokenizer, args) -> dict:
    """Section 5 of the docstring; prints its lines, returns the ratios of the last line. The first five runs are in
    args.vine_dtype (auto: bf16 where native, else fp32); with args.vine_repeat the fixed-K pair is run again after
    them, in the reverse order (A B ... B A: a drift over the runs weighs on both loops alike), and each loop's
    seconds are its mean; the fp32 pair is run again only if that dtype is not fp32."""
    dtype = pick_dtype(args.vine_dtype, next(model.parameters()).device)
    name = {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]
    main = {c: HFSampler(model, tokenizer, batch_size=args.gen_batch_size, dtype=dtype, continuous=c)
            for c in (False, True)}
    fp32 = main if dtype == torch.float32 else {
        c: HFSampler(model, tokenizer, batch_size=args.gen_batch_size, continuous=c) for c in (False, True)}
    iteration = vine_iteration(main[True], tokenizer, data_dir=args.data_dir, prompts=args.vine_prompts,
                               samples=args.vine_samples, max_new_tokens=args.vine_max_new_tokens)
    fixed, adaptive = {"k_mode": "fixed"}, {"k_mode": "adaptive", "k_ci": 0.45}
    pair = [(f"static {name} fixed", main[False], fixed), (f"continuous {name} fixed", main[True], fixed)]
    plan = pair + [(f"continuous {name} adaptive:0.45", main[True], adaptive),
                   (f"static {name} adaptive:0.45", main[False], adaptive),
                   (f"continuous {name} budget:9", main[True], {"k_mode": "budget"})]
    plan += pair[::-1] if args.vine_repeat else []
    if name != "fp32":
        plan += [("static fp32 fixed", fp32[False], fixed), ("continuous fp32 fixed", fp32[True], fixed)]
    runs = {}  # (loop, dtype, rule) -> [(seconds, values, stats) of each run], in the plan's order
    for run_name, sampler, rule in plan:
        runs.setdefault(run_name, []).append(timed_values(sampler, iteration, **rule))
        seconds, _, stats = runs[run_name][-1]
        print(f"real vines, {run_name}: {seconds:.1f}s, {stats['value_states']} states, {stats['vines']} vines "
              f"({stats['vines_per_state']:.2f} per state), {stats['vine_tokens']} vine tokens "
              f"({stats['vine_tokens'] / seconds:.0f} tok/s)", flush=True)
    same = runs["static fp32 fixed"][0][1:] == runs["continuous fp32 fixed"][0][1:]
    seconds = {run_name: sum(run[0] for run in done) / len(done) for run_name, done in runs.items()}  # means
    ratio = lambda a, b: seconds[f"{a} {name} {b}"] / seconds[f"continuous {name} fixed"]  # a run / continuous fixed
    fp32_ratio = seconds["static fp32 fixed"] / seconds["continuous fp32 fixed"]
    print(f"real vines: continuous vs static {ratio('static', 'fixed'):.2f}x {name}"
          + (f", {fp32_ratio:.2f}x fp32" if name != "fp32" else "") + f" (fp32 values and vine tokens identical: {same}); "
          f"adaptive:0.45 / fixed K=9 seconds: continuous {ratio('continuous', 'adaptive:0.45'):.2f}, static "
          f"{seconds[f'static {name} adaptive:0.45'] / seconds[f'static {name} fixed']:.2f}; budget:9 / fixed: "
          f"{ratio('continuous', 'budget:9'):.2f} (continuous)" + ("; fixed-K seconds: mean of two runs each"
                                                                   if args.vine_repeat else ""), flush=True)
    return {"continuous_vs_static": ratio("static", "fixed"),
            "adaptive_vs_fixed_seconds": ratio("continuous", "adaptive:0.45")}
