"""Our CPU-friendly decode engine, `HFSampler`, and what it is built from, top down:

- sampler.py: HFSampler, the public surface (sample, sample_prefixes, sample_requests, sleep, sync, timing);
- static.py and continuous.py: the two decode loops (fixed batches; a full batch refilled as rows finish);
- workspace.py: what the loops decode with: the model in the compute dtype, reused buffers, KV caches, prefill;
- rows.py: when a row stops (StopRule), the distinct sequences rows continue, the progress bar;
- decoding.py: the pure tensor functions: the decoder, shared-prefix attention, seeded top-p sampling.

Only rollout.make_sampler, sft.py, the benchmarks, the scripts and the tests make an HFSampler; the algorithm's modules
talk to every sampler through the interface in rollout.py's docstring. The engine imports neither values nor rollout.
"""
from engine.sampler import HFSampler

__all__ = ["HFSampler"]
