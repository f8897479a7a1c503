"""VinePPO training loop: python train.py --dataset gsm8k --k 9

Each iteration: 1. sample prompts  2. rollouts  3. grade  4. split steps + MC values (K vines per state)
5. advantages (GAE)  6. PPO epochs  7. sampler sync  8. eval / log / checkpoint.
Defaults follow the paper and the official repo; on a machine without a GPU the batch sizes, response length and
eval size shrink to CPU scale (see --help and README). The rules passed down as `dataset=` are those of cfg.grader
(grading, and how the prompt asks for the final answer) and of cfg.task (step splitting), both set by parse_config.
"""
import math
import random
import sys
import time
from functools import partial
from pathlib import Path

import torch

import dist
from advantages import critic_advantages, group_baseline_advantages, vine_advantages, whiten
from checkpoint import (GracefulStop, load_trainer_state, load_value_head, pause_point, prepare_out_dir, repair_metrics,
                        restore, save_checkpoint)
from config import Config, config_changes, parse_config
from data import encode_prompt, load_split
from grader import grade
from monitor import Meter, response_steps, return_free_memory, sample_markdown
from model import Scorer, load_model, load_tokenizer, new_value_head, pick_device, pick_dtype, resolve_model
from ppo import batch_logprobs, micro_batches, pad_episodes, pad_rows, ppo_update, sampler_mismatch, tis_weights
from rollout import choose_sampler, make_sampler, open_vllm
from runlog import RunLog, due, stop_after_interrupt
from sampling import row_seed
from values import estimate_values, step_token_starts, token_step_index


def lr_factor(step: int, *, warmup: int, total: int, decay: bool = True) -> float:
    """Linear warmup to 1 over `warmup` steps, then linear decay to 0 at `total` (or constant 1 without decay)."""
    if step < warmup:
        return (step + 1) / warmup
    return max(0.0, (total - step) / max(1, total - warmup)) if decay else 1.0


def mark_crossed(before: float, after: float, *, every: float) -> bool:
    """Whether the clock passed a multiple of `every` seconds between `before` (excluded) and `after` (included);
    never when `every` is 0. Stateless, so a resumed run keeps the cadence from its restored clock."""
    return every > 0 and math.floor(after / every) > math.floor(before / every)


def evaluate(sampler, tokenizer, examples, cfg: Config, *, seed: int, keep: list | None = None) -> tuple[float, float]:
    """pass@1, the mean correctness of eval_samples samples per test problem at the eval temperature, and its standard
    error over problems (the sample standard deviation of the problems' means / sqrt(problems)). Under torchrun each
    rank takes every world-th problem, and both are over all. `keep`, if given, gets this rank's (example, sample,
    correct) triples, for a closer look (sft.py: where the first wrong line falls)."""
    examples = examples[dist.rank()::dist.world()]
    prompts = [encode_prompt(e["question"], grader=cfg.grader, tokenizer=tokenizer, prompt_format=cfg.prompt_format)
               for e in examples]
    samples = sampler.sample(prompts, n=cfg.eval_samples, temperature=cfg.eval_temperature, top_p=cfg.top_p,
                             max_new_tokens=cfg.max_new_tokens, seed=row_seed(seed, -1, dist.rank())) if prompts else []
    graded = [[(e, s, grade(s.text, e["answer"], grader=cfg.grader, truncated=not s.finished)) for s in group]
              for e, group in zip(examples, samples)]
    if keep is not None:
        keep.extend(triple for problem in graded for triple in problem)
    means = [sum(c for _, _, c in problem) / len(problem) for problem in graded]  # one per problem
    n, total, squares = dist.all_sum(torch.tensor([len(means), sum(means), sum(m * m for m in means)],
                                                  dtype=torch.float64)).tolist()
    mean = total / max(n, 1)
    variance = (squares - n * mean * mean) / (n - 1) if n > 1 else 0.0
    return mean, math.sqrt(max(variance, 0.0) / n) if n > 1 else 0.0


