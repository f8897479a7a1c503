"""VinePPO training loop: python train.py --dataset gsm8k --k 9

Each iteration: 1. sample prompts  2. rollouts  3. grade  4. values (vine: split into steps, K vines per state)
5. advantages (GAE)  6. PPO epochs  7. sampler sync  8. eval / log / checkpoint. Each section is one call; the choice
of --estimator lives in advantages.values_for / advantages_for, the ablations in ablations/, the run's files in
checkpoint.py and runlog.py, the ranks of torchrun in dist.py, and everything the loop needs before it starts in
`setup`.
Defaults follow the paper and the official repo; on a machine without a GPU the batch sizes, response length and
eval size shrink to CPU scale (see --help and README).
"""
import random
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

import dist
from ablations.critic_head import open_value_head
from ablations.silent_groups import resample_silent
from advantages import advantages_for, values_for
from checkpoint import Saver, open_run, record_start, repair_metrics, restore
from config import Config, config_changes, parse_config
from critic import critic_update, open_critic
from data import input_problem, load_splits
from grader import grade
from model import (Scorer, load_model, load_tokenizer, max_positions, pick_device, pick_dtype,
                   resolve_model)
from ppo import micro_batches, pad_episodes, policy_optimizer, policy_update
from rollout import evaluation, make_sampler, open_engine, rollouts
from runlog import (Clock, GracefulStop, Meter, RunLog, due, iteration_record, pause_point, return_free_memory,
                    stop_after_interrupt)
from sampling import row_seed
from values import step_token_starts


def main(cfg: Config):
    run = setup(cfg)
    sampler, tokenizer, device, rank = run.sampler, run.tokenizer, run.device, run.rank
    try:
        if run.start == 0:
            first_evaluation(run, cfg)
        run.runlog.start_clock()
        for it in range(run.start, cfg.iterations):
            meter, t0, payload = Meter(device), time.perf_counter(), dist.PAYLOAD["bytes"]
            seed = row_seed(cfg.seed, it, rank)  # this iteration's, this rank's; each sampler call mixes in its own
            with meter.section("rollout"):
                # 1. Sample prompts (with replacement, as in the official implementation); each rank takes its share
                examples = run.rng.choices(run.train_set, k=cfg.prompts_per_iter)[rank::run.world]

                # 2. Rollouts: samples_per_prompt responses per problem from the current policy
                episodes = rollouts(sampler, examples, tokenizer=tokenizer, cfg=cfg, seed=row_seed(seed, 0))
            pause_point("rollout", it + 1)

            # 3. Grade: 0/1 reward per response (0 if it hit the length limit)
            rewards = [grade(s.text, a, grader=cfg.grader, truncated=not s.finished)
                       for s, a in zip(episodes.samples, episodes.answers)]
            resampled = {}
            if cfg.resample_silent:  # grpo-resample: fresh responses to the silent groups, a timed section of its own
                with meter.section("resample"):
                    episodes, rewards, resampled = resample_silent(sampler, episodes, rewards,
                                                                   extra=cfg.resample_silent, cfg=cfg,
                                                                   seed=row_seed(seed, 2))
            input_ids, attention_mask, response_mask, P = pad_episodes(episodes.prompts, episodes.responses,
                                                                       pad_id=tokenizer.pad_token_id)
            batch = {"input_ids": input_ids, "attention_mask": attention_mask, "response_mask": response_mask}
            micro = micro_batches(len(rewards), size=cfg.micro_batch_size)  # the same groups for every pass

            # 4. Values. vine: split into steps, K vines from the state before every step. critic: the critic's V.
            with meter.section("values"):
                values, starts, value_stats = values_for(cfg.estimator, episodes=episodes, rewards=rewards,
                                                         batch=batch, P=P, micro=micro, sampler=sampler,
                                                         scorer=run.scorer, critic=run.critic, tokenizer=tokenizer,
                                                         cfg=cfg, seed=row_seed(seed, 1))

            # 5. Advantages. vine: GAE over step values, each token gets its step's. critic: GAE over token values.
            #    grpo / rloo: one advantage per response from its group's rewards. Whitened into batch["advantages"].
            advantages = advantages_for(cfg.estimator, values=values, starts=starts, rewards=rewards,
                                        episodes=episodes, batch=batch, cfg=cfg)

            # 6. PPO epochs: the clipped update with the KL penalty to the reference. From here on the iteration
            #    runs to its end, even on Ctrl-C or SIGTERM (then saves and stops).
            run.stop.hold()
            with meter.section("ppo"):
                sampler.sleep()  # vLLM on CUDA: weights to the CPU, KV cache freed, until the sync below
                lr = run.optimizer.param_groups[0]["lr"]
                ppo_stats = policy_update(run.scorer, run.reference_scorer, run.optimizer, run.scheduler, batch, P,
                                          groups=micro, sampler_logprobs=[s.logprobs for s in episodes.samples],
                                          cfg=cfg)
                ppo_stats.update(critic_update(run.critic, batch, P, groups=micro, cfg=cfg))  # a separate critic's
                return_free_memory()  # the update's freed activations, which the heap would keep
            pause_point("ppo", it + 1)

            # 7. Sampler sync: the sampler must generate from the updated policy
            with meter.section("sync"):
                sampler.sync(run.policy)

            # 8. Eval, log, checkpoint: the metrics line is on disk before the checkpoint that covers it
            done = it + 1
            run.clock.add(time.perf_counter() - t0)
            record = iteration_record(done, episodes=episodes, rewards=rewards, advantages=advantages, lr=lr,
                                      stats={**value_stats, **ppo_stats, **resampled}, clock=run.clock, meter=meter)
            evaluating = due(done, every=cfg.eval_every, last=cfg.iterations,
                             now=run.clock.out_of_time or run.clock.crossed)
            if evaluating:
                with meter.section("eval"):
                    record.update(evaluation(sampler, tokenizer, run.test_set, cfg, seed=cfg.seed))
            record.update(meter.record(), seconds=time.perf_counter() - t0,
                          comm_bytes=dist.PAYLOAD["bytes"] - payload)  # what this rank sent to collectives
            run.runlog.write(record)
            if evaluating:  # two responses with the advantage each step got, for the tracker
                run.runlog.responses(done, episodes=episodes, rewards=rewards, advantages=advantages,
                                     tokenizer=tokenizer, steps_of=lambda i: starts[i] if starts else step_token_starts(
                                         episodes.responses[i], episodes.samples[i].text, tokenizer=tokenizer,
                                         task=cfg.task))
            pause_point("metrics", done)
            if checkpoint_and_stop(run, cfg, done=done, record=record):
                break
    except KeyboardInterrupt:  # a second signal during an update saves nothing (its weights are half-updated)
        stop_after_interrupt(run.stop, completed=run.saver.completed, save=run.saver.save)
    finally:
        run.runlog.close()
    dist.finish()


