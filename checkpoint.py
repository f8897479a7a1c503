"""The run's files, written so that a kill at any point leaves a run that --resume continues, losing at most the
iteration in progress.

    OUT/metrics.jsonl     one line per iteration, written (and fsynced) before that iteration's checkpoint
    OUT/ckpt-NNNNNN/      a Hugging Face folder + trainer_state.pt (+ value_head.pt with --critic head; + critic/, a
                          Hugging Face folder with value_head.safetensors, with --critic separate), written as
                          .tmp-ckpt-* and renamed
    OUT/latest            names the committed checkpoint; a checkpoint counts once `latest` names it
    OUT/start.json        the model the run started from and the sha256 of its weights (record_start)
    OUT/best/             sft.py --keep-best: the best validation checkpoint, swapped in only after the checkpoint of
                          its step (best_so_far, save_best, swap_best, load_best)

On start: temp folders of dead saves are removed, and so are checkpoints newer than `latest` (a kill came between
their rename and the pointer's update). On resume: metrics lines past the checkpoint, and a torn last line, are
dropped. Resume state is loaded with weights_only=True: a crafted file cannot run code.
What Ctrl-C and SIGTERM do (runlog.GracefulStop) decides when Saver.save is called.
"""
import dataclasses
import errno
import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import torch

import dist
from runlog import pause_point

CKPT = re.compile(r"ckpt-\d{6}")


def committed_checkpoint(out_dir: Path) -> Path | None:
    """The checkpoint `latest` names, or None when there is none. `latest` must name a ckpt-NNNNNN folder inside
    out_dir; anything else (a path, a link out of it) is refused."""
    pointer = out_dir / "latest"
    if not pointer.exists():
        return None
    name = pointer.read_text().strip()
    if not CKPT.fullmatch(name) or not (out_dir / name / "trainer_state.pt").is_file() or (out_dir / name).is_symlink():
        raise SystemExit(f"error: {pointer}: must name a complete ckpt-NNNNNN folder inside {out_dir} (got {name!r})")
    return out_dir / name


def remove(path: Path):
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def prepare_out_dir(out_dir: Path, *, resume: bool, overwrite: bool) -> Path | None:
    """Clean what dead processes left in out_dir, refuse to write over a run unless told, and return the checkpoint
    to resume from (None for a fresh run)."""
    for leftover in [*out_dir.glob(".tmp-ckpt-*"), out_dir / "latest.tmp", out_dir / "metrics.tmp"]:
        remove(leftover)
    has_run = (out_dir / "metrics.jsonl").exists() or (out_dir / "latest").exists()
    if overwrite:
        for old in [*out_dir.glob("ckpt-*"), out_dir / "latest", out_dir / "metrics.jsonl"]:
            remove(old)
        return None
    if not resume:
        if has_run:
            raise SystemExit(f"error: --out-dir {out_dir} already holds a run; continue it with --resume, or start "
                             "afresh with a new --out-dir or with --overwrite")
        return None
    source = committed_checkpoint(out_dir)
    if source is None:
        raise SystemExit(f"error: --resume: no checkpoint in {out_dir} (expected {out_dir / 'latest'} naming a "
                         "ckpt-* folder; a run stopped before its first save starts afresh with --overwrite)")
    for orphan in out_dir.glob("ckpt-*"):  # renamed into place, but a kill came before `latest` named it
        if orphan.name > source.name:
            remove(orphan)
    return source


WEIGHTS_HASH_LIMIT = 4 * 2**30  # bytes: larger weights (7B and up) are named by path and size, not hashed


def weights_sha256(folder: Path) -> str | None:
    """sha256 of a model folder's weights: its model.safetensors, else its *.safetensors shards read in name order as
    one stream; None when there are none or they are larger than WEIGHTS_HASH_LIMIT."""
    files = [folder / "model.safetensors"] if (folder / "model.safetensors").is_file() else \
        sorted(folder.glob("*.safetensors"))
    if not files or sum(f.stat().st_size for f in files) > WEIGHTS_HASH_LIMIT:
        return None
    digest = hashlib.sha256()
    for path in files:
        with open(path, "rb") as f:
            while chunk := f.read(2**24):
                digest.update(chunk)
    return digest.hexdigest()


