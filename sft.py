"""Supervised fine-tuning on the train split's gold solutions, the start of the paper's RL runs:

    python sft.py --dataset arith --out-dir runs/sft-arith     then     python train.py --model runs/sft-arith ...

Targets: the worked solution (arith: `solution`; gsm8k: the `answer` field, ending "#### N"; math and a folder:
`solution`) followed by EOS, after the prompt train.py will use (--prompt-format). The loss is the mean negative
log-likelihood of each instance's target tokens, then the mean over the batch (as in the official repo). AdamW, warmup
then linear decay (ppo.make_optimizer); pass@1 on the test split before and after (rollout.evaluate).

    OUT/config.json, model.safetensors, tokenizer files   the final model (fp32), an HF folder (written last)
    OUT/metrics.jsonl                                     one line per optimizer step ("iteration": the step)
    OUT/ckpt-NNNNNN/, OUT/latest                          the last checkpoint, for --resume (checkpoint.py)

--stop-at P ends the run at the first check (every --stop-every steps) where greedy pass@1 on the validation split
reaches P: a start at a chosen pass@1 for tasks of different difficulty (the credit study's lengths). --keep-best
checks the same pass@1 and ends with the best checkpoint, as the paper's SFT (run to convergence, the lr decayed).

Under torchrun (dist.py) each rank takes batch_size / N instances of every step, DDP or --fsdp (FSDP2), and rank 0
writes the files; the step is the one a single process takes.
Shapes: B = instances in a micro-batch, P = prompt length (left-padded), R = target length (right-padded), T = P + R.
"""
import dataclasses
import os
import random
import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

import dist
from checkpoint import (Saver, best_so_far, load_best, open_run, repair_metrics, restore, save_best, save_final,
                        swap_best)
from config import arg, changed_flags, check_shared, derive_task, parse_dataclass
from data import encode_prompt, input_problem, load_split, load_splits, prompt_chars, task_chars
from engine import HFSampler
from grader import wrong_line_counts
from model import (DEFAULT_MODEL, Scorer, load_model, load_tokenizer, max_positions, model_problem,
                   new_scratch_model, pick_device, pick_dtype)
from ppo import make_optimizer, pad_episodes
from rollout import evaluate
from runlog import GracefulStop, RunLog, due, stop_after_interrupt


