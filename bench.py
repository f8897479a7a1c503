"""Sampler benchmark: our decode loop (rollout.HFSampler) against transformers `generate`, in fp32 and bf16, and the
VinePPO pattern.

    python bench.py                      # a few minutes on a 2-core CPU
    python bench.py --batches 1,8,64     # a subset

1. The limit. A generated token costs one pass through every weight matrix (~0.27 GFLOP for SmolLM2-135M). We time
   exactly those matmuls at batch b on this machine; limit(b) = b / (time of one decode step's matmuls). It leaves
   out attention, whose KV-cache reads are memory-bound; the matching floor at the measured read bandwidth is printed.
2. Throughput: b distinct prompts of --prompt-len tokens, --new-tokens each (EOS ignored, so every row generates
   exactly that many), T = 0.6, top_p = 0.9, for `generate` and ours. "decode" tok/s counts the generation phase
   only (from the first sampled token on; the prompt's prefill excluded): that is what the limit describes. "e2e"
   includes the prefill of the prompts (the same FLOPs per prompt token as per generated token). "bf16" is our
   sampler on its bf16 copy of the weights (what --dtype auto picks on a CPU with native bf16), beside fp32.
3. The VinePPO pattern: 8 responses of ~250 tokens, 4 steps each, K = 8 vines of 64 tokens per state.
   naive = every vine prefilled from scratch; reuse = sample_prefixes (one prefill per response; the vines of a state
   attend to a view of it); alone = the same vine tokens generated from a 1-token prompt (nothing to prefill and
   almost nothing to attend to): the cost of the new tokens alone.
4. Greedy agreement: 64-token greedy continuations of --agree-prompts real prompts in fp32 and in bf16; how many
   leading tokens agree before the first difference (a near-tie flips, and the texts part ways after it).
5. Real vines (EOS on): one default CPU iteration's values (--vine-prompts x --vine-samples GSM8K train responses of
   up to --vine-max-new-tokens, sampled by our bf16 sampler; their states as train.py estimates them, deduplicated,
   at most 25 per response; K = 9 vines each at T = 0.6, top_p = 0.9), at --gen-batch-size 256: the static loop
   (continuous=False) against continuous batching, in bf16 and fp32 (fp32: do both give the same values and vine
   tokens?); and, on the same states in bf16, fixed K = 9 against --k-mode adaptive --k-ci 0.45 and budget 9, on
   both loops for adaptive (static: a prefill and a barrier per round; continuous: a state's next round joins the
   running batch). Seconds of estimate_values, and vines. `--only-vines` runs this part alone.
The last line: speedup_b64=<ours/generate, decode, at 64> frac_b256=<ours decode/limit at 256>
reuse_overhead=<reuse/alone> reuse_vs_naive=<naive/reuse> bf16_vs_fp32_b64=<ours bf16/ours fp32, decode, at 64>
bf16_vs_fp32_b256=<the same at 256> continuous_vs_static=<static seconds/continuous seconds, real vines, bf16>
adaptive_vs_fixed_seconds=<adaptive 0.45 seconds/fixed K = 9 seconds, continuous, bf16, the same states>.
"""
import random
import argparse
import os
import time

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from data import encode_prompt, load_split
from grader import grade
from model import DEFAULT_MODEL, load_model, load_tokenizer
from hf_sampler import HFSampler
from sampling import row_seed
from values import estimate_values, step_token_starts