def setup(cfg: Config) -> SimpleNamespace:
    """Everything the loop needs, in this order: ranks, the data, the tokenizer (checked against the data before
    anything is written), the run folder (resumed if asked), the sampler's engine, the policy, the reference, the
    critic, the sampler, the scorers (DDP / FSDP2 under torchrun), AdamW, a resumed run's state, and the run's log,
    saver, clock and signal handling."""
    device = pick_device(cfg.device)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    rank, world = dist.init(device)  # (0, 1) without torchrun
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)  # the same on every rank: all draw the same prompts, each keeps its share
    train_set, test_set = load_splits(cfg.dataset, data_dir=cfg.data_dir, arith_ops=cfg.arith_ops,
                                      arith_max=cfg.arith_max, eval_size=cfg.eval_size,
                                      chain_filler=cfg.chain_filler)
    tokenizer = load_tokenizer(cfg.model)
    if problem := input_problem(tokenizer, examples=train_set + test_set, prompt_format=cfg.prompt_format,
                                grader=cfg.grader, max_new_tokens=cfg.max_new_tokens,
                                max_positions=max_positions(cfg.model)):  # before anything is written
        raise SystemExit(f"error: {problem}")
    out_dir = Path(cfg.out_dir)
    source, state = open_run(out_dir, resume=cfg.resume, overwrite=cfg.overwrite,
                             compare=lambda saved: config_changes(saved, cfg))
    record_start(out_dir, model=cfg.model, folder=resolve_model(cfg.model), resumed=source is not None)
    dtype = pick_dtype(cfg.dtype, device)  # compute dtype; the policy's master weights are fp32
    backend, engine = open_engine(cfg, resolve_model(cfg.model), dtype=dtype)  # vllm, hf or generate
    policy = load_model(str(source or cfg.model), device=device, dtype=torch.float32,
                        trust_remote_code=cfg.trust_remote_code)
    reference = load_model(cfg.model, device=device, dtype=torch.float32, trust_remote_code=cfg.trust_remote_code,
                           frozen=True)  # fp32 like the policy: in bf16, KL(policy || reference) starts at 0.011
    value_head = open_value_head(policy, source=source) if cfg.critic == "head" else None  # the ablation
    critic = open_critic(cfg, source=source, device=device, dtype=dtype)  # --critic separate: the paper's PPO
    stop_strings = ["\n\n\nProblem:"] if cfg.prompt_format == "sft" else []
    sampler = make_sampler(backend, policy=policy, tokenizer=tokenizer, dtype=dtype, stop_strings=stop_strings,
                           batch_size=cfg.gen_batch_size, engine=engine)
    scorer = dist.wrap(Scorer(policy, value_head, dtype=dtype), fsdp=cfg.fsdp)  # DDP / FSDP2 under torchrun
    reference_scorer = dist.wrap(Scorer(reference, dtype=dtype), fsdp=cfg.fsdp)  # sharded with FSDP2, else whole
    optimizer, scheduler = policy_optimizer(policy, value_head, cfg)  # AdamW: the policy (and --critic head's head)
    start, train_seconds = 0, 0.0
    if state:
        start, train_seconds = restore(state, scorer=scorer, optimizer=optimizer, scheduler=scheduler, rng=rng,
                                       lrs=[cfg.lr, cfg.value_lr], critic=critic)
        if rank == 0:
            repair_metrics(out_dir / "metrics.jsonl", upto=start)
        dist.print0(f"resumed from {source} at iteration {start}")
    sampler.sync(policy)
    runlog = RunLog(out_dir, cfg, total=cfg.iterations, first=start, track=cfg.track)  # metrics.jsonl, --track
    saver = Saver(out_dir, rng=rng, completed=start, train_seconds=train_seconds, scorer=scorer, policy=policy,
                  value_head=value_head, critic=critic, tokenizer=tokenizer, optimizer=optimizer, scheduler=scheduler,
                  cfg=cfg)
    clock = Clock(train_seconds, budget=cfg.time_budget, eval_every=cfg.eval_every_seconds)
    stop = GracefulStop()
    if dist.active():
        stop.hold()  # under torchrun a signal is acted on at an iteration's end, by all ranks together
    return SimpleNamespace(device=device, rank=rank, world=world, rng=rng, train_set=train_set, test_set=test_set,
                           tokenizer=tokenizer, policy=policy, critic=critic, sampler=sampler, scorer=scorer,
                           reference_scorer=reference_scorer, optimizer=optimizer, scheduler=scheduler, start=start,
                           runlog=runlog, saver=saver, clock=clock, stop=stop)