@dataclass
class SFTConfig:
    dataset: str = arg("arith", "gsm8k, math, arith, chain (arith written compactly, for --model scratch), or a "
                                "folder with train.jsonl and test.jsonl (rows without a \"solution\" are skipped)")
    grader: str = arg("auto", "how pass@1 is graded (as train.py): number, math; auto: by --dataset",
                      choices=["auto", "number", "math"])
    model: str = arg(DEFAULT_MODEL, "the model to fine-tune: Hub id, local HF folder or .gguf file; scratch: a new "
                                    "random-initialised Llama with a character tokenizer of the task (model.new_scratch_model)")
    scratch_layers: int = arg(4, "--model scratch: transformer layers")
    scratch_width: int = arg(128, "--model scratch: hidden size (the MLP is 4x; embeddings tied)")
    scratch_heads: int = arg(4, "--model scratch: attention heads (the width must divide by them)")
    prompt_format: str = arg("chat", "as train.py (pass the same one there): chat: the model's chat template; sft: "
                                     "the paper's '[MATH_TASK] Problem:' format; plain: the question and a newline",
                             choices=["chat", "sft", "plain"])
    out_dir: str | None = arg(None, "where the fine-tuned HF folder, metrics.jsonl and checkpoints go "
                                    "(default runs/sft-<dataset>-s<seed>)")
    seed: int = arg(0, "random seed (example order, evaluation sampling)")
    epochs: int = arg(2, "passes over the train split (official: 2)")
    max_steps: int = arg(0, "stop after this many optimizer steps (the schedule is laid out for them); 0: epochs")
    lr: float = arg(1e-5, "AdamW peak learning rate (official: 1e-5 for the 1.1B model, 5e-5 for 7B)")
    warmup_ratio: float = arg(0.03, "fraction of optimizer steps spent warming up, then linear decay to 0")
    lr_decay: bool = arg(True, "decay the lr linearly to 0 after warmup (--no-lr-decay: constant, the start to hand "
                               "RL: RL barely moved models decayed to 0, research/anneal)")
    decay_steps: int = arg(0, "decay over the last this many steps only, constant before (warmup-stable-decay); 0: "
                              "over every step after warmup")
    lr_floor: float = arg(0.0, "the decay ends at this fraction of --lr instead of 0")
    weight_decay: float = arg(0.0, "AdamW weight decay")
    max_grad_norm: float = arg(1.0, "gradient-norm clip")
    batch_size: int | None = arg(None, "instances per optimizer step (official: 64; CPU default: 16)")
    micro_batch_size: int | None = arg(None, "instances per forward/backward (GPU default: 8; CPU: 4)")
    max_length: int = arg(1024, "prompt + target tokens at most; longer targets are cut (and lose their EOS)")
    dtype: str = arg("auto", "compute dtype (autocast); master weights and AdamW stay fp32. auto: bf16 where native",
                     choices=["auto", "float32", "bfloat16"])
    device: str = arg("auto", "auto, cpu or cuda")
    threads: int = arg(0, "CPU threads for torch's ops (0: torch's default, every core); 1 suits a tiny model, whose "
                          "ops are too small to share out (on a busy machine more threads can be far slower)")
    eval_size: int | None = arg(None, "test problems for pass@1 before and after (default: all on GPU; CPU: 32)")
    eval_samples: int | None = arg(None, "samples per test problem (GPU default: 16; CPU: 4)")
    eval_temperature: float = arg(0.35, "sampling temperature for evaluation; 0: greedy")
    top_p: float = arg(0.9, "nucleus sampling threshold for evaluation")
    max_new_tokens: int | None = arg(None, "evaluation response length limit (GPU default: 1024; CPU: 256)")
    gen_batch_size: int = arg(256, "rows per generation batch in evaluation")
    arith_ops: int = arg(1, "arith: operations per problem")
    arith_max: int = arg(20, "arith: largest starting number / addend")
    chain_filler: int = arg(0, "chain: filler lines after the operation lines (as train.py)")
    chain_bug: str = arg("none", "chain: the train demonstrations are a buggy solver's, the answers still right: borrow "
                                 "(a subtraction that needs a borrow done without it) or borrow-carry (and an addition "
                                 "without its carry), on --chain-bug-rate of those lines (research/paper_regime)",
                         choices=["none", "borrow", "borrow-carry"])
    chain_bug_rate: float = arg(0.7, "--chain-bug: the share of the lines needing a borrow (carry) done wrong")
    save_every: int = arg(100, "write a checkpoint every this many steps (and at the end, and on Ctrl-C)")
    stop_at: float = arg(0.0, "stop once greedy pass@1 on the validation split (arith, chain: problems in neither "
                              "train nor test) reaches this; 0: off (a start at a chosen pass@1, whatever the task)")
    stop_every: int = arg(25, "--stop-at, --keep-best: check every this many steps")
    stop_size: int = arg(200, "--stop-at, --keep-best: validation problems checked")
    keep_best: bool = arg(False, "the final model is the checkpoint of best greedy validation pass@1 (checked every "
                                 "--stop-every steps; the paper's SFT), kept in --out-dir/best while the run goes")
    resume: bool = arg(False, "continue from the last checkpoint in --out-dir")
    overwrite: bool = arg(False, "start afresh in an --out-dir that holds a run")
    trust_remote_code: bool = arg(False, "allow model repositories to run their own code")
    data_dir: str | None = arg(None, "gsm8k, math: as train.py's --data-dir")
    fsdp: bool = arg(False, "under torchrun: shard weights, gradients and AdamW's state with FSDP2 (off: DDP)")
    task: str | None = arg(None, "", derived=True)  # derived from --dataset (train.py's cfg.task)


