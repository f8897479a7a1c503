"""Rank helpers for data parallelism under torchrun (`torch.distributed`): NCCL on CUDA, gloo on CPU.

    python train.py ...                              one process: no process group, every helper is a no-op
    torchrun --nproc_per_node=N train.py ...         N ranks on one machine
    torchrun --nnodes=M --node_rank=I --rdzv-endpoint=HOST:PORT --nproc_per_node=N train.py ...

Every rank holds the whole model (DDP) or a shard of it (--fsdp), samples its share of the prompts, estimates its
share of the vine states, and takes the same optimizer step. Rank 0 writes the files.
"""
import contextlib
import os
import pickle

import torch
import torch.distributed as dist

own_group = False  # whether init made the process group (in-process vLLM makes one of its own)


def init(device: torch.device) -> tuple[int, int]:
    """(rank, world size). Under torchrun: join the process group (NCCL for CUDA, gloo for the CPU), on CUDA pin this
    rank's GPU, on a CPU give each local rank its share of the cores. Without torchrun: (0, 1) and nothing else.
    torchrun with one process (`--nproc_per_node=1`) joins a group of one too, so that NCCL, DDP and FSDP2 run on a
    machine with a single GPU (a second rank cannot share that GPU: NCCL refuses two ranks on one device)."""
    if "LOCAL_RANK" not in os.environ and int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return 0, 1
    local_rank, local_world = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    if device.type == "cuda":
        torch.cuda.set_device(local_rank)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    global own_group
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        own_group = True
    if dist.get_rank() == 0:
        world = dist.get_world_size()
        print(f"torchrun: {world} rank{'s' if world > 1 else ''}, {dist.get_backend()}", flush=True)
    return dist.get_rank(), dist.get_world_size()


def finish():
    """Leave the process group that init joined (at the end of a run), all ranks together: a rank that tears gloo down
    while another still writes its files can abort at exit ("terminate called without an active exception"). A group
    this program did not make is left alone: in-process vLLM makes one of its own and destroys it at its shutdown
    (destroying it here first ends every `--sampler vllm` run in "Invalid process group specified")."""
    if own_group and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def active() -> bool:
    """Is there a process group (under torchrun, even of one rank)?"""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if active() else 0


def world() -> int:
    return dist.get_world_size() if active() else 1


PAYLOAD = {"bytes": 0}  # bytes this rank has handed to collectives (all-reduce payloads, pickled objects), for the log


def print0(*args):
    """print, on rank 0 only (flushed)."""
    if rank() == 0:
        print(*args, flush=True)


def all_gather(obj) -> list:
    """[obj of rank 0, obj of rank 1, ...] on every rank (any picklable object); [obj] alone."""
    if not active():
        return [obj]
    out = [None] * dist.get_world_size()
    PAYLOAD["bytes"] += len(pickle.dumps(obj))
    dist.all_gather_object(out, obj)
    return out


def broadcast(obj):
    """Rank 0's obj, on every rank."""
    if not active():
        return obj
    box = [obj]
    PAYLOAD["bytes"] += len(pickle.dumps(obj)) if dist.get_rank() == 0 else 0
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_sum(values: torch.Tensor) -> torch.Tensor:
    """The elementwise sum over ranks, in float64 on the CPU (a copy; the input is left alone)."""
    values = values.detach().double().cpu().clone()
    if active():
        on = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else values.device
        summed = values.to(on)
        PAYLOAD["bytes"] += summed.numel() * summed.element_size()
        dist.all_reduce(summed)
        values = summed.cpu()
    return values


def barrier():
    if active():
        dist.barrier()


def mean(values: list[float]) -> float:
    """The mean of `values` pooled over all ranks (each rank passes its own list)."""
    total, n = all_sum(torch.tensor([float(sum(values)), float(len(values))])).tolist()
    return total / max(n, 1)


def weighted_mean(stats: dict, weight: float) -> dict:
    """Means of `stats` (this rank's, over `weight` items) pooled over all ranks, each rank weighted by its own."""
    sums = all_sum(torch.tensor([v * weight for v in stats.values()] + [weight])).tolist()
    return {k: v / max(sums[-1], 1e-12) for k, v in zip(stats, sums)}


