"""Our sampler (`--sampler hf`, the default without vLLM): the decode loop of engine/decoding.py over the transformers
modules of a Llama-family model, with preallocated KV caches, in fp32 or bf16, on any torch device.

Every distinct sequence is prefilled once; all n continuations of each of its prefixes attend to a view of that cache
(the vines of values.py never re-prefill their state) and keep only their own new tokens. Two loops:

- continuous (the default; engine/continuous.py): a fixed number of decode slots; a slot freed by a finished row is refilled
  at the next step from a queue of rows, to which on_done callbacks may add while it runs (sample_requests: values.py
  submits a state's next round of vines as soon as its last one is graded).
- static (continuous=False): batches of up to batch_size rows; finished rows leave and the batch regroups, at
  shrinking width until its longest row ends. Requests that on_done returns wait for the next pass (one prefill per
  pass): rounds with a barrier.

The randomness is a hash of (seed, row key, the row's own step, token), so a row samples the same tokens whatever else
shares its batch, whenever it started, in either loop.

Shapes: B = rows in a batch, G = sequences prefilled together, W = cache width, L = layers, Hkv = KV heads,
D = head dim, V = vocab.
"""
import math
import time
from functools import partial

import torch
from tqdm import tqdm

from engine.continuous import decode_continuous, distinct_sequences, show_progress
from engine.decoding import (decode_attention, decoder_forward, next_tokens, prefill_attention, prefix_layout,
                      suffix_layout)
from sampling import Request, Sample, cut_at_stop, sampler_model, sync_weights


def keep_samples(request: Request, samples: list[Sample], *, out: list) -> list[Request]:
    """on_done for sample_prefixes: store a state's samples, ask for nothing more."""
    out[request.state] = samples
    return []