SFT_DEFINING = ("dataset", "grader", "model", "prompt_format", "seed", "epochs", "batch_size", "max_length",
                "arith_ops", "arith_max", "chain_filler", "chain_bug", "chain_bug_rate", "scratch_layers",
                "scratch_width", "scratch_heads")  # a resumed run must have these as saved; the others may change


SFT_GROUPS = {  # --help in groups, SFT's own flags first
    "supervised fine-tuning": ["dataset", "model", "prompt_format", "epochs", "max_steps", "lr", "warmup_ratio",
                               "lr_decay", "decay_steps", "lr_floor", "weight_decay", "max_grad_norm", "batch_size",
                               "micro_batch_size", "max_length", "seed"],
    "data": ["grader", "data_dir", "arith_ops", "arith_max", "chain_filler", "chain_bug", "chain_bug_rate",
             "trust_remote_code"],
    "a model from scratch (--model scratch)": ["scratch_layers", "scratch_width", "scratch_heads"],
    "validation: stop at a pass@1, keep the best": ["stop_at", "stop_every", "stop_size", "keep_best"],
    "machine and precision": ["dtype", "device", "threads", "gen_batch_size", "fsdp"],
    "evaluation, logging and checkpoints": ["eval_size", "eval_samples", "eval_temperature", "top_p",
                                            "max_new_tokens", "out_dir", "save_every", "resume", "overwrite"],
}