def record_start(out_dir: Path, *, model: str, folder: str, resumed: bool):
    """OUT/start.json: --model, the folder it resolved to and the sha256 of its weights (the policy's start and the
    frozen reference: both load --model), so that a grid can tell which start a run came from. On --resume the
    weights must be those the run started from (a one-line error otherwise). Rank 0 reads the weights and writes;
    every rank gets its digest."""
    path = out_dir / "start.json"
    digest = dist.broadcast(weights_sha256(Path(folder)) if dist.rank() == 0 else None)
    start = {"model": model, "folder": folder, "model_sha256": digest, "reference_sha256": digest}
    if resumed and path.exists():
        saved = json.loads(path.read_text())
        if saved.get("model_sha256") != digest:
            raise SystemExit(f"error: --resume: --model {model} is not the model {out_dir} started from (sha256 "
                             f"{str(digest)[:12]}, the run's {str(saved.get('model_sha256'))[:12]})")
        return
    if dist.rank() == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        tmp = out_dir / "start.tmp"
        tmp.write_text(json.dumps(start) + "\n")
        os.replace(tmp, path)


def load_tensors(path: Path, what: str):
    """A .pt file this program wrote (`what` it should be, for the error), without running code (weights_only)."""
    try:
        return torch.load(path, weights_only=True)
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise SystemExit(f"error: {path}: not {what} this program wrote; refusing to load it ({first[:160]})") from None


def open_run(out_dir: Path, *, resume: bool, overwrite: bool, compare) -> tuple[Path | None, dict | None]:
    """The checkpoint to resume, if any (rank 0 alone tidies the folder: prepare_out_dir; every rank gets the answer),
    and its trainer state. compare(saved config) -> (run-defining differences, other differences): a defining one is
    a one-line error, the others are applied and printed."""
    source = dist.broadcast(prepare_out_dir(out_dir, resume=resume, overwrite=overwrite) if dist.rank() == 0 else None)
    state = load_trainer_state(source) if source else None
    if state:
        defining, changed = compare(state["config"])
        if defining:
            raise SystemExit(f"error: --resume: flags that define the run differ from {source}'s: {'; '.join(defining)}")
        if changed:
            dist.print0(f"resume: applying changed flags: {'; '.join(changed)}")
    return source, state


def load_trainer_state(source: Path) -> dict:
    """trainer_state.pt of a checkpoint, without running code."""
    return load_tensors(source / "trainer_state.pt", "a trainer state")


def restore(state: dict, *, scorer, optimizer, scheduler, rng, lrs: list[float], critic=None) -> tuple[int, float]:
    """Load a checkpoint's optimizer, scheduler and RNG states (each rank its own torch RNG when the world size is the
    saved one), and a separate critic's optimizer and schedule (critic.SeparateCritic; its weights were loaded from
    ckpt-*/critic). The learning rates in force are this run's `lrs` (one per parameter group; a changed --lr
    applies) and the critic's lr, at the schedules' saved steps. Returns (iteration, train_seconds)."""
    load_schedule(scorer, optimizer, scheduler, state["optimizer"], state["scheduler"], lrs=lrs)
    if critic is not None:
        load_schedule(critic.module, critic.optimizer, critic.scheduler, state["critic_optimizer"],
                      state["critic_scheduler"], lrs=[critic.lr])
    rng.setstate(state["python_rng"])
    rngs = state["torch_rng"] if isinstance(state["torch_rng"], list) else [state["torch_rng"]]
    torch.set_rng_state(rngs[dist.rank()] if len(rngs) == dist.world() else rngs[0])
    return state["iteration"], state["train_seconds"]


def load_schedule(module, optimizer, scheduler, optimizer_state: dict, scheduler_state: dict, *, lrs: list[float]):
    """An optimizer's saved state and its schedule's step, with this run's learning rates `lrs` (one per group)."""
    dist.load_optimizer_state(module, optimizer, optimizer_state)
    scheduler.load_state_dict(scheduler_state)
    scheduler.base_lrs = list(lrs[:len(optimizer.param_groups)])
    for group, base, factor in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["initial_lr"], group["lr"] = base, base * factor(scheduler.last_epoch)


