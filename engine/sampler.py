"""Our sampler (`--sampler hf`, the default without vLLM): the decode loop of engine/decoding.py over the transformers
modules of a Llama-family model, with preallocated KV caches, in fp32 or bf16, on any torch device.

Every distinct sequence is prefilled once; all n continuations of each of its prefixes attend to a view of that cache
(the vines of values.py never re-prefill their state) and keep only their own new tokens. Two loops:

- continuous (the default; engine/continuous.py): a fixed number of decode slots; a slot freed by a finished row is
  refilled at the next step from a queue of rows, to which on_done callbacks may add while it runs (sample_requests:
  values.py submits a state's next round of vines as soon as its last one is graded).
- static (continuous=False; engine/static.py): batches of up to batch_size rows; finished rows leave and the batch
  regroups, at shrinking width until its longest row ends. Requests that on_done returns wait for the next pass
  (one prefill per pass): rounds with a barrier.

The randomness is a hash of (seed, row key, the row's own step, token), so a row samples the same tokens whatever else
shares its batch, whenever it started, in either loop.

HFSampler is only the public surface (sample, sample_prefixes, sample_requests, sleep, sync, and `timing`, the seconds
of the last call): it holds the settings, and for each call builds the StopRule (engine/rows.py) from its stop tokens
and strings and hands it, with its Workspace (engine/workspace.py: the model, buffers, caches, prefill), to one loop.
"""
from functools import partial

import torch
from tqdm import tqdm

from engine.continuous import decode_continuous
from engine.rows import StopRule
from engine.static import decode_static
from engine.workspace import Workspace
from sampling import Request, Sample, sampler_model, sync_weights


def keep_samples(request: Request, samples: list[Sample], *, out: list) -> list[Request]:
    """on_done for sample_prefixes: store a state's samples, ask for nothing more."""
    out[request.state] = samples
    return []


class HFSampler:
    """Our decode loop (engine/decoding.py), in fp32 or bf16, for Llama-family models; on CPU or any torch device."""

    def __init__(self, model, tokenizer, *, dtype: torch.dtype | None = None, stop_strings=(), batch_size: int = 256,
                 prefill_tokens: int = 4096, group_tokens: int = 65536, reuse_prefixes: bool = True,
                 continuous: bool = True, suffix_block: int = 32, resort_every: int = 16):
        self.work = Workspace(sampler_model(model, dtype), prefill_tokens=prefill_tokens)
        self.tokenizer, self.stop_strings = tokenizer, list(stop_strings)
        eos = model.generation_config.eos_token_id
        self.stop_ids = {tokenizer.eos_token_id} | set([eos] if isinstance(eos, int) else eos or [])
        self.continuous = continuous  # False: the static loop (fixed batches, rounds with a barrier)
        self.batch_size = batch_size  # decode slots (continuous) or rows per batch (static)
        self.group_tokens = group_tokens  # prefilled tokens held at once: a prefill group, or the continuous pool
        self.reuse_prefixes = reuse_prefixes  # False: every input sequence is prefilled on its own (the naive way)
        # continuous batching: every resort_every steps the rows are sorted by age (0: never), and each block of
        # suffix_block slots reads its suffix only as far as its oldest row (engine/continuous.py, decoding.suffix_layout)
        self.suffix_block, self.resort_every = suffix_block, resort_every

    @property
    def model(self):
        """The module it decodes with: the policy, or its copy in the sampler's dtype (sampling.sampler_model)."""
        return self.work.model

    @property
    def timing(self) -> dict:
        """Seconds of the last call: {"prefill_s": prefill + KV copies, "decode_s": decoding}."""
        return self.work.timing

    def sample(self, prompts, **kwargs):
        return self.sample_prefixes(prompts, [len(p) for p in prompts], **kwargs)

    def sample_prefixes(self, sequences, prefix_lens, *, n, temperature, top_p, max_new_tokens, seed=0):
        """n continuations of every sequences[i][:prefix_lens[i]]. Each distinct sequence is prefilled once (up to
        its longest requested prefix); every row attends to a view of its prefix's KV cache."""
        out = [None] * len(sequences)
        self.sample_requests(sequences, prefix_lens, [Request(i, n, seed) for i in range(len(sequences))],
                             on_done=partial(keep_samples, out=out), temperature=temperature, top_p=top_p,
                             max_new_tokens=max_new_tokens)
        return out

    @torch.inference_mode()
    def sample_requests(self, sequences, prefix_lens, requests: list[Request], *, on_done, temperature, top_p,
                        max_new_tokens):
        """The continuations that `requests` ask for, of states sequences[i][:prefix_lens[i]], each state's rows
        limited to max_new_tokens (one int, or one per state). When a request's rows are all done,
        on_done(request, samples) gets them and returns more requests (or []): sampled in the same call, at once
        by the continuous loop, in the next pass by the static one."""
        budgets = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * len(sequences)
        stop = StopRule(self.stop_ids, self.stop_strings, self.tokenizer)
        settings = dict(batch_size=self.batch_size, group_tokens=self.group_tokens, reuse_prefixes=self.reuse_prefixes)
        if self.continuous:
            loop = partial(decode_continuous, resort_every=self.resort_every, suffix_block=self.suffix_block)
        else:
            loop = decode_static
        with self.work.call():
            bar = tqdm(total=sum(r.n for r in requests), desc="sampling", unit="row", leave=False)  # moves every step
            loop(self.work, stop, sequences=sequences, prefix_lens=prefix_lens, budgets=budgets, requests=requests,
                 on_done=on_done, temperature=temperature, top_p=top_p, bar=bar, **settings)
            bar.close()

    def sleep(self):
        pass  # its caches are freed at the end of every call already

    def sync(self, policy):
        sync_weights(self.model, policy)
