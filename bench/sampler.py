"""Sampler benchmark: our decode loop (engine.HFSampler) against transformers `generate`, in fp32 and bf16, and the
VinePPO pattern.

    python -m bench.sampler                      # a few minutes on a 2-core CPU
    python -m bench.sampler --batches 1,8,64     # a subset
    python -m bench.sampler --device cuda --shape 1b --tokenizer DIR --dataset arith --json b.json   # random ~1.1B, on a GPU

--shape 135m|1b|tiny benches a random-weight model of that shape (bench/shapes.py: speed and memory only, its text is
gibberish), which needs only a tokenizer (--tokenizer, default --model). --dataset arith takes the prompts from the
generated arith problems, which need no data files. On CUDA every timer waits for the GPU's queued work first.

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
   up to --vine-max-new-tokens, sampled by our sampler in --vine-dtype; their states as train.py estimates them,
   deduplicated, at most 25 per response; K = 9 vines each at T = 0.6, top_p = 0.9), at --gen-batch-size 256: the
   static loop (continuous=False) against continuous batching, in --vine-dtype (auto: what train.py's --dtype auto
   picks, bf16 where the device has native bf16 matmuls, else fp32) and in fp32 (fp32: do both give the same values
   and vine tokens?); and, on the same states in --vine-dtype, fixed K = 9 against --k-mode adaptive --k-ci 0.45
   and budget 9, on both loops for adaptive (static: a prefill and a barrier per round; continuous: a state's next
   round joins the running batch). Seconds of estimate_values, and vines. The fixed-K pair runs first and, again
   in reverse order, last (--no-vine-repeat: first only); its seconds are the means (this machine's speed drifts by
   10-20% within an hour). `--only-vines` runs this part alone.
The last line: speedup_b64=<ours/generate, decode, at 64> frac_b256=<ours decode/limit at 256>
reuse_overhead=<reuse/alone> reuse_vs_naive=<naive/reuse> bf16_vs_fp32_b64=<ours bf16/ours fp32, decode, at 64>
bf16_vs_fp32_b256=<the same at 256> continuous_vs_static=<static seconds/continuous seconds, real vines,
--vine-dtype> adaptive_vs_fixed_seconds=<adaptive 0.45 seconds/fixed K = 9 seconds, continuous, --vine-dtype, the
same states>.
Every figure also goes to --json PATH, with the peak memory of each run (GB: the resident high-water mark on a CPU,
torch.cuda.max_memory_allocated on CUDA; runlog.peak_memory_gb).
"""
import argparse
import json
import time

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from bench.shapes import SHAPES, random_model
from bench.timing import best_time, decode_step_matmul_seconds, matmul_gflops, wait
from bench.vines import real_vines
from data import encode_prompt, load_split
from engine import HFSampler
from model import DEFAULT_MODEL, load_model, load_tokenizer
from runlog import peak_memory_gb, reset_peak_memory


def bench_prompts(tokenizer, count: int, length: int, data_dir, dataset: str = "gsm8k") -> list[list[int]]:
    """`count` distinct prompts of exactly `length` tokens, cut from real GSM8K (or generated arith) chat prompts."""
    questions = [e["question"] for e in load_split(dataset, "train", data_dir=data_dir)]
    prompts, i = [], 0
    while len(prompts) < count:
        text, ids = "", []
        while len(ids) < length:
            text, i = text + " " + questions[i], i + 1
            ids = encode_prompt(text, grader=dataset, tokenizer=tokenizer)
        prompts.append(ids[-length:])  # keep the end: the prompt still closes with the assistant tag
    return prompts


class FirstTokenClock(LogitsProcessor):
    """Notes when `generate` first asks for logits processing: the prompt's prefill is done then (on CUDA once the
    queued prefill has run: the first call waits for it)."""
    def __init__(self):
        self.first = None

    def __call__(self, input_ids, scores):
        if self.first is None:
            wait(scores.device)
            self.first = time.perf_counter()
        return scores