def first_evaluation(run: SimpleNamespace, cfg: Config):
    """Iteration 0's metrics line: pass@1 of the starting policy."""
    meter = Meter(run.device)
    with meter.section("eval"):
        record = evaluation(run.sampler, run.tokenizer, run.test_set, cfg, seed=cfg.seed)
    run.runlog.write({"iteration": 0, **record, "train_seconds": 0.0, **meter.record()})
    dist.print0(f"iteration 0: eval pass@1 {record['eval_accuracy']:.3f} ± {record['eval_se']:.3f} on "
                f"{len(run.test_set)} problems x {cfg.eval_samples} ({meter.seconds['eval']:.0f}s)")


def checkpoint_and_stop(run: SimpleNamespace, cfg: Config, *, done: int, record: dict) -> bool:
    """After iteration `done`'s metrics line: note its state, save it when due (the cadence, the last iteration, the
    time budget, an --eval-every-seconds mark, a stop signal), print the progress line; exit on a signal. Returns
    whether the time budget ends the run."""
    run.saver.note(done, run.clock.seconds)
    stopping = run.stop.any_rank()
    if due(done, every=cfg.save_every, last=cfg.iterations,
           now=run.clock.out_of_time or run.clock.crossed or stopping):
        run.saver.save()
    if not dist.active():
        run.stop.release()
    run.runlog.summary(done, record, budget_left=run.clock.budget_left())
    if stopping:
        sys.exit(run.stop.exit_code())
    if run.clock.out_of_time:
        dist.print0(f"time budget of {cfg.time_budget:.0f}s reached after {done} iterations")
        return True
    return False


if __name__ == "__main__":
    main(parse_config())
