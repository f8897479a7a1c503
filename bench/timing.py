"""The benchmarks' clock: the best of a few timings, each waiting for the device's queued work first (CUDA runs
asynchronously), and the matmul limit of a decode step (matmul_gflops, decode_step_matmul_seconds: bench.sampler's
and bench.testbed_decode's limit; bench.adamw and bench.denormals time their steps with best_time).
"""
import time

import torch


def wait(device: torch.device):
    """Let the device finish its queued work (CUDA runs asynchronously); nothing to wait for on a CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_time(fn, repeats: int = 3, device: torch.device = torch.device("cpu")) -> float:
    best = float("inf")
    for _ in range(repeats):
        wait(device)
        start = time.perf_counter()
        fn()
        wait(device)
        best = min(best, time.perf_counter() - start)
    return best


def matmul_gflops(m: int, k: int, n: int, device: torch.device = torch.device("cpu")) -> float:
    a, b = torch.randn(m, k, device=device), torch.randn(k, n, device=device)
    reps = max(1, int(2e9 / (2 * m * k * n)))  # about 2 GFLOP per timing
    seconds = best_time(lambda: [torch.mm(a, b) for _ in range(reps)], device=device)
    return 2 * m * k * n * reps / seconds / 1e9


def decode_step_matmul_seconds(model, batch: int) -> tuple[float, float]:
    """(seconds, GFLOP) of one decode step's weight matmuls at `batch` rows: every Linear of every layer + lm_head,
    in fp32 on the model's device."""
    shapes = [tuple(m.weight.shape) for m in model.model.layers[0].modules() if isinstance(m, torch.nn.Linear)]
    layer = sum(2 * batch * i * o / (matmul_gflops(batch, i, o, model.device) * 1e9) for o, i in shapes)
    head_out, head_in = model.lm_head.weight.shape
    head = 2 * batch * head_in * head_out / (matmul_gflops(batch, head_in, head_out, model.device) * 1e9)
    flops = 2 * batch * (len(model.model.layers) * sum(o * i for o, i in shapes) + head_in * head_out) / 1e9
    return len(model.model.layers) * layer + head, flops
