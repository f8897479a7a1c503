"""Our CPU-friendly decode engine: `HFSampler` (sampler.py) and what it is built from. Only rollout.make_sampler, the
benchmarks and the tests reach in here; the algorithm's modules talk to any sampler through rollout.py's interface."""
from engine.sampler import HFSampler

__all__ = ["HFSampler"]