def save_critic(folder: Path, critic, state: dict):
    """A separate critic (critic.Critic) as a Hugging Face folder: its trunk's config and safetensors, and the head
    in value_head.safetensors; `state` is its full state dict (gathered from the shards under FSDP2)."""
    from safetensors.torch import save_file
    trunk = {k.removeprefix("trunk."): v for k, v in state.items() if k.startswith("trunk.")}
    critic.trunk.save_pretrained(folder, state_dict=trunk)
    save_file({k.removeprefix("head."): v.contiguous() for k, v in state.items() if k.startswith("head.")},
              folder / "value_head.safetensors")


def repair_metrics(path: Path, *, upto: int):
    """Keep the metrics lines of iterations 0..upto, once each, in order; drop torn lines and lines past the
    checkpoint (their iterations will run again). Rewritten atomically."""
    kept = {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line torn by a kill
            if isinstance(record, dict) and isinstance(record.get("iteration"), int) and record["iteration"] <= upto:
                kept[record["iteration"]] = line  # a repeated iteration keeps its last line
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(kept[i] + "\n" for i in sorted(kept)))
    os.replace(tmp, path)


def save_checkpoint(out_dir: Path, *, iteration: int, scorer, policy, value_head, tokenizer, optimizer, scheduler,
                    python_rng, torch_rng, cfg, train_seconds: float, critic=None):
    """Write ckpt-<iteration>/ as a temp folder, rename it into place, point `latest` at it, then drop older ones.
    The previous checkpoint stays committed until the new one is. A full disk stops the run with a one-line error
    and leaves the previous checkpoint as it was. Under torchrun every rank calls this (sharded weights and every
    rank's RNG state are gathered) and rank 0 writes."""
    final = out_dir / f"ckpt-{iteration:06d}"
    if dist.broadcast(committed_checkpoint(out_dir) == final if dist.rank() == 0 else None):
        return  # this state is already saved (a stop before the next iteration's update changed nothing)
    sharded = dist.is_sharded(policy)
    policy_state = dist.full_state_dict(policy) if sharded else None  # None: save_pretrained takes its own
    head_state = dist.full_state_dict(value_head) if value_head is not None else None
    optimizer_state, torch_rngs = dist.optimizer_state(scorer, optimizer), dist.all_gather(torch_rng)
    critic_state, critic_extra = None, {}
    if critic is not None:  # a separate critic (critic.SeparateCritic): its weights, optimizer and schedule
        critic_state = dist.full_state_dict(critic.model)
        critic_extra = {"critic_optimizer": dist.optimizer_state(critic.module, critic.optimizer),
                        "critic_scheduler": critic.scheduler.state_dict()}
    if dist.rank() == 0:
        tmp = out_dir / f".tmp-ckpt-{iteration:06d}-{os.getpid()}"
        try:
            policy.save_pretrained(tmp, state_dict=policy_state)
            tokenizer.save_pretrained(tmp)
            if head_state is not None:
                torch.save(head_state, tmp / "value_head.pt")
            if critic_state is not None:
                save_critic(tmp / "critic", critic.model, critic_state)
            pause_point("save", iteration)
            torch.save({"iteration": iteration, "optimizer": optimizer_state, "scheduler": scheduler.state_dict(),
                        "python_rng": python_rng, "torch_rng": torch_rngs, "config": dataclasses.asdict(cfg),
                        "train_seconds": train_seconds, **critic_extra},
                       tmp / "trainer_state.pt")
        except (OSError, RuntimeError) as e:
            shutil.rmtree(tmp, ignore_errors=True)
            full = getattr(e, "errno", None) == errno.ENOSPC or "unexpected pos" in str(e) or "No space" in str(e)
            why = "no space left on device" if full else f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            raise SystemExit(f"error: {why} while writing {tmp}; the last checkpoint ({out_dir / 'latest'}) is intact")
        os.replace(tmp, final)
        (out_dir / "latest.tmp").write_text(final.name)
        os.replace(out_dir / "latest.tmp", out_dir / "latest")
        for old in out_dir.glob("ckpt-*"):
            if old != final:
                remove(old)
        print(f"saved {final}", flush=True)
    dist.barrier()


