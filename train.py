"""VinePPO training loop: python train.py --dataset gsm8k --k 9

Each iteration: 1. sample prompts  2. rollouts  3. grade  4. split steps + MC values (K vines per state)
5. advantages (GAE)  6. PPO epochs  7. sampler sync  8. eval / log / checkpoint.
Defaults follow the paper and the official repo; on a machine without a GPU the batch sizes, response length and
eval size shrink to CPU scale (see --help and README).
"""
import argparse
import dataclasses
import json
import math
import os
import random
import shutil
import sys
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch

from advantages import critic_advantages, group_baseline_advantages, vine_advantages, whiten
from data import encode_prompt, load_split
from grader import grade
from model import DEFAULT_MODEL, load_model, load_tokenizer, new_value_head, pick_device, pick_dtype, resolve_model
from ppo import batch_logprobs, micro_batches, pad_episodes, pad_rows, ppo_update, sampler_mismatch, tis_weights
from rollout import make_sampler
from values import estimate_values, step_token_starts, token_step_index


def arg(default, help, **kwargs):
    return field(default=default, metadata=dict(help=help, **kwargs))


@dataclass
class Config:
    dataset: str = arg("gsm8k", "task (arith: generated arithmetic word problems, learnable on a CPU)",
                       choices=["gsm8k", "math", "arith"])
    estimator: str = arg("vine", "advantage estimator: vine (VinePPO), critic (PPO value head, GAE), grpo, rloo",
                         choices=["vine", "critic", "grpo", "rloo"])
    data_dir: str | None = arg(None, "folder with <dataset>/{train,test}.jsonl (else $VINEPPO_DATA_DIR, else the Hub)")
    model: str = arg(DEFAULT_MODEL, "Hub id, local HF folder or .gguf file")
    prompt_format: str = arg("chat", "chat: the model's chat template; sft: the paper's '[MATH_TASK] Problem:' format",
                             choices=["chat", "sft"])
    out_dir: str | None = arg(None, "where metrics.jsonl and checkpoints go (default runs/<dataset>-k<K>-s<seed>)")
    seed: int = arg(0, "random seed (prompt order, sampling, minibatches)")
    iterations: int | None = arg(None, "PPO iterations (paper: 650 gsm8k, 1000 math; arith: 200)")
    time_budget: float = arg(0.0, "stop once this many seconds of training (evaluation excluded) have passed; 0: none")
    arith_ops: int = arg(1, "arith: operations per problem (1: the base model starts near 17%% pass@1; 2: near 2%%)")
    arith_max: int = arg(20, "arith: largest starting number / addend")
    prompts_per_iter: int | None = arg(None, "problems per iteration (paper: 64; CPU default: 4)")
    samples_per_prompt: int | None = arg(None, "responses per problem (paper: 8; CPU default: 4)")
    max_new_tokens: int | None = arg(None, "response length limit (paper: 1024; CPU default: 192)")
    k: int = arg(9, "K: vines (MC continuations) per state (paper: 9)")
    temperature: float = arg(0.6, "sampling temperature for rollouts and vines")
    top_p: float = arg(0.9, "nucleus sampling threshold")
    gamma: float = arg(1.0, "discount")
    lam: float | None = arg(None, "GAE lambda (default: 0 for vine, 1 for critic as in the paper's PPO)")
    clip: float = arg(0.2, "PPO clip range")
    kl_coef: float = arg(1e-4, "coefficient of the k3 KL penalty to the reference, in the loss")
    lr: float = arg(1e-6, "AdamW learning rate (linear warmup, then linear decay to 0)")
    lr_decay: bool = arg(True, "decay the lr linearly to 0 at --iterations (off: constant after warmup)")
    warmup_ratio: float = arg(0.03, "fraction of optimizer steps spent warming up")
    weight_decay: float = arg(0.0, "AdamW weight decay")
    epochs: int = arg(2, "PPO epochs per iteration")
    minibatch_size: int | None = arg(None, "episodes per optimizer step (paper: 64; CPU default: 8)")
    micro_batch_size: int | None = arg(None, "episodes per forward/backward (gradient accumulation; CPU default: 4)")
    max_grad_norm: float = arg(1.0, "gradient-norm clip")
    vf_coef: float = arg(0.1, "critic: weight of the value loss")
    value_clip: float = arg(0.2, "critic: value clipping range")
    value_lr: float | None = arg(None, "critic: learning rate of the value head (default: --lr)")
    whiten: bool = arg(True, "normalise advantages over the batch")
    max_value_steps: int | None = arg(None, "estimate at most this many states per response (default: 25 gsm8k, "
                                            "no cap math; 0 = no cap)")
    step_split: str = arg("auto", "auto: the dataset's text rule; tokens:N: a step every N tokens")
    eval_every: int = arg(10, "evaluate every this many iterations (and before the first, and after the last)")
    eval_size: int | None = arg(None, "test problems per evaluation (default: all on GPU; CPU default: 32)")
    eval_samples: int | None = arg(None, "samples per test problem, pass@1 = mean correctness (paper: 16; CPU: 4)")
    eval_temperature: float = arg(0.35, "sampling temperature for evaluation")
    save_every: int = arg(10, "write a checkpoint every this many iterations (and at the end, and on Ctrl-C)")
    resume: bool = arg(False, "continue from the last checkpoint in --out-dir")
    sampler: str = arg("auto", "auto: vLLM if it imports and starts, else our decode loop (hf); generate: "
                               "transformers' generate", choices=["auto", "hf", "generate", "vllm"])
    gen_batch_size: int = arg(256, "rows per generation batch (transformers samplers)")
    device: str = arg("auto", "auto, cpu or cuda")
    dtype: str = arg("auto", "compute dtype of training (autocast), the sampler and the reference; master weights and "
                             "AdamW stay fp32. auto: bf16 on CUDA and on CPUs with native bf16 (avx512_bf16 / AMX), "
                             "else fp32", choices=["auto", "float32", "bfloat16"])
    tis_cap: float = arg(0.0, "truncated importance sampling: weight each token's PPO loss by min(pi_old / "
                              "pi_sampler, C); 0: off")
    trust_remote_code: bool = arg(False, "allow model repositories to run their own code")


