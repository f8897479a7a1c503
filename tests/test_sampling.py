"""What every sampler shares (sampling.py), and the vLLM backend's seeding, weight push and backend choice, checked
against a stand-in engine that follows vLLM's rules (no vLLM needed): the j-th of a request's n samples draws with
seed + j, and its tokens depend only on its context and that seed."""
import inspect
import zlib
from types import SimpleNamespace

import pytest
import torch

import dist
import rollout
from config import parse_config
from model import nucleus_keep, nucleus_log_mass
from sampling import row_seed
from values import estimate_values


def test_row_seed_is_deterministic_in_range_and_unrelated_for_neighbours():
    assert row_seed(3, 5) == row_seed(3, 5) and row_seed(3, 5) != row_seed(5, 3)
    seeds = {row_seed(s, i) for s in range(50) for i in range(200)}  # s + i would give 249 distinct values
    assert len(seeds) == 50 * 200 and all(0 <= s < 2 ** 63 for s in seeds)
    assert row_seed(0, -1) != row_seed(0, 2 ** 64 - 2)  # negative parts are fine, and not equal to their neighbour


@pytest.mark.parametrize("vocab, top_p", [(50, 0.9), (300, 0.9), (300, 0.5), (40, 1.0)])
def test_nucleus_log_mass_matches_a_brute_force_nucleus(vocab, top_p):
    g = torch.Generator().manual_seed(vocab)
    logp = torch.log_softmax(torch.randn(3, 4, vocab, generator=g) * (3.0 if vocab == 50 else 0.3), -1)  # (3, 4, V)
    probs = logp.exp().sort(-1, descending=True).values
    brute = torch.zeros(3, 4)
    for i in range(3):
        for j in range(4):
            total = 0.0
            for p in probs[i, j].tolist():  # add tokens until the mass before the next one reaches top_p
                if total >= top_p:
                    break
                total += p
            brute[i, j] = total
    torch.testing.assert_close(nucleus_log_mass(logp, top_p=top_p), brute.log(), atol=1e-5, rtol=0)
    assert nucleus_keep(torch.tensor([0.5, 0.3, 0.2]), top_p=0.8).tolist() == [True, True, False]


class RecordedParams(SimpleNamespace):
    """Stands in for vllm.SamplingParams and keeps every instance made."""
    made = []

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        RecordedParams.made.append(self)


class StandInLLM:
    """vLLM's sampling rules without a model: sample j of a request draws with seed + j, and its tokens are a
    function of (context, that seed) only; a sample ends with EOS after a length set by the same noise."""

    def __init__(self, eos: int):
        self.eos, self.calls = eos, []

    def generate(self, requests, params, use_tqdm=True):
        outputs = []
        for request, p in zip(requests, params):
            completions = []
            for j in range(p.n):
                noise = [zlib.crc32(repr((request["prompt_token_ids"], p.seed + j, t)).encode())
                         for t in range(p.max_tokens)]
                ids = [100 + x % 10_000 for x in noise[:3 + noise[0] % 8]] + [self.eos]
                ids = ids[:p.max_tokens]
                completions.append(SimpleNamespace(token_ids=ids, text="", logprobs=[{t: SimpleNamespace(logprob=-1.0)}
                                                                                     for t in ids],
                                                   finish_reason="stop" if ids[-1] == self.eos else "length"))
            outputs.append(SimpleNamespace(outputs=completions))
        return outputs

    def collective_rpc(self, method, args=(), kwargs=None):
        self.calls.append(method.__name__)
        return [method(self.worker, *args, **(kwargs or {}))]


def child_seeds(params) -> list[int]:
    return [p.seed + j for p in params for j in range(p.n)]


class TinyTokenizer:
    eos_token_id = 2

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))

    def batch_decode(self, seqs, skip_special_tokens=True):
        return [self.decode(s) for s in seqs]


def test_every_row_of_an_iteration_draws_its_own_noise():
    """Rollouts, every adaptive vine round and the evaluation of one iteration, as train.py seeds them: no two rows
    share a child seed, and no vine of a state equals a rollout response token for token (with `seed + i` request
    seeds, vines of state 0, the prompt alone, regenerated rollout responses)."""
    RecordedParams.made = []
    tokenizer = TinyTokenizer()
    sampler = rollout.VLLMSampler(StandInLLM(tokenizer.eos_token_id), tokenizer, params=RecordedParams)
    prompts = [[1, 10 + i, 20 + i] for i in range(8)]
    seed = row_seed(0, 0, 0)  # train.py: the iteration's seed, then row_seed(seed, 0) rollouts, (seed, 1) vines
    groups = sampler.sample(prompts, n=4, temperature=0.6, top_p=0.9, max_new_tokens=12, seed=row_seed(seed, 0))
    samples = [s for g in groups for s in g]
    responses = [s.token_ids for s in samples]
    starts = [list(range(0, len(r), 2)) for r in responses]  # a step every 2 tokens: state 0 is the prompt alone
    vine_calls = []
    continue_prefixes = sampler.sample_prefixes
    sampler.sample_prefixes = lambda seqs, lens, **kw: vine_calls.append((seqs, lens, continue_prefixes(seqs, lens, **kw))) \
        or vine_calls[-1][2]
    estimate_values(sampler=sampler, prompts=[p for p in prompts for _ in range(4)], responses=responses,
                    step_starts=starts, rewards=[0.0] * len(responses), answers=["1"] * len(responses),
                    grader="arith", K=9, temperature=0.6, top_p=0.9, max_new_tokens=12, seed=row_seed(seed, 1),
                    k_mode="adaptive", k_round=3, k_max=9, k_ci=0.1)
    sampler.sample(prompts[:2], n=4, temperature=0.35, top_p=0.9, max_new_tokens=12, seed=row_seed(0, -1, 0))
    seeds = child_seeds(RecordedParams.made)
    assert len(seeds) > 32 * 4 + 8 * 9 and len(set(seeds)) == len(seeds)
    rollouts_of = {tuple(p): {tuple(s.token_ids) for s in g} for p, g in zip(prompts, groups)}
    state0_vines = [tuple(v.token_ids) for seqs, lens, outs in vine_calls for seq, L, vines in zip(seqs, lens, outs)
                    if tuple(seq[:L]) in rollouts_of for v in vines]
    assert len(state0_vines) >= 8 * 9
    assert sum(v in set().union(*rollouts_of.values()) for v in state0_vines) == 0