def best_time(fn, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def matmul_gflops(m: int, k: int, n: int) -> float:
    a, b = torch.randn(m, k), torch.randn(k, n)
    reps = max(1, int(2e9 / (2 * m * k * n)))  # about 2 GFLOP per timing
    seconds = best_time(lambda: [torch.mm(a, b) for _ in range(reps)])
    return 2 * m * k * n * reps / seconds / 1e9


def decode_step_matmul_seconds(model, batch: int) -> tuple[float, float]:
    """(seconds, GFLOP) of one decode step's weight matmuls at `batch` rows: every Linear of every layer + lm_head."""
    shapes = [tuple(m.weight.shape) for m in model.model.layers[0].modules() if isinstance(m, torch.nn.Linear)]
    layer = sum(2 * batch * i * o / (matmul_gflops(batch, i, o) * 1e9) for o, i in shapes)
    head_out, head_in = model.lm_head.weight.shape
    head = 2 * batch * head_in * head_out / (matmul_gflops(batch, head_in, head_out) * 1e9)
    flops = 2 * batch * (len(model.model.layers) * sum(o * i for o, i in shapes) + head_in * head_out) / 1e9
    return len(model.model.layers) * layer + head, flops


def bench_prompts(tokenizer, count: int, length: int, data_dir) -> list[list[int]]:
    """`count` distinct prompts of exactly `length` tokens, cut from real GSM8K chat prompts."""
    questions = [e["question"] for e in load_split("gsm8k", "train", data_dir=data_dir)]
    prompts, i = [], 0
    while len(prompts) < count:
        text, ids = "", []
        while len(ids) < length:
            text, i = text + " " + questions[i], i + 1
            ids = encode_prompt(text, dataset="gsm8k", tokenizer=tokenizer)
        prompts.append(ids[-length:])  # keep the end: the prompt still closes with the assistant tag
    return prompts


class FirstTokenClock(LogitsProcessor):
    """Notes when `generate` first asks for logits processing: the prompt's prefill is done then."""
    def __init__(self):
        self.first = None

    def __call__(self, input_ids, scores):
        self.first = self.first or time.perf_counter()
        return scores


def run_generate(model, prompts, new_tokens: int) -> tuple[float, float]:
    """(total seconds, seconds from the first sampled token on)."""
    ids, clock = torch.tensor(prompts), FirstTokenClock()
    torch.manual_seed(0)
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=0.6,
                       top_p=0.9, top_k=None, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                       pad_token_id=0, logits_processor=LogitsProcessorList([clock]))
    end = time.perf_counter()
    return end - start, end - clock.first


def run_ours(sampler, prompts, new_tokens: int) -> tuple[float, float]:
    """(total seconds, seconds of the decode loop)."""
    start = time.perf_counter()
    sampler.sample(prompts, n=1, temperature=0.6, top_p=0.9, max_new_tokens=new_tokens, seed=0)
    return time.perf_counter() - start, sampler.timing["decode_s"]


