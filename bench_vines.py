"""Section 5 of bench.py, real vines: one default CPU iteration's MC values (GSM8K train responses sampled with EOS
on, their states as train.py estimates them), timed on the static decode loop against continuous batching, in bf16
and fp32, and fixed K = 9 against adaptive and budget K on the same states. bench.py's docstring says what each
figure is; `python bench.py --only-vines` runs this part alone.
"""
import random
import time

import torch

from data import encode_prompt, load_split
from grader import grade
from hf_sampler import HFSampler
from sampling import row_seed
from values import estimate_values, step_token_starts


def vine_iteration(sampler, tokenizer, *, data_dir, prompts: int, samples: int, max_new_tokens: int,
                   seed: int = 0) -> dict:
    """A default CPU iteration's rollouts (GSM8K train prompts, `samples` responses each, EOS on) and their steps:
    the keyword arguments of estimate_values, bar the vine-count rule."""
    examples = random.Random(seed).choices(load_split("gsm8k", "train", data_dir=data_dir), k=prompts)
    prompt_ids = [encode_prompt(e["question"], dataset="gsm8k", tokenizer=tokenizer) for e in examples]
    groups = sampler.sample(prompt_ids, n=samples, temperature=0.6, top_p=0.9, max_new_tokens=max_new_tokens,
                            seed=row_seed(seed, 0))
    rows = [(p, e["answer"], s) for p, e, g in zip(prompt_ids, examples, groups) for s in g]
    return dict(prompts=[p for p, _, _ in rows], responses=[s.token_ids for _, _, s in rows],
                step_starts=[step_token_starts(s.token_ids, s.text, tokenizer=tokenizer, dataset="gsm8k")
                             for _, _, s in rows],
                rewards=[grade(s.text, a, dataset="gsm8k", truncated=not s.finished) for _, a, s in rows],
                answers=[a for _, a, _ in rows], dataset="gsm8k", K=9, temperature=0.6, top_p=0.9,
                max_new_tokens=max_new_tokens, max_value_steps=25, seed=row_seed(seed, 1))


def timed_values(sampler, iteration: dict, **rule) -> tuple[float, list, dict]:
    """(seconds, values, stats) of estimate_values on `iteration` with the vine-count rule `rule`."""
    start = time.perf_counter()
    values, stats = estimate_values(sampler=sampler, **iteration, **rule)
    return time.perf_counter() - start, values, stats


def real_vines(model, tokenizer, args) -> dict:
    """Section 5 of the docstring; prints its lines, returns the ratios of the last line."""
    bf16 = {c: HFSampler(model, tokenizer, batch_size=args.gen_batch_size, dtype=torch.bfloat16, continuous=c)
            for c in (False, True)}
    fp32 = {c: HFSampler(model, tokenizer, batch_size=args.gen_batch_size, continuous=c) for c in (False, True)}
    iteration = vine_iteration(bf16[True], tokenizer, data_dir=args.data_dir, prompts=args.vine_prompts,
                               samples=args.vine_samples, max_new_tokens=args.vine_max_new_tokens)
    fixed, adaptive = {"k_mode": "fixed"}, {"k_mode": "adaptive", "k_ci": 0.45}
    runs = {}  # (loop, dtype, rule) -> (seconds, values, stats), in this order: neighbours compared, as A B A B
    for name, sampler, rule in (("static bf16 fixed", bf16[False], fixed), ("continuous bf16 fixed", bf16[True], fixed),
                                ("continuous bf16 adaptive:0.45", bf16[True], adaptive),
                                ("static bf16 adaptive:0.45", bf16[False], adaptive),
                                ("continuous bf16 budget:9", bf16[True], {"k_mode": "budget"}),
                                ("static fp32 fixed", fp32[False], fixed), ("continuous fp32 fixed", fp32[True], fixed)):
        runs[name] = timed_values(sampler, iteration, **rule)
        seconds, _, stats = runs[name]
        print(f"real vines, {name}: {seconds:.1f}s, {stats['value_states']} states, {stats['vines']} vines "
              f"({stats['vines_per_state']:.2f} per state), {stats['vine_tokens']} vine tokens "
              f"({stats['vine_tokens'] / seconds:.0f} tok/s)", flush=True)
    same = runs["static fp32 fixed"][1:] == runs["continuous fp32 fixed"][1:]
    seconds = {name: run[0] for name, run in runs.items()}
    print(f"real vines: continuous vs static {seconds['static bf16 fixed'] / seconds['continuous bf16 fixed']:.2f}x "
          f"bf16, {seconds['static fp32 fixed'] / seconds['continuous fp32 fixed']:.2f}x fp32 (fp32 values and vine "
          f"tokens identical: {same}); adaptive:0.45 / fixed K=9 seconds: continuous "
          f"{seconds['continuous bf16 adaptive:0.45'] / seconds['continuous bf16 fixed']:.2f}, static "
          f"{seconds['static bf16 adaptive:0.45'] / seconds['static bf16 fixed']:.2f}; budget:9 / fixed: "
          f"{seconds['continuous bf16 budget:9'] / seconds['continuous bf16 fixed']:.2f} (continuous)", flush=True)
    return {"continuous_vs_static": seconds["static bf16 fixed"] / seconds["continuous bf16 fixed"],
            "adaptive_vs_fixed_seconds": seconds["continuous bf16 adaptive:0.45"] / seconds["continuous bf16 fixed"]}
