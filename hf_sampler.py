"""Our sampler (`--sampler hf`, the default without vLLM): the decode loop of decoding.py over the transformers
modules of a Llama-family model, with preallocated KV caches, in fp32 or bf16, on any torch device.

Every distinct sequence is prefilled once; all n continuations of each of its prefixes attend to a view of that cache
(the vines of values.py never re-prefill their state) and keep only their own new tokens. Finished rows leave the
batch. The randomness is a hash of (seed, row, step, token), so a row samples the same tokens whatever else shares its
batch.

Shapes: B = rows in a batch, G = sequences prefilled together, W = cache width, L = layers, Hkv = KV heads,
D = head dim, V = vocab.
"""
import math
import time
from functools import partial

import torch
from tqdm import tqdm

from decoding import decode_attention, decoder_forward, next_tokens, prefill_attention, prefix_layout
from sampling import Sample, cut_at_stop, sampler_model, sync_weights


def settle(device: torch.device):
    """Wait for the work queued on `device` (CUDA runs asynchronously), so that `timing` gives the prefill its own
    seconds rather than to the first decoding step that waits for it; nothing to wait for on a CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class HFSampler:
    """Our decode loop (decoding.py), in fp32 or bf16, for Llama-family models; on CPU or any torch device."""

    def __init__(self, model, tokenizer, *, dtype: torch.dtype | None = None, stop_strings=(), batch_size: int = 256,
                 prefill_tokens: int = 4096, group_tokens: int = 65536, reuse_prefixes: bool = True):
        self.model, self.tokenizer, self.stop_strings = sampler_model(model, dtype), tokenizer, list(stop_strings)
        self.reuse_prefixes = reuse_prefixes  # False: every input sequence is prefilled on its own (the naive way)
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
        bar = tqdm(total=len(rows), desc="sampling", unit="row", leave=False)  # moves every decoding step
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
                                      temperature=temperature, top_p=top_p, seed=seed, bar=bar)
                for (_, _, _, key), sample in zip(batch, samples):
                    out[key // n][key % n] = sample
        bar.close()
        self.buffers.clear()
        self.model.train(was_training)
        return out

    def prefill(self, seqs: list[list[int]]) -> dict:
        """One forward pass over each sequence (in batches of ~prefill_tokens), right-aligned in a cache of width
        max(len). Returns its keys/values (L, G, Hkv, D, W), final hidden states (G, W, hidden) and widths."""
        W = max(map(len, seqs))
        keys, values = self.cache_views("prefill_", len(seqs), W, transposed=True)
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
            bias = torch.zeros(allowed.shape, device=device, dtype=keys.dtype)  # (b, T, T)
            bias.masked_fill_(~allowed, float("-inf"))
            attend = partial(prefill_attention, keys=keys[:, b0:b0 + len(chunk)], start=W - T, bias=bias[:, None],
                             values=values[:, b0:b0 + len(chunk)])  # pad rows attend to themselves only
            hidden[b0:b0 + len(chunk), W - T:] = decoder_forward(self.model, ids=ids, positions=positions,
                                                                 attend=attend)
        settle(device)
        return {"keys": keys, "values": values, "hidden": hidden, "lens": [len(s) for s in seqs], "width": W}

    def decode(self, batch, cache: dict, *, temperature: float, top_p: float, seed: int, bar=None) -> list[Sample]:
        """Sample the rows of `batch` = [(slot, prefix length, budget, row key)] (sorted by slot) from a prefilled
        cache. Prefixes stay in the prefill cache; each row's cache holds only the tokens it generates. `bar`, a
        tqdm bar counting rows, gets finished rows and the tokens generated so far after every step."""
        started = time.perf_counter()
        cfg, B = self.model.config, len(batch)
        G = cfg.num_attention_heads // cfg.num_key_value_heads
        slots, lens = [s for s, _, _, _ in batch], [L for _, L, _, _ in batch]
        budgets = [b for _, _, b, _ in batch]
        suffix_keys, suffix_values = self.cache_views("decode_", B, max(budgets), transposed=False,
                                                      dtype=torch.float32)  # fp32 whatever the model's dtype
        V = self.model.lm_head.weight.shape[0]
        logits = self.buffer("logits", (B, V))  # (B, V), refilled every step
        scratch = self.buffer("logits_fp32", (min(B, 64), V), dtype=torch.float32)  # (chunk, V) sampling in fp32
        layout = prefix_layout(slots=slots, lens=lens, cache=cache, heads_per_kv=G)
        hidden = torch.stack([cache["hidden"][s, cache["width"] - cache["lens"][s] + L - 1] for s, L in zip(slots, lens)])
        positions = torch.tensor(lens, device=hidden.device)  # (B,) the position of each row's first new token
        rows = torch.tensor([key for _, _, _, key in batch], device=hidden.device)  # (B,)
        alive = list(range(B))  # batch index of each cache row still decoding
        generated, logprobs, finished = [[] for _ in batch], [[] for _ in batch], [False] * B
        settle(hidden.device)
        self.timing["prefill_s"] += time.perf_counter() - started
        started = time.perf_counter()
        for step in range(max(budgets)):
            tokens, token_logprobs = next_tokens(self.model, hidden, rows=rows, temperature=temperature, top_p=top_p,
                                                 seed=seed, step=step, logits=logits, scratch=scratch)  # (B,), (B,)
            new_tokens, newly_finished = 0, 0
            for c, (token, logp) in enumerate(zip(tokens.tolist(), token_logprobs.tolist())):
                r = alive[c]
                if not finished[r]:
                    generated[r].append(token)
                    logprobs[r].append(logp)
                    finished[r] = token in self.stop_ids or len(generated[r]) >= budgets[r] or bool(
                        self.stop_strings) and any(stop in self.tokenizer.decode(generated[r][-16:])
                                                   for stop in self.stop_strings)
                    new_tokens, newly_finished = new_tokens + 1, newly_finished + finished[r]
            done = [finished[r] for r in alive]
            if bar is not None:
                bar.tokens = getattr(bar, "tokens", 0) + new_tokens
                bar.set_postfix_str(f"{bar.tokens} tokens, {bar.tokens / max(bar.format_dict['elapsed'], 1e-3):.0f} "
                                    "tok/s", refresh=False)
                bar.update(newly_finished)  # redraws at most every 0.1 s
            if all(done):
                break
            if sum(done) * 4 >= len(done):  # finished rows leave the batch once they are a quarter of it
                keep = [c for c, d in enumerate(done) if not d]
                for new, old in enumerate(keep):  # in place: no fresh GB-sized tensor
                    if new != old:
                        suffix_keys[:, new], suffix_values[:, new] = suffix_keys[:, old], suffix_values[:, old]
                suffix_keys, suffix_values = suffix_keys[:, :len(keep)], suffix_values[:, :len(keep)]
                index = torch.tensor(keep, device=hidden.device)
                positions, rows, tokens = positions[index], rows[index], tokens[index]
                alive = [alive[c] for c in keep]
                layout = prefix_layout(slots=[slots[r] for r in alive], lens=[lens[r] for r in alive], cache=cache,
                                       heads_per_kv=G)
            attend = partial(decode_attention, prefix=layout, prefix_keys=cache["keys"],
                             prefix_values=cache["values"], suffix_keys=suffix_keys, suffix_values=suffix_values,
                             step=step)
            hidden = decoder_forward(self.model, ids=tokens[:, None], positions=(positions + step)[:, None],
                                     attend=attend)[:, -1]  # (B, hidden)
        self.timing["decode_s"] += time.perf_counter() - started
        return [cut_at_stop(ids, logprobs=lps, tokenizer=self.tokenizer, stop_ids=self.stop_ids,
                            stop_strings=self.stop_strings, limit=b) for ids, lps, b in zip(generated, logprobs, budgets)]

    def sleep(self):
        pass  # its caches are freed at the end of every call already

    def sync(self, policy):
        sync_weights(self.model, policy)