def read_bandwidth() -> float:
    """GB/s of streaming a 1 GiB tensor: what the attention's KV-cache reads run against."""
    x = torch.ones(2 ** 28)
    return 4 * x.numel() / best_time(lambda: x.sum()) / 1e9


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


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--data-dir", default=os.environ.get("VINEPPO_DATA_DIR", "../shared/data"))
    parser.add_argument("--batches", default="1,8,32,64,256")
    parser.add_argument("--prompt-len", type=int, default=167)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--agree-prompts", type=int, default=16)
    parser.add_argument("--vine-prompts", type=int, default=4)
    parser.add_argument("--vine-samples", type=int, default=4)
    parser.add_argument("--vine-max-new-tokens", type=int, default=192)
    parser.add_argument("--gen-batch-size", type=int, default=256)
    parser.add_argument("--only-vines", action="store_true", help="section 5 (real vines) alone")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer(args.model)
    model = load_model(args.model, device=torch.device("cpu"), dtype=torch.float32, frozen=True)
    if args.only_vines:
        print(" ".join(f"{k}={v:.2f}" for k, v in real_vines(model, tokenizer, args).items()))
        return
    sampler = HFSampler(model, tokenizer, batch_size=256)
    bf16 = HFSampler(model, tokenizer, batch_size=256, dtype=torch.bfloat16)
    sampler.stop_ids = bf16.stop_ids = set()  # no EOS: every row generates exactly the tokens asked for
    print(f"threads {args.threads}; matmul 1024^3: {matmul_gflops(1024, 1024, 1024):.0f} GFLOP/s", flush=True)

    bandwidth, cfg = read_bandwidth(), model.config
    kv_bytes_per_position = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (
        cfg.hidden_size // cfg.num_attention_heads) * 4
    print(f"memory read bandwidth: {bandwidth:.1f} GB/s", flush=True)
    results = {}
    for b in [int(x) for x in args.batches.split(",")]:
        step_seconds, gflop = decode_step_matmul_seconds(model, b)
        limit = b / step_seconds
        context = args.prompt_len + args.new_tokens / 2  # mean positions attended per generated token
        floor = b / (step_seconds + b * context * kv_bytes_per_position / (bandwidth * 1e9))
        prompts = bench_prompts(tokenizer, b, args.prompt_len, args.data_dir)
        tokens = b * args.new_tokens
        gen_total, gen_decode = run_generate(model, prompts, args.new_tokens)
        ours_total, ours_decode = run_ours(sampler, prompts, args.new_tokens)
        bf16_total, bf16_decode = run_ours(bf16, prompts, args.new_tokens)
        gen, ours = tokens / gen_decode, tokens / ours_decode
        results[b] = (gen, ours, limit, tokens / bf16_decode)
        print(f"batch {b:4d}: limit {limit:6.1f} tok/s ({gflop / b:.3f} GFLOP/token at {gflop / step_seconds:5.1f} "
              f"GFLOP/s; with KV reads {floor:6.1f}) | decode: generate {gen:6.1f} ({gen / limit:4.0%}), ours "
              f"{ours:6.1f} ({ours / limit:4.0%}), {ours / gen:4.2f}x | e2e: generate {tokens / gen_total:6.1f}, "
              f"ours {tokens / ours_total:6.1f}, {gen_total / ours_total:4.2f}x | bf16: decode {tokens / bf16_decode:6.1f} "
              f"({ours_decode / bf16_decode:4.2f}x fp32), e2e {tokens / bf16_total:6.1f} "
              f"({ours_total / bf16_total:4.2f}x)", flush=True)

    # The VinePPO pattern: 8 responses x 4 states x K = 8 vines x 64 tokens.
    K, vine_tokens, starts = 8, 64, [0, 62, 125, 187]
    prompts = bench_prompts(tokenizer, 8, args.prompt_len, args.data_dir)
    filler = tokenizer(" ".join(e["solution"] for e in load_split("gsm8k", "test", data_dir=args.data_dir)[:40]),
                       add_special_tokens=False).input_ids
    sequences = [p + filler[i * 250:(i + 1) * 250] for i, p in enumerate(prompts)]
    seqs = [s for s in sequences for _ in starts]
    lens = [len(p) + st for p in prompts for st in starts]
    kwargs = dict(temperature=0.6, top_p=0.9, max_new_tokens=vine_tokens, seed=0)
    reuse = best_time(lambda: sampler.sample_prefixes(seqs, lens, n=K, **kwargs), repeats=1)
    reuse_decode = sampler.timing["decode_s"]
    sampler.reuse_prefixes = False  # every vine prefilled from scratch
    naive = best_time(lambda: sampler.sample([s[:L] for s, L in zip(seqs, lens) for _ in range(K)], n=1, **kwargs),
                      repeats=1)
    sampler.reuse_prefixes = True
    alone = best_time(lambda: sampler.sample([[s[0]] for s in seqs], n=K, **kwargs), repeats=1)
    reuse_bf16 = best_time(lambda: bf16.sample_prefixes(seqs, lens, n=K, **kwargs), repeats=1)
    total = len(seqs) * K * vine_tokens
    print(f"vine pattern ({len(seqs)} states x K={K} x {vine_tokens} tokens = {total} tokens): naive {naive:.1f}s, "
          f"prefix reuse {reuse:.1f}s (prefill {reuse - reuse_decode:.1f}s + decode {reuse_decode:.1f}s), the same "
          f"tokens from a 1-token prompt {alone:.1f}s; prefix reuse in bf16 {reuse_bf16:.1f}s "
          f"({reuse / reuse_bf16:.2f}x fp32)", flush=True)

    # Greedy agreement of the bf16 sampler with the fp32 one.
    prompts = bench_prompts(tokenizer, args.agree_prompts, args.prompt_len, args.data_dir)
    kwargs = dict(n=1, temperature=0.0, top_p=1.0, max_new_tokens=64)
    agree = [next((i for i, (x, y) in enumerate(zip(a[0].token_ids, b[0].token_ids)) if x != y), 64)
             for a, b in zip(sampler.sample(prompts, **kwargs), bf16.sample(prompts, **kwargs))]
    print(f"greedy bf16 vs fp32, 64 tokens from {len(agree)} prompts: leading tokens in agreement {sorted(agree)} "
          f"(median {sorted(agree)[len(agree) // 2]}, all 64 in {agree.count(64)})", flush=True)

    real = real_vines(model, tokenizer, args)
    line = f"reuse_overhead={reuse / alone:.2f} reuse_vs_naive={naive / reuse:.2f}"
    if 64 in results and 256 in results:
        line = f"speedup_b64={results[64][1] / results[64][0]:.2f} frac_b256={results[256][1] / results[256][2]:.2f} " + line
        line += (f" bf16_vs_fp32_b64={results[64][3] / results[64][1]:.2f} "
                 f"bf16_vs_fp32_b256={results[256][3] / results[256][1]:.2f}")
    print(line + "".join(f" {k}={v:.2f}" for k, v in real.items()))


if __name__ == "__main__":
    main()