def parse_sft_config(argv=None) -> SFTConfig:
    parser, cfg = parse_dataclass(SFTConfig, argv, description=__doc__, groups=SFT_GROUPS)
    derive_task(parser, cfg)  # cfg.task, and --grader auto's choice (as train.py)
    gpu = pick_device(cfg.device).type == "cuda"
    for name, paper, cpu in (("batch_size", 64, 16), ("micro_batch_size", 8, 4), ("eval_samples", 16, 4),
                             ("max_new_tokens", 1024, 256), ("eval_size", 10**9, 32)):
        if getattr(cfg, name) is None:
            setattr(cfg, name, paper if gpu else cpu)
    stem = Path(cfg.dataset).expanduser().resolve().name if cfg.task == "custom" else cfg.dataset
    cfg.out_dir = cfg.out_dir or f"runs/sft-{stem}-s{cfg.seed}"
    check_shared(parser, cfg, at_least_1=("epochs", "batch_size", "micro_batch_size", "max_length", "eval_size",
                                          "eval_samples", "max_new_tokens", "gen_batch_size", "arith_ops", "arith_max",
                                          "save_every", "stop_every", "stop_size", "scratch_layers", "scratch_width",
                                          "scratch_heads"))
    if cfg.chain_bug != "none" and (cfg.dataset != "chain" or cfg.chain_filler or not 0 < cfg.chain_bug_rate <= 1):
        parser.error(f"--chain-bug {cfg.chain_bug} takes --dataset chain without --chain-filler and a "
                     f"--chain-bug-rate in (0, 1] (got --dataset {cfg.dataset}, --chain-filler {cfg.chain_filler}, "
                     f"--chain-bug-rate {cfg.chain_bug_rate})")
    if cfg.keep_best and (cfg.dataset not in ("arith", "chain") or cfg.stop_at):
        parser.error(f"--keep-best checks the validation split of arith or chain, without --stop-at (got --dataset "
                     f"{cfg.dataset}, --stop-at {cfg.stop_at})")
    if not 0 <= cfg.stop_at <= 1 or cfg.stop_at and cfg.dataset not in ("arith", "chain"):
        parser.error(f"--stop-at takes a pass@1 in [0, 1], with --dataset arith or chain only (got {cfg.stop_at} with "
                     f"--dataset {cfg.dataset})")
    if cfg.max_steps < 0:
        parser.error(f"--max-steps must be 0 (epochs) or above (got {cfg.max_steps})")
    world = int(os.environ.get("WORLD_SIZE", "1"))  # ranks under torchrun; --batch-size is global
    if cfg.keep_best and world > 1:
        parser.error("--keep-best runs in one process (the testbed's tiny models), not under torchrun")
    if cfg.batch_size % (world * cfg.micro_batch_size):
        parser.error(f"--batch-size ({cfg.batch_size}) must be a multiple of --micro-batch-size "
                     f"({cfg.micro_batch_size}) x the number of ranks ({world})")
    if cfg.decay_steps < 0 or not 0 <= cfg.lr_floor <= 1:
        parser.error(f"--decay-steps must be 0 or above and --lr-floor in [0, 1] (got {cfg.decay_steps}, "
                     f"{cfg.lr_floor})")
    if cfg.scratch_width % cfg.scratch_heads or (cfg.scratch_width // cfg.scratch_heads) % 2:
        parser.error(f"--scratch-width ({cfg.scratch_width}) must be an even multiple of --scratch-heads "
                     f"({cfg.scratch_heads}): each head's width is even (RoPE)")
    if cfg.model == "scratch" and cfg.prompt_format == "chat":
        parser.error("--model scratch has no chat template: pass --prompt-format plain (or sft)")
    problem = None if cfg.model == "scratch" else model_problem(cfg.model)
    if problem:
        parser.error(f"--model {cfg.model}: {problem}")
    return cfg


def sft_loss(*, logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean negative log-likelihood of each instance's target tokens, then the mean over instances: a long and a short
    instance weigh the same. logprobs: (B, R) of the target tokens; mask: (B, R), 1 on target tokens (prompt and
    padding are not in R or are 0). Instances without a target token are left out."""
    mask = mask.float()
    tokens = mask.sum(1)  # (B,)
    per_instance = -(logprobs * mask).sum(1) / tokens.clamp(min=1)  # (B,)
    kept = tokens > 0
    return per_instance[kept].sum() / kept.sum().clamp(min=1)


def sft_target(example: dict, *, tokenizer, prompt_format: str) -> list[int]:
    """The target token ids: the worked solution, then EOS. GSM8K's calculator annotations ("<<48/2=24>>") are
    removed, as in the official SFT data. With the paper's prompt (which ends "Solution:") the solution goes on a new
    line and ends with one, as the official response template "\\n{answer}\\n" has it; the chat template already
    opens the assistant's turn on its own line."""
    text = re.sub(r"<<[^<>]*>>", "", example["solution"]).strip()
    text = f"\n{text}\n" if prompt_format == "sft" else text
    return tokenizer(text, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]


def encode_examples(examples: list[dict], *, tokenizer, cfg: SFTConfig) -> tuple[list[tuple[list, list]], int]:
    """(prompt ids, target ids) of every example with a solution, cut to max_length; and how many were cut."""
    pairs, cut = [], 0
    for e in examples:
        if not e["solution"].strip():
            continue
        prompt = encode_prompt(e["question"], grader=cfg.grader, tokenizer=tokenizer, prompt_format=cfg.prompt_format)
        target = sft_target(e, tokenizer=tokenizer, prompt_format=cfg.prompt_format)
        room = cfg.max_length - len(prompt)
        if room < 1:
            cut += 1
            continue
        cut += len(target) > room
        pairs.append((prompt, target[:room]))
    return pairs, cut


def step_examples(step: int, *, n: int, batch_size: int, seed: int) -> list[int]:
    """The example indices of step `step` (0-based): each epoch a fresh permutation of the n examples cut into full
    batches (the remainder dropped). A function of the step alone: a resumed run needs no RNG state."""
    per_epoch = n // batch_size
    epoch, k = divmod(step, per_epoch)
    order = list(range(n))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order[k * batch_size:(k + 1) * batch_size]


def sft_step(scorer, optimizer, scheduler, pairs: list[tuple[list, list]], *, batch_size: int, micro_batch_size: int,
             pad_id: int, max_grad_norm: float) -> dict:
    """One optimizer step on `pairs`, this rank's share of a batch of batch_size instances: each micro-batch's loss
    weighted by its share of the batch, so the gradient is the batch mean loss's (under torchrun DDP averages: each
    loss x the world size, reduced once, on the last micro-batch). Returns the loss, grad norm, target tokens and
    all tokens (prompt + target, not padding), over all ranks."""
    device = next(scorer.parameters()).device
    optimizer.zero_grad(set_to_none=True)
    total, tokens, seen = 0.0, 0, 0
    for a in range(0, len(pairs), micro_batch_size):
        part = pairs[a:a + micro_batch_size]
        input_ids, attention_mask, mask, P = pad_episodes([p for p, _ in part], [t for _, t in part], pad_id=pad_id)
        with dist.sync_gradients(scorer, a + micro_batch_size >= len(pairs)):
            logprobs, _, _, _ = scorer(input_ids.to(device), attention_mask.to(device), response_start=P,
                                    temperature=1.0)  # (B, R)
            loss = sft_loss(logprobs=logprobs, mask=mask.to(device)) * (len(part) / batch_size)
            (loss * dist.world()).backward()
        total, tokens, seen = total + loss.item(), tokens + int(mask.sum()), seen + int(attention_mask.sum())
    total, tokens, seen = dist.all_sum(torch.tensor([total, tokens, seen])).tolist()  # over all ranks
    grad_norm = torch.nn.utils.clip_grad_norm_(scorer.parameters(), max_grad_norm).item()
    optimizer.step()
    scheduler.step()
    return {"loss": total, "grad_norm": grad_norm, "tokens": int(tokens), "tokens_all": int(seen)}


def validate(sampler, policy, tokenizer, validation: list[dict], cfg: SFTConfig, *, completed: int, last: bool,
             record: dict) -> float | None:
    """--stop-at, --keep-best: greedy validation pass@1 (into `record`) every --stop-every steps (--keep-best: and
    the last); None between checks."""
    if not validation or completed % cfg.stop_every and not (cfg.keep_best and last):
        return None
    sampler.sync(policy)
    greedy = dataclasses.replace(cfg, eval_temperature=0.0, eval_samples=1)
    record["validation_accuracy"], record["validation_se"] = evaluate(sampler, tokenizer, validation, greedy,
                                                                      seed=cfg.seed)
    return record["validation_accuracy"]


def main(cfg: SFTConfig):
    device = pick_device(cfg.device)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    rank, world = dist.init(device)  # (0, 1) without torchrun
    torch.manual_seed(cfg.seed)
    out_dir = Path(cfg.out_dir)
    source, state = open_run(out_dir, resume=cfg.resume, overwrite=cfg.overwrite,
                             compare=lambda saved: (changed_flags(saved, cfg, SFT_DEFINING), []))
    if rank == 0 and source is None:  # a fresh run: an old final model there is not this run's (save_final rewrites it)
        (out_dir / "config.json").unlink(missing_ok=True)
        for old in ("best", "best.old"):
            shutil.rmtree(out_dir / old, ignore_errors=True)
    dtype = pick_dtype(cfg.dtype, device)
    train_set, test_set = load_splits(cfg.dataset, data_dir=cfg.data_dir, arith_ops=cfg.arith_ops,
                                      arith_max=cfg.arith_max, eval_size=cfg.eval_size, chain_filler=cfg.chain_filler,
                                      chain_bug=cfg.chain_bug, chain_bug_rate=cfg.chain_bug_rate)
    model = cfg.model
    if model == "scratch":  # a new random-initialised model and character tokenizer, saved as an HF folder
        model = str(out_dir / "init")
        if rank == 0:
            chars = task_chars(train_set + test_set) + prompt_chars(cfg.prompt_format, grader=cfg.grader)
            new_scratch_model(Path(model), chars=chars, layers=cfg.scratch_layers, width=cfg.scratch_width,
                              heads=cfg.scratch_heads, seed=cfg.seed)
        dist.barrier()
    validation = load_split(cfg.dataset, "validation", arith_ops=cfg.arith_ops, arith_max=cfg.arith_max,
                            chain_filler=cfg.chain_filler)[:cfg.stop_size] if cfg.stop_at or cfg.keep_best else []
    tokenizer = load_tokenizer(model)
    if problem := input_problem(tokenizer, examples=train_set + test_set, prompt_format=cfg.prompt_format,
                                grader=cfg.grader, max_new_tokens=cfg.max_new_tokens,
                                max_positions=max_positions(model)):
        raise SystemExit(f"error: {problem}")
    pairs, cut = encode_examples(train_set, tokenizer=tokenizer, cfg=cfg)
    if len(pairs) < cfg.batch_size:
        raise SystemExit(f"error: --dataset {cfg.dataset}: {len(pairs)} train rows with a solution, fewer than "
                         f"--batch-size {cfg.batch_size}")
    per_epoch = len(pairs) // cfg.batch_size
    total = cfg.max_steps or cfg.epochs * per_epoch
    dist.print0(f"{len(pairs)} train examples ({len(train_set) - len(pairs)} without a solution skipped, {cut} cut "
                f"to --max-length {cfg.max_length}), {per_epoch} steps per epoch of {cfg.batch_size}; {total} steps")
    policy = load_model(str(source or model), device=device, dtype=torch.float32,
                        trust_remote_code=cfg.trust_remote_code)
    stop_strings = ["\n\n\nProblem:"] if cfg.prompt_format == "sft" else []
    sampler = HFSampler(policy, tokenizer, dtype=dtype, stop_strings=stop_strings, batch_size=cfg.gen_batch_size)
    scorer = dist.wrap(Scorer(policy, dtype=dtype), fsdp=cfg.fsdp)  # DDP / FSDP2 under torchrun; before AdamW
    optimizer, scheduler = make_optimizer([{"params": policy.parameters(), "lr": cfg.lr}],
                                          weight_decay=cfg.weight_decay, total_steps=total,
                                          warmup_ratio=cfg.warmup_ratio, decay=cfg.lr_decay,
                                          decay_steps=cfg.decay_steps, floor=cfg.lr_floor)
    start, train_seconds, rng = 0, 0.0, random.Random(cfg.seed)  # rng: unused, kept for checkpoint.py's format
    if state:
        start, train_seconds = restore(state, scorer=scorer, optimizer=optimizer, scheduler=scheduler, rng=rng,
                                       lrs=[cfg.lr])
        if rank == 0:
            repair_metrics(out_dir / "metrics.jsonl", upto=start)
        dist.print0(f"resumed from {source} at step {start}")
    best = best_so_far(out_dir, upto=start) if cfg.keep_best else None
    runlog = RunLog(out_dir, cfg, total=total, first=start, unit="step")  # metrics.jsonl
    saver = Saver(out_dir, rng=rng, completed=start, train_seconds=train_seconds, scorer=scorer, policy=policy,
                  value_head=None, tokenizer=tokenizer, optimizer=optimizer, scheduler=scheduler, cfg=cfg)
    stop, completed = GracefulStop(), start
    if dist.active():
        stop.hold()  # under torchrun a signal is acted on at a step's end, by all ranks together
    try:
        if start == 0:
            t0 = time.perf_counter()
            accuracy, se = evaluate(sampler, tokenizer, test_set, cfg, seed=cfg.seed)
            runlog.write({"iteration": 0, "eval_accuracy": accuracy, "eval_se": se,
                          "seconds_eval": time.perf_counter() - t0})
            dist.print0(f"step 0: eval pass@1 {accuracy:.3f} ± {se:.3f} on {len(test_set)} problems x "
                        f"{cfg.eval_samples} ({time.perf_counter() - t0:.0f}s)")
        runlog.start_clock()
        for step in range(start, total):
            stop.hold()  # a signal now lets this step finish, then saves and stops
            t0, lr = time.perf_counter(), optimizer.param_groups[0]["lr"]
            batch = [pairs[i] for i in step_examples(step, n=len(pairs), batch_size=cfg.batch_size, seed=cfg.seed)]
            stats = sft_step(scorer, optimizer, scheduler, batch[rank::world], batch_size=cfg.batch_size,
                             micro_batch_size=cfg.micro_batch_size, pad_id=tokenizer.pad_token_id,
                             max_grad_norm=cfg.max_grad_norm)  # this rank's share of the step's batch
            seconds = time.perf_counter() - t0
            completed, train_seconds = step + 1, train_seconds + seconds
            record = {"iteration": completed, "epoch": step / per_epoch, "lr": lr, **stats, "seconds": seconds,
                      "tokens_per_s": stats["tokens_all"] / seconds, "target_tokens_per_s": stats["tokens"] / seconds,
                      "train_seconds": train_seconds}
            accuracy = validate(sampler, policy, tokenizer, validation, cfg, completed=completed,
                                last=completed == total, record=record)
            if cfg.stop_at and accuracy is not None and accuracy >= cfg.stop_at:
                total = record["stopped_at_target"] = completed  # the last step: its test evaluation and save follow
            new_best = cfg.keep_best and accuracy is not None and accuracy > best["validation_accuracy"]
            if new_best:  # staged; swapped in after this step's checkpoint, so a resume never starts behind it
                best = save_best(out_dir, policy=policy, tokenizer=tokenizer, step=completed, accuracy=accuracy)
            if completed == total:
                if cfg.keep_best:  # the final model is the best checkpoint: evaluated and saved below
                    if not new_best:  # (a best of this very step is the policy as it is)
                        load_best(out_dir, policy)
                    record["best_step"] = best["step"]
                sampler.sync(policy)
                t1 = time.perf_counter()
                graded = []
                record["eval_accuracy"], record["eval_se"] = evaluate(sampler, tokenizer, test_set, cfg, seed=cfg.seed,
                                                                      keep=graded)
                record["seconds_eval"] = time.perf_counter() - t1
                if cfg.task in ("arith", "chain"):  # a line per operation: where the wrong samples leave the gold
                    record["first_wrong_line"] = wrong_line_counts([t for part in dist.all_gather(graded) for t in part])
                    dist.print0(f"first wrong line of the wrong samples (line: count): {record['first_wrong_line']}")
            runlog.write(record)
            saver.note(completed, train_seconds)
            stopping = stop.any_rank()
            if due(completed, every=cfg.save_every, last=total, now=stopping) or new_best:
                saver.save()
            if new_best:
                swap_best(out_dir)
            if not dist.active():
                stop.release()
            evaluated = f", eval pass@1 {record['eval_accuracy']:.3f} ± {record['eval_se']:.3f}" if (
                "eval_accuracy" in record) else ""
            runlog.line(completed, f"loss {stats['loss']:.4f}, lr {lr:.2e}, grad norm {stats['grad_norm']:.2f}, "
                                   f"{record['tokens_per_s']:.0f} tok/s ({record['target_tokens_per_s']:.0f} target "
                                   f"tok/s){evaluated}")
            if stopping:
                sys.exit(stop.exit_code())
            if completed == total:  # --stop-at may end the run before the schedule does
                break
    except KeyboardInterrupt:  # a second signal during a step saves nothing (its weights are half-updated)
        stop_after_interrupt(stop, completed=saver.completed, unit="step", save=saver.save)
    finally:
        runlog.close()
    save_final(out_dir, policy=policy, tokenizer=tokenizer, prompt_format=cfg.prompt_format)
    dist.finish()


if __name__ == "__main__":
    main(parse_sft_config())