def run_generate(model, prompts, new_tokens: int) -> tuple[float, float]:
    """(total seconds, seconds from the first sampled token on)."""
    ids, clock = torch.tensor(prompts, device=model.device), FirstTokenClock()
    torch.manual_seed(0)
    wait(model.device)
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=0.6,
                       top_p=0.9, top_k=None, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                       pad_token_id=0, logits_processor=LogitsProcessorList([clock]))
    wait(model.device)
    end = time.perf_counter()
    return end - start, end - clock.first


def run_ours(sampler, prompts, new_tokens: int) -> tuple[float, float]:
    """(total seconds, seconds of the decode loop)."""
    start = time.perf_counter()
    sampler.sample(prompts, n=1, temperature=0.6, top_p=0.9, max_new_tokens=new_tokens, seed=0)
    return time.perf_counter() - start, sampler.timing["decode_s"]


def read_bandwidth(device: torch.device = torch.device("cpu")) -> float:
    """GB/s of streaming a 1 GiB tensor: what the attention's KV-cache reads run against."""
    x = torch.ones(2 ** 28, device=device)
    return 4 * x.numel() / best_time(lambda: x.sum(), device=device) / 1e9


def peak_gb(fn, device: torch.device):
    """(fn's result, the peak memory in GB while it ran: resident on a CPU, allocated by torch on CUDA)."""
    reset_peak_memory(device)
    result = fn()
    wait(device)
    return result, round(peak_memory_gb(device), 3)


