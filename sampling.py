"""What every sampler shares (rollout.py's backends and engine/sampler.py build on it; it imports neither):

- Sample, and cut_at_stop, which trims raw generated ids at a stop token / stop string / the length limit;
- sampler_model / sync_weights: the sampler's own copy of the weights in the compute dtype, refreshed after updates;
- row_seed: the seed of one sampled row, so that no two rows of an iteration share their random numbers;
- Request: n continuations of one state, what every sampler's sample_requests takes (values.py submits a state's
  next round of vines as soon as its last one is graded); requests_in_waves: sample_requests for the samplers that
  only sample whole calls (rollout.py's GenerateSampler and VLLMSampler), built on their sample_prefixes;

The log-prob every sampler reports is the sampled token's under the distribution it was drawn from: softmax(logits / T)
renormalised over the top-p nucleus, i.e. log softmax(logits / T)[token] - log(mass of the nucleus). That is what vLLM
reports (its "processed" log-probs, after temperature and top-p) and the only per-token quantity it can report with T
applied; our decode loop computes the same from the nucleus it samples from, and the trainer from its own logits
(model.response_logprobs with top_p; the nucleus is model.nucleus_keep / nucleus_log_mass), so that the
sampler-trainer mismatch and --tis-cap compare like with like.
"""
import copy
from dataclasses import dataclass

import torch

import dist

MASK64 = (1 << 64) - 1


@dataclass
class Sample:
    token_ids: list[int]
    text: str
    finished: bool
    logprobs: list[float]  # one per token id, under the distribution it was sampled from (see the module's docstring)


@dataclass
class Request:
    """n continuations of state `state` (an index into the call's sequences / prefix_lens). In our decode loop, row j
    of it is keyed state * n + j and draws its noise from (seed, key, step, token): what sample_prefixes(..., n,
    seed) gives row (state, j). `round`: the caller's round of vines for that state (values.py), 0 for the first."""
    state: int
    n: int
    seed: int
    round: int = 0


def cut_at_stop(ids: list[int], *, logprobs: list[float], tokenizer, stop_ids: set[int], stop_strings: list[str],
                limit: int) -> Sample:
    """Trim raw generated ids (and their log-probs) at the first stop id or stop string, and at `limit` tokens."""
    for i, token in enumerate(ids[:limit]):
        if token in stop_ids:
            return Sample(ids[:i + 1], tokenizer.decode(ids[:i], skip_special_tokens=True), True, logprobs[:i + 1])
    ids = ids[:limit]
    text = tokenizer.decode(ids, skip_special_tokens=True)
    for stop in stop_strings:
        if stop in text:  # keep the tokens up to the one that completes the stop string, and the string itself
            end = text.index(stop) + len(stop)
            n = next(i for i in range(1, len(ids) + 1) if len(tokenizer.decode(ids[:i], skip_special_tokens=True)) >= end)
            return Sample(ids[:n], text[:end], True, logprobs[:n])
    return Sample(ids, text, False, logprobs[:limit])


def requests_in_waves(sample_prefixes, sequences, prefix_lens, requests: list[Request], *, on_done, temperature, top_p,
                      max_new_tokens) -> None:
    """sample_requests (its contract: engine.HFSampler.sample_requests) for a sampler that samples only whole calls:
    the pending requests in waves. A wave's requests are grouped by (seed, n), each group's states in index order;
    one sample_prefixes(those states, n=n, seed=seed, their budgets) call per group, groups by n, smallest first;
    then on_done(request, samples) for each of the group's requests, and what they return is the next wave.
    values.py's round r of n vines per state is one group, of seed row_seed(seed, r, n): one call per round and
    vine count, every round after the one before. A call keys its rows by their place in it, not by state."""
    budgets = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * len(sequences)
    while requests:
        groups = {}  # (seed, n) -> the wave's requests of that seed and count
        for request in requests:
            groups.setdefault((request.seed, request.n), []).append(request)
        requests = []
        for (seed, n), group in sorted(groups.items(), key=lambda item: item[0][1]):
            group.sort(key=lambda r: r.state)
            states = [r.state for r in group]
            out = sample_prefixes([sequences[i] for i in states], [prefix_lens[i] for i in states], n=n,
                                  temperature=temperature, top_p=top_p, max_new_tokens=[budgets[i] for i in states],
                                  seed=seed)
            for request, samples in zip(group, out):
                requests += on_done(request, samples)


def sampler_model(policy, dtype: torch.dtype | None):
    """The module a sampler decodes with: the policy itself if it is stored in `dtype` (or dtype is None), else a
    frozen copy of it in `dtype` that sync_weights refreshes. Under torchrun always a copy: the trainer's weights may
    be sharded (FSDP2). Make it before dist.wrap."""
    if (dtype is None or next(policy.parameters()).dtype == dtype) and not dist.active():
        return policy
    return copy.deepcopy(policy).to(dtype or next(policy.parameters()).dtype).eval().requires_grad_(False)


@torch.no_grad()
def sync_weights(model, policy):
    """Copy the policy's (fp32 master) weights into the sampler's copy, rounding to its dtype; nothing to do when the
    sampler decodes with the policy itself. Under FSDP2 one parameter is gathered at a time."""
    if model is not policy:
        target = model.state_dict()
        for name, tensor in dist.full_tensors(policy):
            target[name].copy_(tensor)


def splitmix64(x: int) -> int:
    """One step of the splitmix64 mixer on a 64-bit integer: nearby inputs give unrelated outputs."""
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def row_seed(*parts: int) -> int:
    """A seed in [0, 2^63) mixed from integers (e.g. a call's seed and a row's key). Unlike `seed + i`, two different
    part lists collide only by chance (about n^2 / 2^64 for n seeds), so a call's rows never share their noise with
    another row of the same call or of another call (rollouts, vine rounds, evaluation). 63 bits: vLLM keeps seeds in
    int64."""
    x = 0
    for part in parts:
        x = splitmix64(x ^ (part & MASK64))
    return x >> 1
