"""The decode loops' working memory. A `Workspace` holds what both loops (engine/static.py, engine/continuous.py) read
and write besides their own bookkeeping: the model in the compute dtype, the buffers reused by the batches of a call,
the prefill cache (prefix_cache, filled by prefill) and the generated tokens' cache (suffix_cache), and the seconds
spent prefilling and decoding (`timing`). engine.HFSampler makes one and hands it to the loop it runs.

The prefill cache is right-aligned: sequence g's token t sits at column W - lens[g] + t, so that every sequence ends
at column W; prefix_ends reads a prefix's last hidden state from there.

Shapes: G = sequences in a prefill cache, W = its width, L = layers, Hkv = KV heads, D = head dim, b = sequences
prefilled in one pass, T = their longest length, B = rows, Ws = the suffix cache's width, hidden = the model's width.
"""
import math
import time
from contextlib import contextmanager
from functools import partial

import torch

from engine.decoding import decoder_forward, prefill_attention


def wait_for_device(device: torch.device):
    """Wait for the work queued on `device` (CUDA runs asynchronously), so that `timing` gives the prefill its own
    seconds rather than to the first decoding step that waits for it; nothing to wait for on a CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prefix_ends(cache: dict, places: list[int], prefix_lens: list[int]) -> torch.Tensor:
    """(B, hidden): the final hidden state of each row's prefix, the first prefix_lens[r] tokens of the sequence at
    place places[r] of a prefill cache; the state its first new token is drawn from."""
    W = cache["width"]
    return torch.stack([cache["hidden"][p, W - cache["lens"][p] + L - 1] for p, L in zip(places, prefix_lens)])


class Workspace:
    """The model (in the compute dtype), its reusable buffers and KV caches, prefill, and the timing of a call."""

    def __init__(self, model, *, prefill_tokens: int):
        self.model, self.prefill_tokens = model, prefill_tokens  # prefill: ~prefill_tokens tokens per forward pass
        cfg = model.config
        self.heads_per_kv = cfg.num_attention_heads // cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.timing = {"prefill_s": 0.0, "decode_s": 0.0}  # of the last call: prefill + KV copies, then decoding
        self.buffers = {}  # name -> flat tensor reused by the batches of a call (fresh GB-sized tensors cost seconds of
        # page faults), freed at the call's end: the trainer's update needs that memory (~2.3 GB at the CPU defaults)

    @contextmanager
    def call(self):
        """One sampler call: the model in eval mode and the timing from zero; afterwards the buffers freed and the
        model's mode restored."""
        was_training = self.model.training
        self.model.eval()
        self.timing = {"prefill_s": 0.0, "decode_s": 0.0}
        try:
            yield self
        finally:
            self.buffers.clear()
            self.model.train(was_training)

    @property
    def vocab(self) -> int:
        return self.model.lm_head.weight.shape[0]

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

    def suffix_cache(self, batch: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The generated tokens' keys (L, B, Hkv, D, Ws), stored transposed, and values (L, B, Hkv, Ws, D), for
        `batch` rows of up to `width` tokens; fp32 whatever the model's dtype (decoding.decode_attention says why)."""
        cfg = self.model.config
        rows = (cfg.num_hidden_layers, batch, cfg.num_key_value_heads)
        return (self.buffer("decode_keys", rows + (self.head_dim, width), torch.float32),
                self.buffer("decode_values", rows + (width, self.head_dim), torch.float32))

    def prefix_cache(self, count: int, width: int) -> dict:
        """An empty prefill cache for `count` sequences of up to `width` tokens: keys/values (L, G, Hkv, D, W),
        stored transposed (decoding.decode_attention says why), hidden states (G, W, hidden), each place's sequence
        length (right-aligned: it ends at column W)."""
        cfg = self.model.config
        shape = (cfg.num_hidden_layers, count, cfg.num_key_value_heads, self.head_dim, width)
        keys, values = self.buffer("prefill_keys", shape), self.buffer("prefill_values", shape)
        hidden = self.buffer("prefill_hidden", (count, width, cfg.hidden_size))  # (G, W, hidden)
        return {"keys": keys, "values": values, "hidden": hidden, "lens": [0] * count, "width": width}

    def prefill(self, seqs: list[list[int]], *, cache: dict | None = None, places: list[int] | None = None) -> dict:
        """One forward pass over each sequence (in batches of ~prefill_tokens), right-aligned: into a new cache of
        width max(len) (the static loop), or into `cache` at its places `places` (the continuous loop's pool).
        Returns the cache: keys/values (L, G, Hkv, D, W), final hidden states (G, W, hidden), lens, width. Its
        seconds go to timing["prefill_s"]."""
        started = time.perf_counter()
        if cache is None:
            cache, places = self.prefix_cache(len(seqs), max(map(len, seqs))), list(range(len(seqs)))
        keys, values, hidden, W = cache["keys"], cache["values"], cache["hidden"], cache["width"]
        device = keys.device
        per_batch = max(1, self.prefill_tokens // max(map(len, seqs)))
        for b0 in range(0, len(seqs), per_batch):
            chunk, at = seqs[b0:b0 + per_batch], places[b0:b0 + per_batch]
            contiguous = at == list(range(at[0], at[-1] + 1))
            index = slice(at[0], at[-1] + 1) if contiguous else torch.tensor(at, device=device)
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
        wait_for_device(device)
        self.timing["prefill_s"] += time.perf_counter() - started
        return cache