def speed_table(reports: list[dict]) -> str:
    """A markdown table of --json reports (one per model): decode tokens/s and peak GB per batch, then the vines."""
    lines = ["| model | device | batch | generate tok/s | ours fp32 | ours bf16 | ours fp32 / generate | bf16 / fp32 | "
             "peak GB generate / ours / bf16 |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in reports:
        for b, x in r["batches"].items():
            lines.append(f"| {r['model']} | {r['device_name']} | {b} | {x['generate']:.0f} | {x['ours']:.0f} | "
                         f"{x['ours_bf16']:.0f} | {x['ours'] / x['generate']:.2f}x | {x['ours_bf16'] / x['ours']:.2f}x | "
                         f"{x['peak_gb_generate']:.2f} / {x['peak_gb_ours']:.2f} / {x['peak_gb_ours_bf16']:.2f} |")
    lines += ["", "| model | vine tokens | naive s | prefix reuse s (decode) | reuse bf16 s | 1-token prompts s | "
              "peak GB naive / reuse / bf16 |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in reports:
        v = r["vines"]
        lines.append(f"| {r['model']} | {v['tokens']} | {v['naive_s']:.2f} | {v['reuse_s']:.2f} "
                     f"({v['reuse_decode_s']:.2f}) | {v['reuse_bf16_s']:.2f} | {v['alone_s']:.2f} | "
                     f"{v['peak_gb_naive']:.2f} / {v['peak_gb_reuse']:.2f} / {v['peak_gb_reuse_bf16']:.2f} |")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--data-dir", default=None, help="as train.py: a folder, or hub (default: $VINEPPO_DATA_DIR, "
                        "else the shipped copy in data/)")
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
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--shape", choices=list(SHAPES), help="bench a random-weight model of this shape, not --model")
    parser.add_argument("--tokenizer", help="the tokenizer's folder or id (default: --model)")
    parser.add_argument("--dataset", default="gsm8k", choices=["gsm8k", "arith"], help="where the prompts come from")
    parser.add_argument("--json", help="also write every figure to this file")
    parser.add_argument("--vine-k", type=int, default=8, help="vines per state in the VinePPO pattern")
    parser.add_argument("--vine-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="the real-vines section's sampler dtype (auto: bf16 where native, else fp32, as train.py)")
    parser.add_argument("--vine-repeat", action=argparse.BooleanOptionalAction, default=True,
                        help="run the real-vines fixed-K pair again at the end, in reverse order, and take means")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda: torch sees no CUDA device")
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    tokenizer = load_tokenizer(args.tokenizer or args.model)
    if args.shape:
        model = random_model(args.shape, tokenizer=tokenizer, device=device)
    else:
        model = load_model(args.model, device=device, dtype=torch.float32, frozen=True)
    if args.only_vines:
        print(" ".join(f"{k}={v:.2f}" for k, v in real_vines(model, tokenizer, args).items()))
        return
    sampler = HFSampler(model, tokenizer, batch_size=256)
    bf16 = HFSampler(model, tokenizer, batch_size=256, dtype=torch.bfloat16)
    sampler.stop_ids = bf16.stop_ids = set()  # no EOS: every row generates exactly the tokens asked for
    prompts_of = lambda count: bench_prompts(tokenizer, count, args.prompt_len, args.data_dir, args.dataset)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"threads {args.threads}"
    params = sum(p.numel() for p in model.parameters())
    report = {"device": args.device, "device_name": name, "model": args.shape or args.model, "params": params,
              "torch": torch.__version__, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
              "matmul_gflops_1024": matmul_gflops(1024, 1024, 1024, device), "batches": {}}
    print(f"{name}; matmul 1024^3: {report['matmul_gflops_1024']:.0f} GFLOP/s"
          + (f"; {args.shape}: random weights, {params / 1e6:.0f}M parameters" if args.shape else ""), flush=True)

    bandwidth, cfg = read_bandwidth(device), model.config
    kv_bytes_per_position = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (
        cfg.hidden_size // cfg.num_attention_heads) * 4
    report["read_gb_s"] = bandwidth
    print(f"memory read bandwidth: {bandwidth:.1f} GB/s", flush=True)
    results = {}
    for b in [int(x) for x in args.batches.split(",")]:
        step_seconds, gflop = decode_step_matmul_seconds(model, b)
        limit = b / step_seconds
        context = args.prompt_len + args.new_tokens / 2  # mean positions attended per generated token
        floor = b / (step_seconds + b * context * kv_bytes_per_position / (bandwidth * 1e9))
        prompts = prompts_of(b)
        tokens = b * args.new_tokens
        (gen_total, gen_decode), gen_gb = peak_gb(lambda: run_generate(model, prompts, args.new_tokens), device)
        (ours_total, ours_decode), ours_gb = peak_gb(lambda: run_ours(sampler, prompts, args.new_tokens), device)
        (bf16_total, bf16_decode), bf16_gb = peak_gb(lambda: run_ours(bf16, prompts, args.new_tokens), device)
        gen, ours = tokens / gen_decode, tokens / ours_decode
        results[b] = (gen, ours, limit, tokens / bf16_decode)
        report["batches"][b] = {
            "limit": limit, "limit_kv": floor, "generate": gen, "ours": ours, "ours_bf16": tokens / bf16_decode,
            "generate_e2e": tokens / gen_total, "ours_e2e": tokens / ours_total, "ours_bf16_e2e": tokens / bf16_total,
            "peak_gb_generate": gen_gb, "peak_gb_ours": ours_gb, "peak_gb_ours_bf16": bf16_gb}
        print(f"batch {b:4d}: limit {limit:6.1f} tok/s ({gflop / b:.3f} GFLOP/token at {gflop / step_seconds:5.1f} "
              f"GFLOP/s; with KV reads {floor:6.1f}) | decode: generate {gen:6.1f} ({gen / limit:4.0%}), ours "
              f"{ours:6.1f} ({ours / limit:4.0%}), {ours / gen:4.2f}x | e2e: generate {tokens / gen_total:6.1f}, "
              f"ours {tokens / ours_total:6.1f}, {gen_total / ours_total:4.2f}x | bf16: decode {tokens / bf16_decode:6.1f} "
              f"({ours_decode / bf16_decode:4.2f}x fp32), e2e {tokens / bf16_total:6.1f} "
              f"({ours_total / bf16_total:4.2f}x) | peak GB: generate {gen_gb:.2f}, ours {ours_gb:.2f}, "
              f"bf16 {bf16_gb:.2f}", flush=True)

    # The VinePPO pattern: 8 responses x 4 states x K = 8 vines x 64 tokens.
    K, vine_tokens, starts = args.vine_k, 64, [0, 62, 125, 187]
    prompts = prompts_of(8)
    solutions, count = [e["solution"] for e in load_split(args.dataset, "test", data_dir=args.data_dir)], 40
    filler = tokenizer(" ".join(solutions[:count]), add_special_tokens=False).input_ids
    while len(filler) < 8 * 250 and count < len(solutions):  # arith's solutions are short; GSM8K's 40 suffice
        count += 40
        filler = tokenizer(" ".join(solutions[:count]), add_special_tokens=False).input_ids
    sequences = [p + filler[i * 250:(i + 1) * 250] for i, p in enumerate(prompts)]
    seqs = [s for s in sequences for _ in starts]
    lens = [len(p) + st for p in prompts for st in starts]
    kwargs = dict(temperature=0.6, top_p=0.9, max_new_tokens=vine_tokens, seed=0)
    timed = lambda fn: peak_gb(lambda: best_time(fn, repeats=1, device=device), device)
    reuse, reuse_gb = timed(lambda: sampler.sample_prefixes(seqs, lens, n=K, **kwargs))
    reuse_decode = sampler.timing["decode_s"]
    sampler.reuse_prefixes = False  # every vine prefilled from scratch
    naive, naive_gb = timed(lambda: sampler.sample([s[:L] for s, L in zip(seqs, lens) for _ in range(K)], n=1,
                                                   **kwargs))
    sampler.reuse_prefixes = True
    alone, _ = timed(lambda: sampler.sample([[s[0]] for s in seqs], n=K, **kwargs))
    reuse_bf16, reuse_bf16_gb = timed(lambda: bf16.sample_prefixes(seqs, lens, n=K, **kwargs))
    total = len(seqs) * K * vine_tokens
    report["vines"] = {"tokens": total, "naive_s": naive, "reuse_s": reuse, "reuse_decode_s": reuse_decode,
                       "alone_s": alone, "reuse_bf16_s": reuse_bf16, "peak_gb_naive": naive_gb,
                       "peak_gb_reuse": reuse_gb, "peak_gb_reuse_bf16": reuse_bf16_gb}
    print(f"vine pattern ({len(seqs)} states x K={K} x {vine_tokens} tokens = {total} tokens): naive {naive:.1f}s, "
          f"prefix reuse {reuse:.1f}s (prefill {reuse - reuse_decode:.1f}s + decode {reuse_decode:.1f}s), the same "
          f"tokens from a 1-token prompt {alone:.1f}s; prefix reuse in bf16 {reuse_bf16:.1f}s "
          f"({reuse / reuse_bf16:.2f}x fp32) | peak GB: naive {naive_gb:.2f}, reuse {reuse_gb:.2f}, "
          f"reuse bf16 {reuse_bf16_gb:.2f}", flush=True)

    # Greedy agreement of the bf16 sampler with the fp32 one.
    prompts = prompts_of(args.agree_prompts)
    kwargs = dict(n=1, temperature=0.0, top_p=1.0, max_new_tokens=64)
    agree = [next((i for i, (x, y) in enumerate(zip(a[0].token_ids, b[0].token_ids)) if x != y), 64)
             for a, b in zip(sampler.sample(prompts, **kwargs), bf16.sample(prompts, **kwargs))]
    report["greedy_bf16_vs_fp32"] = sorted(agree)
    print(f"greedy bf16 vs fp32, 64 tokens from {len(agree)} prompts: leading tokens in agreement {sorted(agree)} "
          f"(median {sorted(agree)[len(agree) // 2]}, all 64 in {agree.count(64)})", flush=True)

    real = real_vines(model, tokenizer, args)
    report["real_vines"] = real
    line = f"reuse_overhead={reuse / alone:.2f} reuse_vs_naive={naive / reuse:.2f}"
    if 64 in results and 256 in results:
        line = f"speedup_b64={results[64][1] / results[64][0]:.2f} frac_b256={results[256][1] / results[256][2]:.2f} " + line
        line += (f" bf16_vs_fp32_b64={results[64][3] / results[64][1]:.2f} "
                 f"bf16_vs_fp32_b256={results[256][3] / results[256][1]:.2f}")
    line += "".join(f" {k}={v:.2f}" for k, v in real.items())
    print(line)
    if args.json:
        report["summary"] = line
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