def main(cfg: Config):
    device = pick_device(cfg.device)
    rank, world = dist.init(device)  # (0, 1) without torchrun
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)  # the same on every rank: all draw the same prompts, each keeps its share
    out_dir = Path(cfg.out_dir)
    source = dist.broadcast(prepare_out_dir(out_dir, resume=cfg.resume, overwrite=cfg.overwrite) if rank == 0
                            else None)  # the checkpoint to resume, if any; rank 0 alone tidies the folder
    state = load_trainer_state(source) if source else None
    if state:
        defining, changed = config_changes(state["config"], cfg)
        if defining:
            raise SystemExit(f"error: --resume: flags that define the run differ from {source}'s: {'; '.join(defining)}")
        if changed:
            dist.print0(f"resume: applying changed flags: {'; '.join(changed)}")
    dtype = pick_dtype(cfg.dtype, device)  # compute dtype; the policy's master weights are fp32
    splits = {split: load_split(cfg.dataset, split, data_dir=cfg.data_dir, arith_ops=cfg.arith_ops,
                                arith_max=cfg.arith_max) for split in ("train", "test")}
    train_set, test_set = splits["train"], splits["test"][:cfg.eval_size]
    tokenizer = load_tokenizer(cfg.model)
    backend = choose_sampler(cfg.sampler)  # the same on every rank: vLLM everywhere or nowhere
    engine = open_vllm(cfg.sampler, resolve_model(cfg.model), dtype=str(dtype).removeprefix("torch."), seed=cfg.seed,
                       gpu_memory=cfg.vllm_gpu_memory, max_batched_tokens=cfg.vllm_max_batched_tokens,
                       max_model_len=cfg.max_new_tokens + 1024, sleep=cfg.vllm_sleep) if backend == "vllm" else None
    backend = "hf" if backend == "vllm" and engine is None else backend  # before the models: vLLM claims its memory
    policy = load_model(str(source or cfg.model), device=device, dtype=torch.float32,
                        trust_remote_code=cfg.trust_remote_code)
    reference = load_model(cfg.model, device=device, dtype=torch.float32, trust_remote_code=cfg.trust_remote_code,
                           frozen=True)  # fp32 like the policy: in bf16, KL(policy || reference) starts at 0.011
    value_head = new_value_head(policy) if cfg.estimator == "critic" else None
    load_value_head(source, value_head)
    stop_strings = ["\n\n\nProblem:"] if cfg.prompt_format == "sft" else []
    sampler = make_sampler(backend, policy=policy, tokenizer=tokenizer, dtype=dtype, stop_strings=stop_strings,
                           batch_size=cfg.gen_batch_size, engine=engine)
    scorer = dist.wrap(Scorer(policy, value_head, dtype=dtype), fsdp=cfg.fsdp)  # DDP / FSDP2 under torchrun
    reference_scorer = dist.wrap(Scorer(reference, dtype=dtype), fsdp=cfg.fsdp)  # sharded with FSDP2, else whole
    param_groups = [{"params": policy.parameters(), "lr": cfg.lr}]
    if value_head is not None:
        param_groups.append({"params": value_head.parameters(), "lr": cfg.value_lr})
    optimizer = torch.optim.AdamW(param_groups, weight_decay=cfg.weight_decay, fused=True)  # one kernel: bench/adamw.py
    total_steps = cfg.iterations * cfg.epochs * math.ceil(cfg.prompts_per_iter * cfg.samples_per_prompt /
                                                          cfg.minibatch_size)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, partial(lr_factor, warmup=math.ceil(cfg.warmup_ratio * total_steps), total=total_steps,
                           decay=cfg.lr_decay))
    start, train_seconds = 0, 0.0
    if state:
        start, train_seconds = restore(state, scorer=scorer, optimizer=optimizer, scheduler=scheduler, rng=rng,
                                       lrs=[cfg.lr, cfg.value_lr])
        if rank == 0:
            repair_metrics(out_dir / "metrics.jsonl", upto=start)
        dist.print0(f"resumed from {source} at iteration {start}")
    sampler.sync(policy)
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
    runlog = RunLog(out_dir, cfg, total=cfg.iterations, first=start, track=cfg.track)  # metrics.jsonl, --track
    checkpoint = partial(save_checkpoint, out_dir, scorer=scorer, policy=policy, value_head=value_head,
                         tokenizer=tokenizer, optimizer=optimizer, scheduler=scheduler, cfg=cfg)
    stop = GracefulStop()
    if dist.active():
        stop.hold()  # under torchrun a signal is acted on at an iteration's end, by all ranks together
    completed, python_rng, torch_rng = start, rng.getstate(), torch.get_rng_state()  # what a stop now would save
    try:
        if start == 0:
            meter = Meter(device)
            meter.start()
            accuracy, se = evaluate(sampler, tokenizer, test_set, cfg, seed=cfg.seed)
            meter.stop("eval")
            runlog.write({"iteration": 0, "eval_accuracy": accuracy, "eval_se": se, "train_seconds": 0.0,
                          **meter.record()})
            dist.print0(f"iteration 0: eval pass@1 {accuracy:.3f} ± {se:.3f} on {len(test_set)} problems x "
                        f"{cfg.eval_samples} ({meter.seconds['eval']:.0f}s)")
        runlog.start_clock()
        for it in range(start, cfg.iterations):
            meter, t0 = Meter(device), time.perf_counter()  # (completed, python_rng, torch_rng) = the state before it
            meter.start()
            payload = dist.PAYLOAD["bytes"]
            seed = row_seed(cfg.seed, it, rank)  # this iteration's, this rank's; each sampler call mixes in its own

            # 1. Sample prompts (with replacement, as in the official implementation); each rank takes its share
            examples = rng.choices(train_set, k=cfg.prompts_per_iter)[rank::world]
            prompt_ids = [encode_prompt(e["question"], grader=cfg.grader, tokenizer=tokenizer,
                                        prompt_format=cfg.prompt_format) for e in examples]

            # 2. Rollouts: samples_per_prompt responses per problem from the current policy
            groups = sampler.sample(prompt_ids, n=cfg.samples_per_prompt, temperature=cfg.temperature,
                                    top_p=cfg.top_p, max_new_tokens=cfg.max_new_tokens, seed=row_seed(seed, 0))
            prompts = [p for p, g in zip(prompt_ids, groups) for _ in g]
            answers = [e["answer"] for e, g in zip(examples, groups) for _ in g]
            group_of = [i for i, g in enumerate(groups) for _ in g]
            samples = [s for g in groups for s in g]
            responses = [s.token_ids for s in samples]
            meter.stop("rollout")
            pause_point("rollout", it + 1)

            # 3. Grade: 0/1 reward per response (0 if it hit the length limit)
            rewards = [grade(s.text, a, grader=cfg.grader, truncated=not s.finished) for s, a in zip(samples, answers)]
            input_ids, attention_mask, response_mask, P = pad_episodes(prompts, responses, pad_id=tokenizer.pad_token_id)
            batch = {"input_ids": input_ids, "attention_mask": attention_mask, "response_mask": response_mask}
            micro = micro_batches(len(responses), size=cfg.micro_batch_size)  # the same groups for every pass

            # 4. Values. vine: split into steps, K vines from the state before every step. critic: the value head.
            meter.start()
            value_stats, old_logprobs = {}, None
            if cfg.estimator == "vine":
                starts = [step_token_starts(s.token_ids, s.text, tokenizer=tokenizer, task=cfg.task,
                                            split=cfg.step_split) for s in samples]
                values, value_stats = estimate_values(
                    sampler=sampler, prompts=prompts, responses=responses, step_starts=starts, rewards=rewards,
                    answers=answers, grader=cfg.grader, K=cfg.k, temperature=cfg.temperature, top_p=cfg.top_p,
                    max_new_tokens=cfg.max_new_tokens, max_value_steps=cfg.max_value_steps or None,
                    seed=row_seed(seed, 1), k_mode=cfg.k_mode, k_round=cfg.k_round, k_max=cfg.k_max, k_ci=cfg.k_ci)
                value_stats["steps_per_response"] = dist.mean(list(map(len, starts)))
                flat_values = [v for vs in values for v in vs[:-1]]
            elif cfg.estimator == "critic":
                old_logprobs, token_values, log_mass = batch_logprobs(scorer, batch, P, groups=micro,
                                                                      temperature=cfg.temperature, top_p=cfg.top_p)
                values = [token_values[i, :len(r)] for i, r in enumerate(responses)]
                flat_values = torch.cat(values).tolist()
            if cfg.estimator in ("vine", "critic"):
                value_stats["value_mean"] = dist.mean(flat_values)
            meter.stop("values")

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
            raw = torch.cat(dist.all_gather(torch.cat(advantages)))  # (N,) all ranks' tokens, for the log
            batch["advantages"] = pad_rows(whiten(advantages) if cfg.whiten else advantages, response_mask.shape[1])

            # 6. PPO epochs: log-probs of the sampling policy and the reference, then clipped updates. The sampler
            #    computed its own log-probs of the same tokens: their gap is measured, and corrected with --tis-cap.
            #    From here on the iteration runs to its end, even on Ctrl-C or SIGTERM (then saves and stops).
            stop.hold()
            meter.start()
            sampler.sleep()  # vLLM on CUDA: weights to the CPU, KV cache freed, until the sync below
            lr = optimizer.param_groups[0]["lr"]
            if old_logprobs is None:
                old_logprobs, _, log_mass = batch_logprobs(scorer, batch, P, groups=micro, temperature=cfg.temperature,
                                                           top_p=cfg.top_p)
            batch["old_logprobs"] = old_logprobs
            batch["ref_logprobs"], _, _ = batch_logprobs(reference_scorer, batch, P, groups=micro,
                                                         temperature=cfg.temperature)
            sampler_logprobs = pad_rows([torch.tensor(s.logprobs) for s in samples], response_mask.shape[1])
            trainer_sampled = old_logprobs - log_mass  # (B, R) under the distribution sampled from, as the sampler's
            mismatch = dist.weighted_mean(sampler_mismatch(trainer_logprobs=trainer_sampled,
                                                           sampler_logprobs=sampler_logprobs, mask=response_mask),
                                          weight=response_mask.sum().item())  # token means over all ranks
            if cfg.tis_cap > 0:
                batch["tis_weights"] = tis_weights(old_logprobs=trainer_sampled, sampler_logprobs=sampler_logprobs,
                                                   cap=cfg.tis_cap)
            ppo_stats = ppo_update(scorer, optimizer, scheduler, batch, P, groups=micro, epochs=cfg.epochs,
                                   minibatch_size=cfg.minibatch_size // world,  # this rank's share of each step
                                   clip=cfg.clip, kl_coef=cfg.kl_coef, temperature=cfg.temperature,
                                   max_grad_norm=cfg.max_grad_norm, vf_coef=cfg.vf_coef, value_clip=cfg.value_clip)
            return_free_memory()  # the update's freed activations, which the heap would keep
            meter.stop("ppo")
            pause_point("ppo", it + 1)

            # 7. Sampler sync: the sampler must generate from the updated policy
            meter.start()
            sampler.sync(policy)
            meter.stop("sync")

            # 8. Eval, log, checkpoint: the metrics line is on disk before the checkpoint that covers it
            done = it + 1
            seconds_before, train_seconds = train_seconds, train_seconds + time.perf_counter() - t0
            out_of_time = dist.broadcast(cfg.time_budget > 0 and train_seconds >= cfg.time_budget)  # rank 0's clock
            on_the_clock = dist.broadcast(mark_crossed(seconds_before, train_seconds, every=cfg.eval_every_seconds))
            record = {"iteration": done, "train_seconds": train_seconds, "reward_mean": dist.mean(rewards),
                      "response_length": dist.mean(list(map(len, responses))),
                      "finished_frac": dist.mean([float(s.finished) for s in samples]),
                      "advantage_mean": raw.mean().item(), "advantage_std": raw.std().item() if len(raw) > 1 else 0.0,
                      "advantage_abs_mean": raw.abs().mean().item(), "lr": lr, **value_stats, **ppo_stats, **mismatch}
            response_tokens = dist.all_sum(torch.tensor([sum(map(len, responses))]))[0].item()  # all ranks'
            generated = response_tokens + value_stats.get("vine_tokens", 0)
            record["tokens_per_s"] = generated / (meter.seconds["rollout"] + meter.seconds["values"])
            evaluating = due(done, every=cfg.eval_every, last=cfg.iterations, now=out_of_time or on_the_clock)
            if evaluating:
                meter.start()
                record["eval_accuracy"], record["eval_se"] = evaluate(sampler, tokenizer, test_set, cfg, seed=cfg.seed)
                meter.stop("eval")
            record.update(meter.record(), seconds=time.perf_counter() - t0,
                          comm_bytes=dist.PAYLOAD["bytes"] - payload)  # what this rank sent to collectives
            runlog.write(record)
            if evaluating and runlog.writer:  # two responses with the advantage each step got, for the tracker
                for i in (0, len(samples) - 1):
                    steps, step_advantages = response_steps(
                        token_ids=responses[i], text=samples[i].text, advantages=advantages[i], tokenizer=tokenizer,
                        task=cfg.task, split=cfg.step_split)
                    runlog.text(f"responses/{i}", sample_markdown(text_steps=steps, step_advantages=step_advantages,
                                                                  reward=rewards[i], answer=answers[i]), done)
            pause_point("metrics", done)
            completed, python_rng, torch_rng = done, rng.getstate(), torch.get_rng_state()
            stopping = dist.all_sum(torch.tensor([float(stop.requested is not None)]))[0] > 0  # any rank signalled
            if due(done, every=cfg.save_every, last=cfg.iterations, now=out_of_time or on_the_clock or stopping):
                checkpoint(iteration=done, python_rng=python_rng, torch_rng=torch_rng, train_seconds=train_seconds)
            if not dist.active():
                stop.release()
            evaluated = f", eval {record['eval_accuracy']:.3f}" if "eval_accuracy" in record else ""
            runlog.line(done, f"this one {record['seconds']:.0f}s, reward {record['reward_mean']:.3f}, kl_ref "
                              f"{record.get('kl_ref', 0):.2e}, {record['tokens_per_s']:.0f} tok/s, "
                              f"{record['mem_gb']:.1f} GB{evaluated}",
                        budget_left=cfg.time_budget - train_seconds if cfg.time_budget > 0 else None)
            if stopping:
                sys.exit(stop.exit_code())
            if out_of_time:
                dist.print0(f"time budget of {cfg.time_budget:.0f}s reached after {done} iterations")
                break
    except KeyboardInterrupt:  # a second signal during an update saves nothing (its weights are half-updated)
        stop_after_interrupt(stop, completed=completed, save=partial(
            checkpoint, iteration=completed, python_rng=python_rng, torch_rng=torch_rng, train_seconds=train_seconds))
    finally:
        runlog.close()
    dist.finish()


if __name__ == "__main__":
    main(parse_config())