def deal(costs: list[float], *, parts: int) -> list[list[int]]:
    """Indices of `costs` (values.pool_states: each vine state's expected tokens) dealt into `parts` lists of about
    equal total cost: costliest first, each to the part lightest so far, so no part ends more than one item's cost
    above another."""
    loads, out = [0.0] * parts, [[] for _ in range(parts)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        part = min(range(parts), key=lambda p: (loads[p], p))
        out[part].append(i)
        loads[part] += costs[i]
    return [sorted(part) for part in out]


def wrap(scorer: torch.nn.Module, *, fsdp: bool = False) -> torch.nn.Module:
    """The module whose backward sums gradients over ranks; without torchrun, `scorer` itself.
    DDP (default): every rank holds all the weights; gradients are all-reduced during backward.
    FSDP2 (fsdp=True): parameters, gradients and AdamW's state sharded over ranks (`fully_shard`), each decoder layer
    its own unit, gathered for its forward and backward. The shards stay fp32 (the master weights); a decoder layer
    computes with its weights gathered in the scorer's dtype (bf16: FSDP2's mixed-precision policy, gradients reduced
    in fp32). The root unit (embeddings, final norm, the output layer, the value head) stays fp32, as in DDP.
    `scorer`: a model.Scorer or a critic.Critic (each names its decoder layers).
    Build the optimizer after this call: FSDP2 replaces the parameters by sharded ones (DTensors)."""
    if not active():
        return scorer
    device = next(scorer.parameters()).device
    if not any(p.requires_grad for p in scorer.parameters()) and not fsdp:
        return scorer  # the frozen reference: every rank keeps it whole
    if not fsdp:
        ddp = torch.nn.parallel.DistributedDataParallel(scorer, device_ids=[device] if device.type == "cuda" else None)
        ddp.register_comm_hook(None, counted_allreduce)
        return ddp
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    layers = MixedPrecisionPolicy(param_dtype=scorer.dtype, reduce_dtype=torch.float32)
    for layer in scorer.decoder_layers():  # model.Scorer's policy, or critic.Critic's trunk
        fully_shard(layer, mp_policy=layers)
    # The root too reshards after every forward: left gathered after a no-grad forward (old log-probs), its weights
    # (embeddings, output layer) got no gradient in the next backward (measured: torch 2.13, gloo).
    fully_shard(scorer, mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32), reshard_after_forward=True)
    return scorer


def counted_allreduce(state, bucket):
    """DDP's own all-reduce of a gradient bucket, its size added to PAYLOAD."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    PAYLOAD["bytes"] += bucket.buffer().numel() * bucket.buffer().element_size()
    return allreduce_hook(state, bucket)


def sync_gradients(module: torch.nn.Module, sync: bool):
    """Context for one micro-batch's forward and backward: with sync=False the gradients stay local and accumulate;
    the minibatch's last micro-batch syncs, reducing the accumulated sum once (DDP: all-reduce; FSDP2:
    reduce-scatter)."""
    if hasattr(module, "set_requires_gradient_sync"):  # FSDP2
        module.set_requires_gradient_sync(sync)
    if sync or not isinstance(module, torch.nn.parallel.DistributedDataParallel):
        return contextlib.nullcontext()
    return module.no_sync()


def is_sharded(module: torch.nn.Module) -> bool:
    """Are `module`'s parameters FSDP2 shards (DTensors)?"""
    from torch.distributed.tensor import DTensor
    return any(isinstance(p, DTensor) for p in module.parameters())


def full_state_dict(module: torch.nn.Module) -> dict:
    """module.state_dict() with every FSDP2 shard gathered into the full tensor (a collective: all ranks call it)."""
    return dict(full_tensors(module))


def full_tensors(module: torch.nn.Module):
    """(name, full tensor) of module.state_dict(), one at a time: an FSDP2 shard is gathered only when its turn comes,
    so at most one full parameter exists beside the shards (a collective: all ranks iterate in the same order)."""
    from torch.distributed.tensor import DTensor
    for name, value in module.state_dict().items():
        yield name, value.full_tensor() if isinstance(value, DTensor) else value


def optimizer_state(scorer: torch.nn.Module, optimizer) -> dict:
    """The optimizer's state to save: its own state_dict, or under FSDP2 the full (unsharded) one, keyed by parameter
    name (a collective: all ranks call it)."""
    if not hasattr(scorer, "set_requires_gradient_sync"):
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    return get_optimizer_state_dict(scorer, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_optimizer_state(scorer: torch.nn.Module, optimizer, state: dict):
    """The inverse of optimizer_state: under FSDP2 each rank keeps its own shard of the full state."""
    if not hasattr(scorer, "set_requires_gradient_sync"):
        return optimizer.load_state_dict(state)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
    set_optimizer_state_dict(scorer, optimizer, state, options=StateDictOptions(full_state_dict=True))