def parse_config(argv=None) -> Config:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in dataclasses.fields(Config):
        name, meta = "--" + f.name.replace("_", "-"), dict(f.metadata)
        if f.type is bool:
            parser.add_argument(name, action=argparse.BooleanOptionalAction, default=f.default, **meta)
        else:  # `int | None` parses as int
            kind = next(t for t in getattr(f.type, "__args__", (f.type,)) if t is not type(None))
            parser.add_argument(name, type=kind, default=f.default, **meta)
    cfg = Config(**vars(parser.parse_args(argv)))
    # Derived values: paper sizes on a GPU, CPU sizes otherwise.
    gpu = pick_device(cfg.device).type == "cuda"
    for name, paper, cpu in (("prompts_per_iter", 64, 4), ("samples_per_prompt", 8, 4), ("max_new_tokens", 1024, 192),
                             ("minibatch_size", 64, 8), ("micro_batch_size", 8, 4), ("eval_samples", 16, 4)):
        if getattr(cfg, name) is None:
            setattr(cfg, name, paper if gpu else cpu)
    if cfg.iterations is None:
        cfg.iterations = {"gsm8k": 650, "math": 1000, "arith": 200}[cfg.dataset]
    if cfg.lam is None:
        cfg.lam = 1.0 if cfg.estimator == "critic" else 0.0
    cfg.value_lr = cfg.lr if cfg.value_lr is None else cfg.value_lr
    if cfg.eval_size is None:
        cfg.eval_size = 10**9 if gpu else 32
    if cfg.max_value_steps is None:
        cfg.max_value_steps = 0 if cfg.dataset == "math" else 25
    cfg.out_dir = cfg.out_dir or f"runs/{cfg.dataset}-{cfg.estimator}-k{cfg.k}-s{cfg.seed}"
    for name in ("iterations", "prompts_per_iter", "samples_per_prompt", "max_new_tokens", "k", "epochs", "arith_ops",
                 "arith_max", "minibatch_size", "micro_batch_size", "eval_every", "eval_size", "eval_samples",
                 "save_every", "gen_batch_size"):
        if getattr(cfg, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1 (got {getattr(cfg, name)})")
    if cfg.minibatch_size % cfg.micro_batch_size:
        parser.error(f"--minibatch-size ({cfg.minibatch_size}) must be a multiple of --micro-batch-size "
                     f"({cfg.micro_batch_size})")
    if cfg.tis_cap != 0 and cfg.tis_cap < 1:
        parser.error(f"--tis-cap must be 0 (off) or at least 1 (got {cfg.tis_cap})")
    if not (cfg.step_split == "auto" or cfg.step_split.startswith("tokens:") and cfg.step_split[7:].isdigit()
            and int(cfg.step_split[7:]) > 0):
        parser.error(f"--step-split must be auto or tokens:N with N >= 1 (got {cfg.step_split!r})")
    return cfg


def lr_factor(step: int, *, warmup: int, total: int, decay: bool = True) -> float:
    """Linear warmup to 1 over `warmup` steps, then linear decay to 0 at `total` (or constant 1 without decay)."""
    if step < warmup:
        return (step + 1) / warmup
    return max(0.0, (total - step) / max(1, total - warmup)) if decay else 1.0


def evaluate(sampler, tokenizer, examples, cfg: Config, *, seed: int) -> float:
    """pass@1: mean correctness of eval_samples samples per test problem at the eval temperature."""
    prompts = [encode_prompt(e["question"], dataset=cfg.dataset, tokenizer=tokenizer, prompt_format=cfg.prompt_format)
               for e in examples]
    samples = sampler.sample(prompts, n=cfg.eval_samples, temperature=cfg.eval_temperature, top_p=cfg.top_p,
                             max_new_tokens=cfg.max_new_tokens, seed=seed)
    scores = [grade(s.text, e["answer"], dataset=cfg.dataset, truncated=not s.finished)
              for e, group in zip(examples, samples) for s in group]
    return sum(scores) / max(len(scores), 1)


def save_checkpoint(out_dir: Path, *, iteration: int, policy, value_head, tokenizer, optimizer, scheduler,
                    rng: random.Random, cfg: Config, train_seconds: float):
    """Write ckpt-<iteration>/ atomically (temp folder + rename), then point `latest` at it and drop older ones."""
    final = out_dir / f"ckpt-{iteration:06d}"
    tmp = out_dir / f".tmp-ckpt-{iteration:06d}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    policy.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if value_head is not None:
        torch.save(value_head.state_dict(), tmp / "value_head.pt")
    torch.save({"iteration": iteration, "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "python_rng": rng.getstate(), "torch_rng": torch.get_rng_state(), "config": dataclasses.asdict(cfg),
                "train_seconds": train_seconds}, tmp / "trainer_state.pt")
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    (out_dir / "latest.tmp").write_text(final.name)
    os.replace(out_dir / "latest.tmp", out_dir / "latest")
    for old in out_dir.glob("ckpt-*"):
        if old != final:
            shutil.rmtree(old, ignore_errors=True)
    print(f"saved {final}", flush=True)


def latest_checkpoint(out_dir: Path) -> Path:
    pointer = out_dir / "latest"
    if not pointer.exists() or not (out_dir / pointer.read_text().strip() / "trainer_state.pt").exists():
        raise SystemExit(f"error: --resume: no checkpoint in {out_dir} (expected {pointer} naming a ckpt-* folder)")
    return out_dir / pointer.read_text().strip()


def main(cfg: Config):
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    out_dir = Path(cfg.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    device = pick_device(cfg.device)
    dtype = pick_dtype(cfg.dtype, device)  # compute dtype; the policy's master weights are fp32
    splits = {split: load_split(cfg.dataset, split, data_dir=cfg.data_dir, arith_ops=cfg.arith_ops,
                                arith_max=cfg.arith_max) for split in ("train", "test")}
    train_set, test_set = splits["train"], splits["test"][:cfg.eval_size]
    tokenizer = load_tokenizer(cfg.model)
    source = latest_checkpoint(out_dir) if cfg.resume else cfg.model
    policy = load_model(str(source), device=device, dtype=torch.float32, trust_remote_code=cfg.trust_remote_code)
    reference = load_model(cfg.model, device=device, dtype=torch.float32, trust_remote_code=cfg.trust_remote_code,
                           frozen=True)  # fp32 like the policy: in bf16, KL(policy || reference) starts at 0.011
    value_head = new_value_head(policy) if cfg.estimator == "critic" else None
    param_groups = [{"params": policy.parameters(), "lr": cfg.lr}]
    if value_head is not None:
        param_groups.append({"params": value_head.parameters(), "lr": cfg.value_lr})
    optimizer = torch.optim.AdamW(param_groups, weight_decay=cfg.weight_decay)
    total_steps = cfg.iterations * cfg.epochs * math.ceil(cfg.prompts_per_iter * cfg.samples_per_prompt /
                                                          cfg.minibatch_size)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, partial(lr_factor, warmup=math.ceil(cfg.warmup_ratio * total_steps), total=total_steps,
                           decay=cfg.lr_decay))
    start, train_seconds = 0, 0.0
    if cfg.resume:
        state = torch.load(source / "trainer_state.pt", weights_only=False)
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        rng.setstate(state["python_rng"])
        torch.set_rng_state(state["torch_rng"])
        start, train_seconds = state["iteration"], state["train_seconds"]
        if value_head is not None:
            value_head.load_state_dict(torch.load(source / "value_head.pt"))
        metrics = [line for line in (out_dir / "metrics.jsonl").read_text().splitlines()
                   if json.loads(line)["iteration"] <= start] if (out_dir / "metrics.jsonl").exists() else []
        (out_dir / "metrics.tmp").write_text("".join(line + "\n" for line in metrics))  # drop lines past the checkpoint
        os.replace(out_dir / "metrics.tmp", out_dir / "metrics.jsonl")
        print(f"resumed from {source} at iteration {start}", flush=True)
    stop_strings = ["\n\n\nProblem:"] if cfg.prompt_format == "sft" else []
    sampler = make_sampler(cfg.sampler, policy=policy, tokenizer=tokenizer, model_path=resolve_model(cfg.model),
                           dtype=dtype, stop_strings=stop_strings, seed=cfg.seed, batch_size=cfg.gen_batch_size)
    sampler.sync(policy)
    log = open(out_dir / "metrics.jsonl", "a")
    checkpoint = partial(save_checkpoint, out_dir, policy=policy, value_head=value_head, tokenizer=tokenizer,
                         optimizer=optimizer, scheduler=scheduler, rng=rng, cfg=cfg)
    it = start
    try:
        if start == 0:
            accuracy = evaluate(sampler, tokenizer, test_set, cfg, seed=cfg.seed)
            log.write(json.dumps({"iteration": 0, "eval_accuracy": accuracy, "train_seconds": 0.0}) + "\n")
            log.flush()
            print(f"iteration 0: eval pass@1 {accuracy:.3f} on {len(test_set)} problems x {cfg.eval_samples}",
                  flush=True)
        for it in range(start, cfg.iterations):
            seconds, t0 = {}, time.perf_counter()
            seed = cfg.seed * 1_000_003 + it

            # 1. Sample prompts (with replacement, as in the official implementation)
            examples = rng.choices(train_set, k=cfg.prompts_per_iter)
            prompt_ids = [encode_prompt(e["question"], dataset=cfg.dataset, tokenizer=tokenizer,
                                        prompt_format=cfg.prompt_format) for e in examples]

            # 2. Rollouts: samples_per_prompt responses per problem from the current policy
            groups = sampler.sample(prompt_ids, n=cfg.samples_per_prompt, temperature=cfg.temperature,
                                    top_p=cfg.top_p, max_new_tokens=cfg.max_new_tokens, seed=seed)
            prompts = [p for p, g in zip(prompt_ids, groups) for _ in g]
            answers = [e["answer"] for e, g in zip(examples, groups) for _ in g]
            group_of = [i for i, g in enumerate(groups) for _ in g]
            samples = [s for g in groups for s in g]
            responses = [s.token_ids for s in samples]
            seconds["rollout"] = time.perf_counter() - t0

            # 3. Grade: 0/1 reward per response (0 if it hit the length limit)
            rewards = [grade(s.text, a, dataset=cfg.dataset, truncated=not s.finished) for s, a in zip(samples, answers)]
            input_ids, attention_mask, response_mask, P = pad_episodes(prompts, responses, pad_id=tokenizer.pad_token_id)
            batch = {"input_ids": input_ids, "attention_mask": attention_mask, "response_mask": response_mask}
            micro = micro_batches(len(responses), size=cfg.micro_batch_size)  # the same groups for every pass

            # 4. Values. vine: split into steps, K vines from the state before every step. critic: the value head.
            t, value_stats, old_logprobs = time.perf_counter(), {}, None
            if cfg.estimator == "vine":
                starts = [step_token_starts(s.token_ids, s.text, tokenizer=tokenizer, dataset=cfg.dataset,
                                            split=cfg.step_split) for s in samples]
                values, value_stats = estimate_values(
                    sampler=sampler, prompts=prompts, responses=responses, step_starts=starts, rewards=rewards,
                    answers=answers, dataset=cfg.dataset, K=cfg.k, temperature=cfg.temperature, top_p=cfg.top_p,
                    max_new_tokens=cfg.max_new_tokens, max_value_steps=cfg.max_value_steps or None, seed=seed + 1)
                value_stats["steps_per_response"] = sum(map(len, starts)) / len(starts)
                flat_values = [v for vs in values for v in vs[:-1]]
            elif cfg.estimator == "critic":
                old_logprobs, token_values = batch_logprobs(policy, batch, P, groups=micro, temperature=cfg.temperature,
                                                            dtype=dtype, value_head=value_head)
                values = [token_values[i, :len(r)] for i, r in enumerate(responses)]
                flat_values = torch.cat(values).tolist()
            if cfg.estimator in ("vine", "critic"):
                value_stats["value_mean"] = sum(flat_values) / len(flat_values)
            seconds["values"] = time.perf_counter() - t

            # 5. Advantages. vine: GAE over step values, each token gets its step's. critic: GAE over token values.
            #    grpo / rloo: one advantage per response from its group's rewards.
            if cfg.estimator == "vine":
                token_steps = [token_step_index(len(r), st) for r, st in zip(responses, starts)]
                advantages = vine_advantages(values=values, rewards=rewards, token_steps=token_steps,
                                             gamma=cfg.gamma, lam=cfg.lam)
            elif cfg.estimator == "critic":
                advantages, returns = critic_advantages(values=values, rewards=rewards, gamma=cfg.gamma, lam=cfg.lam)
                batch["old_values"] = pad_rows(values, response_mask.shape[1])
                batch["returns"] = pad_rows(returns, response_mask.shape[1])
            else:
                advantages = group_baseline_advantages(rewards=rewards, groups=group_of,
                                                       lengths=list(map(len, responses)), kind=cfg.estimator)
            raw = torch.cat(advantages)
            batch["advantages"] = pad_rows(whiten(advantages) if cfg.whiten else advantages, response_mask.shape[1])

            # 6. PPO epochs: log-probs of the sampling policy and the reference, then clipped updates. The sampler
            #    computed its own log-probs of the same tokens: their gap is measured, and corrected with --tis-cap.
            t, lr = time.perf_counter(), scheduler.get_last_lr()[0]
            if old_logprobs is None:
                old_logprobs, _ = batch_logprobs(policy, batch, P, groups=micro, temperature=cfg.temperature,
                                                 dtype=dtype)
            batch["old_logprobs"] = old_logprobs
            batch["ref_logprobs"], _ = batch_logprobs(reference, batch, P, groups=micro, temperature=cfg.temperature,
                                                      dtype=dtype)
            sampler_logprobs = pad_rows([torch.tensor(s.logprobs) for s in samples], response_mask.shape[1])
            mismatch = sampler_mismatch(trainer_logprobs=old_logprobs, sampler_logprobs=sampler_logprobs,
                                        mask=response_mask)
            if cfg.tis_cap > 0:
                batch["tis_weights"] = tis_weights(old_logprobs=old_logprobs, sampler_logprobs=sampler_logprobs,
                                                   cap=cfg.tis_cap)
            ppo_stats = ppo_update(policy, optimizer, scheduler, batch, P, groups=micro, epochs=cfg.epochs,
                                   minibatch_size=cfg.minibatch_size,
                                   clip=cfg.clip, kl_coef=cfg.kl_coef, temperature=cfg.temperature,
                                   max_grad_norm=cfg.max_grad_norm, value_head=value_head, vf_coef=cfg.vf_coef,
                                   value_clip=cfg.value_clip, dtype=dtype)
            seconds["ppo"] = time.perf_counter() - t

            # 7. Sampler sync: the sampler must generate from the updated policy
            t = time.perf_counter()
            sampler.sync(policy)
            seconds["sync"] = time.perf_counter() - t

            # 8. Eval, log, checkpoint
            done = it + 1
            train_seconds += time.perf_counter() - t0
            out_of_time = cfg.time_budget > 0 and train_seconds >= cfg.time_budget
            record = {"iteration": done, "train_seconds": train_seconds, "reward_mean": sum(rewards) / len(rewards),
                      "response_length": sum(map(len, responses)) / len(responses),
                      "finished_frac": sum(s.finished for s in samples) / len(samples),
                      "advantage_mean": raw.mean().item(), "advantage_std": raw.std().item() if len(raw) > 1 else 0.0,
                      "advantage_abs_mean": raw.abs().mean().item(), "lr": lr, **value_stats, **ppo_stats, **mismatch}
            generated = sum(map(len, responses)) + value_stats.get("vine_tokens", 0)
            record["tokens_per_s"] = generated / (seconds["rollout"] + seconds["values"])
            if done % cfg.eval_every == 0 or done == cfg.iterations or out_of_time:
                t = time.perf_counter()
                record["eval_accuracy"] = evaluate(sampler, tokenizer, test_set, cfg, seed=cfg.seed)
                seconds["eval"] = time.perf_counter() - t
            if done % cfg.save_every == 0 or done == cfg.iterations or out_of_time:
                t = time.perf_counter()
                checkpoint(iteration=done, train_seconds=train_seconds)
                seconds["checkpoint"] = time.perf_counter() - t
            record.update({f"seconds_{k}": v for k, v in seconds.items()}, seconds=time.perf_counter() - t0)
            log.write(json.dumps(record) + "\n")
            log.flush()
            print(f"iteration {done}: reward {record['reward_mean']:.3f} kl_ref {record.get('kl_ref', 0):.2e} "
                  f"tok/s {record['tokens_per_s']:.0f} {record['seconds']:.0f}s" +
                  (f" eval {record['eval_accuracy']:.3f}" if "eval_accuracy" in record else ""), flush=True)
            if out_of_time:
                print(f"time budget of {cfg.time_budget:.0f}s reached after {done} iterations", flush=True)
                break
    except KeyboardInterrupt:
        print(f"interrupted: saving iteration {it} (weights include any partial update of the iteration that was "
              "running)", flush=True)
        checkpoint(iteration=it, train_seconds=train_seconds)
        sys.exit(130)


if __name__ == "__main__":
    main(parse_config())