def test_the_old_seeding_would_collide():
    """The rule the test above guards against: request i seeded seed + i, its samples seed + i + j."""
    old = [SimpleNamespace(seed=100 + i, n=4) for i in range(8)]
    assert len(set(child_seeds(old))) < len(child_seeds(old))


class RecordingRunner:
    def __init__(self, accepts_iterator: bool):
        self.received, self.lazily = [], None
        self.loaded = []
        if accepts_iterator:
            self.reload_weights = self.reload_with_iterator
        self.lm_head = SimpleNamespace(quant_method=SimpleNamespace(process_weights_after_loading=self.repacked))
        self.repacks = 0

    def reload_with_iterator(self, weights_iterator=None, weights_path=None):
        self.lazily = inspect.isgenerator(weights_iterator)
        self.received = [name for name, _ in weights_iterator]

    def reload_weights(self):  # vLLM before the layerwise reload: reloads from disk, takes no iterator
        raise AssertionError("must not be called")

    def get_model(self):
        return SimpleNamespace(load_weights=lambda weights: self.loaded.extend(n for n, _ in weights), lm_head=self.lm_head)

    def repacked(self, layer):
        self.repacks += 1


@pytest.mark.parametrize("accepts_iterator", [True, False])
@pytest.mark.parametrize("cpu_platform", [True, False])
def test_weight_push_streams_and_repacks_only_on_cpu(accepts_iterator, cpu_platform):
    from transformers import LlamaConfig, LlamaForCausalLM
    policy = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                          num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True))
    runner = RecordingRunner(accepts_iterator)
    llm = StandInLLM(eos=2)
    worker = SimpleNamespace(model_runner=runner)
    worker.reload_weights = lambda **kw: runner.reload_weights(**kw)  # the worker's own takes *args, **kwargs
    llm.worker = worker
    llm.asleep_calls = []
    llm.sleep = lambda level: llm.asleep_calls.append(("sleep", level))
    llm.wake_up = lambda tags: llm.asleep_calls.append(("wake", tuple(tags)))
    llm.reset_prefix_cache = lambda: llm.asleep_calls.append(("reset",))
    sampler = rollout.VLLMSampler(llm, TinyTokenizer(), params=RecordedParams, sleep=True, cpu_platform=cpu_platform)
    sampler.sleep()
    sampler.sync(policy)
    names = runner.received if accepts_iterator else runner.loaded
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    assert len(names) == len(policy.state_dict()) - 1
    if accepts_iterator:
        assert runner.lazily  # one tensor at a time, not a materialised list
    assert runner.repacks == (1 if cpu_platform else 0)
    assert llm.asleep_calls == [("sleep", 1), ("wake", ("weights",)), ("wake", ("kv_cache",)), ("reset",)]


def test_sampler_choice_is_made_for_all_ranks(monkeypatch, capsys):
    """vLLM on every rank or on none: one rank without it turns `auto` into our loop everywhere, and `vllm` into a
    one-line error naming the rank."""
    monkeypatch.setattr(dist, "active", lambda: True)
    monkeypatch.setattr(dist, "rank", lambda: 0)
    monkeypatch.setattr(dist, "all_gather", lambda flag: [True, False])  # rank 1 cannot import vLLM
    assert rollout.choose_sampler("auto") == "hf"
    with pytest.raises(SystemExit, match="rank 1"):
        rollout.choose_sampler("vllm")
    monkeypatch.setattr(dist, "all_gather", lambda flag: [True, True])
    assert rollout.choose_sampler("auto") == "vllm" and rollout.choose_sampler("hf") == "hf"


def test_a_failed_start_falls_back_only_on_a_single_process(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no GPU\nlong traceback text")
    monkeypatch.setattr(rollout, "start_vllm", broken)
    assert rollout.open_vllm("auto", "model") is None
    with pytest.raises(SystemExit, match=r"^error: --sampler vllm: vLLM did not start on rank 0 \(RuntimeError: no GPU\)$"):
        rollout.open_vllm("vllm", "model")
    monkeypatch.setattr(dist, "active", lambda: True)
    monkeypatch.setattr(dist, "rank", lambda: 1)
    with pytest.raises(SystemExit, match="did not start on rank 1"):
        rollout.open_vllm("auto", "model")


def test_vllm_memory_flags():
    cfg = parse_config(["--device", "cpu"])
    assert (cfg.vllm_gpu_memory, cfg.vllm_max_batched_tokens, cfg.vllm_sleep) == (0.3, 65536, True)
    assert parse_config(["--device", "cpu", "--vllm-max-batched-tokens", "4096"]).vllm_max_batched_tokens == 4096
    for bad in (["--vllm-gpu-memory", "1.5"], ["--vllm-gpu-memory", "0"], ["--vllm-max-batched-tokens", "0"]):
        with pytest.raises(SystemExit):
            parse_config(bad)