class Saver:
    """When to save and what: remembers the state after the last completed iteration (`note`), which a checkpoint at
    the cadence, a stop signal or Ctrl-C then saves (`save`). `parts`: save_checkpoint's scorer, policy, value_head,
    critic, tokenizer, optimizer, scheduler and cfg."""

    def __init__(self, out_dir: Path, *, rng, completed: int, train_seconds: float, **parts):
        self.out_dir, self.rng, self.parts = out_dir, rng, parts
        self.note(completed, train_seconds)

    def note(self, completed: int, train_seconds: float):
        self.completed, self.train_seconds = completed, train_seconds
        self.python_rng, self.torch_rng = self.rng.getstate(), torch.get_rng_state()

    def save(self):
        save_checkpoint(self.out_dir, iteration=self.completed, python_rng=self.python_rng, torch_rng=self.torch_rng,
                        train_seconds=self.train_seconds, **self.parts)


# sft.py --keep-best: the best validation checkpoint, kept beside the run's checkpoints


def save_final(out_dir: Path, *, policy, tokenizer, prompt_format: str):
    """The fine-tuned model as an HF folder in out_dir: written into a temp folder, then each file moved in, the
    config.json (what makes it a model folder) last. Under torchrun all ranks call it (FSDP2 shards are gathered) and
    rank 0 writes."""
    state = dist.full_state_dict(policy) if dist.is_sharded(policy) else None  # None: save_pretrained takes its own
    if dist.rank() > 0:
        return dist.barrier()
    tmp = out_dir / f".tmp-final-{os.getpid()}"
    policy.save_pretrained(tmp, state_dict=state)
    tokenizer.save_pretrained(tmp)
    for path in sorted(tmp.iterdir(), key=lambda p: p.name == "config.json"):
        os.replace(path, out_dir / path.name)
    tmp.rmdir()
    dist.barrier()
    print(f"saved the fine-tuned model in {out_dir} (python train.py --model {out_dir} "
          f"--prompt-format {prompt_format})", flush=True)


def best_so_far(out_dir: Path, *, upto: int) -> dict:
    """--keep-best: the step and validation pass@1 of the model in out_dir/best, or step 0 if none, once what a kill
    cut off is settled: a swap half done is finished, and a new best staged in out_dir/.tmp-best (save_best) is
    swapped in if the checkpoint a resume starts from (step `upto`) covers it, else dropped: its step will be
    trained again, and a replay that is not bit-identical (another CPU kind) must not end with the abandoned
    run's model."""
    best, old, staged = out_dir / "best", out_dir / "best.old", out_dir / ".tmp-best"
    if old.exists():
        if best.exists():
            shutil.rmtree(old)
        else:
            old.rename(best)
    if (staged / "best.json").exists() and json.loads((staged / "best.json").read_text())["step"] <= upto:
        swap_best(out_dir)
    shutil.rmtree(staged, ignore_errors=True)
    if not (best / "best.json").exists():
        return {"step": 0, "validation_accuracy": -1.0}
    return json.loads((best / "best.json").read_text())


def save_best(out_dir: Path, *, policy, tokenizer, step: int, accuracy: float) -> dict:
    """--keep-best: the model as an HF folder staged in out_dir/.tmp-best, best.json written last; swap_best moves it
    into out_dir/best once the checkpoint of the same step is written."""
    staged = out_dir / ".tmp-best"
    shutil.rmtree(staged, ignore_errors=True)
    policy.save_pretrained(staged)
    tokenizer.save_pretrained(staged)
    record = {"step": step, "validation_accuracy": accuracy}
    (staged / "best.json").write_text(json.dumps(record))
    return record


def swap_best(out_dir: Path):
    """--keep-best: the staged best (save_best) in place of out_dir/best (the old one kept as best.old until then)."""
    staged, best, old = out_dir / ".tmp-best", out_dir / "best", out_dir / "best.old"
    if best.exists():
        best.rename(old)
    staged.rename(best)
    shutil.rmtree(old, ignore_errors=True)


def load_best(out_dir: Path, policy):
    """--keep-best, at the end: the best checkpoint's weights into the policy (a tied output layer is not saved)."""
    from safetensors.torch import load_file
    missing, unexpected = policy.load_state_dict(load_file(out_dir / "best" / "model.safetensors"), strict=False)
    tied = {"lm_head.weight"} if policy.config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise SystemExit(f"error: {out_dir / 'best'}: not this run's model (missing {missing}, unexpected "
                         f"{unexpected})")