def settle(device: torch.device):
    """Wait for the work queued on `device` (CUDA runs asynchronously), so that `timing` gives the prefill its own
    seconds rather than to the first decoding step that waits for it; nothing to wait for on a CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class HFSampler:
    """Our decode loop (engine/decoding.py), in fp32 or bf16, for Llama-family models; on CPU or any torch device."""

    def __init__(self, model, tokenizer, *, dtype: torch.dtype | None = None, stop_strings=(), batch_size: int = 256,
                 prefill_tokens: int = 4096, group_tokens: int = 65536, reuse_prefixes: bool = True,
                 continuous: bool = True, suffix_block: int = 32, resort_every: int = 16):
        self.model, self.tokenizer, self.stop_strings = sampler_model(model, dtype), tokenizer, list(stop_strings)
        self.reuse_prefixes = reuse_prefixes  # False: every input sequence is prefilled on its own (the naive way)
        self.continuous = continuous  # False: the static loop (fixed batches, rounds with a barrier)
        # continuous batching: every resort_every steps the rows are sorted by age (0: never), and each block of
        # suffix_block slots reads its suffix only as far as its oldest row (engine/continuous.py, decoding.suffix_layout)
        self.suffix_block, self.resort_every = suffix_block, resort_every
        self.batch_size, self.prefill_tokens, self.group_tokens = batch_size, prefill_tokens, group_tokens
        eos = model.generation_config.eos_token_id
        self.stop_ids = {tokenizer.eos_token_id} | set([eos] if isinstance(eos, int) else eos or [])
        self.timing = {"prefill_s": 0.0, "decode_s": 0.0}  # of the last call: prefill + KV copies, then decoding
        self.buffers = {}  # name -> flat tensor reused by the batches of a call (fresh GB-sized tensors cost seconds of
        # page faults), freed at the call's end: the trainer's update needs that memory (~2.3 GB at the CPU defaults)

    def buffer(self, name: str, shape: tuple, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A view of shape `shape` into the persistent buffer `name`, grown when too small. A buffer is zeroed once,
        when created; afterwards it only ever receives keys, values and hidden states, so whatever a new view finds
        in it is finite, and the positions it has not written are masked out of attention (-inf bias). In the
        model's dtype unless `dtype` says otherwise."""
        numel = math.prod(shape)
        if name not in self.buffers or self.buffers[name].numel() < numel:
            like = next(self.model.parameters())
            self.buffers.pop(name, None)
            self.buffers[name] = like.new_zeros(numel, dtype=dtype)
        return self.buffers[name][:numel].view(shape)

    def cache_views(self, prefix: str, batch: int, width: int, transposed: bool, dtype: torch.dtype | None = None):
        """Keys and values (L, B, Hkv, W, D) for `batch` rows of `width` positions; (L, B, Hkv, D, W) if
        transposed (the prefill cache: decoding.decode_attention says why). In the model's dtype unless `dtype`."""
        cfg = self.model.config
        D = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        shape = (cfg.num_hidden_layers, batch, cfg.num_key_value_heads) + ((D, width) if transposed else (width, D))
        return self.buffer(prefix + "keys", shape, dtype), self.buffer(prefix + "values", shape, dtype)

    def suffix_cache(self, batch: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The generated tokens' keys (L, B, Hkv, D, Ws), stored transposed, and values (L, B, Hkv, Ws, D), for
        `batch` rows of up to `width` tokens; fp32 whatever the model's dtype (decoding.decode_attention says why)."""
        cfg = self.model.config
        D = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        rows = (cfg.num_hidden_layers, batch, cfg.num_key_value_heads)
        return (self.buffer("decode_keys", rows + (D, width), torch.float32),
                self.buffer("decode_values", rows + (width, D), torch.float32))

    def prefix_cache(self, count: int, width: int) -> dict:
        """An empty prefill cache for `count` sequences of up to `width` tokens: keys/values (L, G, Hkv, D, W),
        hidden states (G, W, hidden), each place's sequence length (right-aligned: it ends at column W)."""
        keys, values = self.cache_views("prefill_", count, width, transposed=True)
        hidden = self.buffer("prefill_hidden", (count, width, self.model.config.hidden_size))  # (G, W, hidden)
        return {"keys": keys, "values": values, "hidden": hidden, "lens": [0] * count, "width": width}

    def finished(self, ids: list[int], budget: int) -> bool:
        """Is a row that has generated `ids` done: a stop token, its budget, or a stop string in its last tokens?"""
        return ids[-1] in self.stop_ids or len(ids) >= budget or bool(self.stop_strings) and any(
            stop in self.tokenizer.decode(ids[-16:]) for stop in self.stop_strings)

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
        was_training = self.model.training
        self.model.eval()
        self.timing = {"prefill_s": 0.0, "decode_s": 0.0}
        bar = tqdm(total=sum(r.n for r in requests), desc="sampling", unit="row", leave=False)  # moves every step
        if self.continuous:
            decode_continuous(self, sequences=sequences, prefix_lens=prefix_lens, budgets=budgets, requests=requests,
                              on_done=on_done, temperature=temperature, top_p=top_p, bar=bar)
        else:
            while requests:  # one pass per round of requests
                requests = self.static_pass(sequences, prefix_lens, budgets, requests, on_done=on_done,
                                            temperature=temperature, top_p=top_p, bar=bar)
                bar.total += sum(r.n for r in requests)
        bar.close()
        self.buffers.clear()
        self.model.train(was_training)

    def static_pass(self, sequences, prefix_lens, budgets, requests, *, on_done, temperature, top_p, bar):
        """The static loop over `requests`: their distinct sequences prefilled in groups of ~group_tokens, each
        group's rows decoded in batches of batch_size. Returns what on_done returns for them, to be the next pass."""
        parent_of, parents, need = distinct_sequences(sequences, prefix_lens, states=[r.state for r in requests],
                                                      reuse=self.reuse_prefixes)
        order = sorted(range(len(parents)), key=lambda p: need[p])  # similar lengths prefill and decode together
        rank = {p: r for r, p in enumerate(order)}
        rows = sorted(((parent_of[r.state], prefix_lens[r.state], budgets[r.state], r.state * r.n + j, r.seed,
                        number, j) for number, r in enumerate(requests) for j in range(r.n)),
                      key=lambda row: (rank[row[0]], row[1]))
        out = [[None] * r.n for r in requests]
        group_start = 0
        while group_start < len(order):  # groups of parents whose KV caches are held at once
            group, tokens = [], 0
            while group_start + len(group) < len(order) and (not group or tokens < self.group_tokens):
                group.append(order[group_start + len(group)])
                tokens += need[group[-1]]
            group_start += len(group)
            started = time.perf_counter()
            cache = self.prefill([parents[p][:need[p]] for p in group])
            self.timing["prefill_s"] += time.perf_counter() - started
            slot = {p: s for s, p in enumerate(group)}
            group_rows = [row for row in rows if row[0] in slot]
            for start in range(0, len(group_rows), self.batch_size):
                batch = group_rows[start:start + self.batch_size]
                samples = self.decode([(slot[p], L, b, key, seed) for p, L, b, key, seed, _, _ in batch], cache,
                                      temperature=temperature, top_p=top_p, bar=bar)
                for row, sample in zip(batch, samples):
                    out[row[5]][row[6]] = sample
        return [more for r, samples in zip(requests, out) for more in on_done(r, samples)]

    def prefill(self, seqs: list[list[int]], *, cache: dict | None = None, places: list[int] | None = None) -> dict:
        """One forward pass over each sequence (in batches of ~prefill_tokens), right-aligned: into a new cache of
        width max(len) (the static loop), or into `cache` at its places `places` (the continuous loop's pool).
        Returns the cache: keys/values (L, G, Hkv, D, W), final hidden states (G, W, hidden), lens, width."""
        if cache is None:
            cache, places = self.prefix_cache(len(seqs), max(map(len, seqs))), list(range(len(seqs)))
        keys, values, hidden, W = cache["keys"], cache["values"], cache["hidden"], cache["width"]
        device = keys.device
        per_batch = max(1, self.prefill_tokens // max(map(len, seqs)))
        for b0 in range(0, len(seqs), per_batch):
            chunk, at = seqs[b0:b0 + per_batch], places[b0:b0 + per_batch]
            index = slice(at[0], at[-1] + 1) if at == list(range(at[0], at[-1] + 1)) else torch.tensor(at, device=device)
            T = max(map(len, chunk))
            ids = torch.tensor([[0] * (T - len(s)) + s for s in chunk], device=device)  # (b, T) left-padded
            real = torch.tensor([[False] * (T - len(s)) + [True] * len(s) for s in chunk], device=device)  # (b, T)
            positions = (real.long().cumsum(-1) - 1).clamp(min=0)  # (b, T)
            causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()  # (T, T)
            allowed = (causal & real[:, None, :]) | torch.eye(T, dtype=torch.bool, device=device)  # (b, T, T)
            bias = torch.zeros(allowed.shape, device=device, dtype=keys.dtype)  # (b, T, T)
            bias.masked_fill_(~allowed, float("-inf"))
            attend = partial(prefill_attention, keys=keys, values=values, places=index, start=W - T,
                             bias=bias[:, None])  # pad rows attend to themselves only
            hidden[index, W - T:] = decoder_forward(self.model, ids=ids, positions=positions, attend=attend)
            for place, s in zip(at, chunk):
                cache["lens"][place] = len(s)
        settle(device)
        return cache

    def decode(self, batch, cache: dict, *, temperature: float, top_p: float, bar=None) -> list[Sample]:
        """Sample the rows of `batch` = [(slot, prefix length, budget, row key, seed)] (sorted by slot) from a prefilled
        cache. Prefixes stay in the prefill cache; each row's cache holds only the tokens it generates. `bar`, a
        tqdm bar counting rows, gets finished rows and the tokens generated so far after every step."""
        started = time.perf_counter()
        cfg, B = self.model.config, len(batch)
        G = cfg.num_attention_heads // cfg.num_key_value_heads
        slots, lens, budgets = [row[0] for row in batch], [row[1] for row in batch], [row[2] for row in batch]
        suffix_keys, suffix_values = self.suffix_cache(B, max(budgets))  # (L, B, Hkv, D, Ws), (L, B, Hkv, Ws, D)
        V = self.model.lm_head.weight.shape[0]
        logits = self.buffer("logits", (B, V))  # (B, V), refilled every step
        scratch = self.buffer("logits_fp32", (min(B, 64), V), dtype=torch.float32)  # (chunk, V) sampling in fp32
        layout = prefix_layout(slots=slots, lens=lens, cache=cache, heads_per_kv=G)
        hidden = torch.stack([cache["hidden"][s, cache["width"] - cache["lens"][s] + L - 1] for s, L in zip(slots, lens)])
        positions = torch.tensor(lens, device=hidden.device)  # (B,) the position of each row's first new token
        rows = torch.tensor([row[3] for row in batch], device=hidden.device)  # (B,) row keys
        seeds = torch.tensor([row[4] for row in batch], device=hidden.device)  # (B,)
        alive = list(range(B))  # batch index of each cache row still decoding
        generated, logprobs, finished = [[] for _ in batch], [[] for _ in batch], [False] * B
        settle(hidden.device)
        self.timing["prefill_s"] += time.perf_counter() - started
        started = time.perf_counter()
        for step in range(max(budgets)):
            tokens, token_logprobs = next_tokens(self.model, hidden, rows=rows, temperature=temperature, top_p=top_p,
                                                 seed=seeds, step=step, logits=logits, scratch=scratch)  # (B,), (B,)
            new_tokens, newly_finished = 0, 0
            for c, (token, logp) in enumerate(zip(tokens.tolist(), token_logprobs.tolist())):
                r = alive[c]
                if not finished[r]:
                    generated[r].append(token)
                    logprobs[r].append(logp)
                    finished[r] = self.finished(generated[r], budgets[r])
                    new_tokens, newly_finished = new_tokens + 1, newly_finished + finished[r]
            done = [finished[r] for r in alive]
            if bar is not None:
                show_progress(bar, tokens=new_tokens, rows=newly_finished)
            if all(done):
                break
            if sum(done) * 4 >= len(done):  # finished rows leave the batch once they are a quarter of it
                keep = [c for c, d in enumerate(done) if not d]
                for new, old in enumerate(keep):  # in place: no fresh GB-sized tensor
                    if new != old:
                        suffix_keys[:, new], suffix_values[:, new] = suffix_keys[:, old], suffix_values[:, old]
                suffix_keys, suffix_values = suffix_keys[:, :len(keep)], suffix_values[:, :len(keep)]
                index = torch.tensor(keep, device=hidden.device)
                positions, rows, seeds, tokens = positions[index], rows[index], seeds[index], tokens[index]
                alive = [alive[c] for c in keep]
                layout = prefix_layout(slots=[slots[r] for r in alive], lens=[lens[r] for r in alive], cache=cache,
                                       heads_per_kv=G)
            attend = partial(decode_attention, prefix=layout, prefix_keys=cache["keys"],
                             prefix_values=cache["values"], suffix_keys=suffix_keys, suffix_values=suffix_values,
                             suffix=suffix_layout([step] * len(alive), device=hidden.device))
            hidden = decoder_forward(self.model, ids=tokens[:, None], positions=(positions + step)[:, None],
                                     attend=attend)[:, -1]  # (B, hidden)
        self.timing["decode_s"] += time.perf_counter() - started
        return [cut_at_stop(ids, logprobs=lps, tokenizer=self.tokenizer, stop_ids=self.stop_ids,
                            stop_strings=self.stop_strings, limit=b) for ids, lps, b in zip(generated, logprobs, budgets)]

    def sleep(self):
        pass  # its caches are freed at the end of every call already

    def sync(self, policy):
        sync_weights(self.model, policy)
