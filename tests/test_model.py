"""Default-model resolution with the real SmolLM2 (fetch, convert, cache, reload), bad specs, and log-probs."""
import time

import pytest
import torch
import torch.nn.functional as F

import model as model_mod
from model import DEFAULT_MODEL, cache_dir, convert_gguf, resolve_model, response_logprobs


def test_default_model_is_fetched_converted_and_cached(smol_path, capsys):
    from pathlib import Path
    folder = Path(smol_path)
    assert folder.parent == cache_dir() and (folder / "config.json").exists()
    assert (folder / "model.safetensors").exists() and (folder / "tokenizer.json").exists()
    resolve_model.cache_clear()
    start = time.monotonic()
    assert resolve_model(DEFAULT_MODEL) == smol_path  # second time: straight from the cache
    assert time.monotonic() - start < 2 and "fetching" not in capsys.readouterr().out


@pytest.mark.slow  # converts the real GGUF twice
def test_gguf_conversion_is_reproducible(smol_path, tmp_path):
    """Converting the cached GGUF again gives the same weights as the cached folder."""
    from safetensors.torch import load_file
    gguf = cache_dir() / "SmolLM2-135M-Instruct.Q4_1.gguf"
    out = convert_gguf(gguf, tmp_path / "converted")
    a, b = load_file(out / "model.safetensors"), load_file(f"{smol_path}/model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_loaded_policy(smol):
    model, tokenizer = smol
    assert next(model.parameters()).dtype == torch.float32 and not next(model.parameters()).requires_grad
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.chat_template


def test_offline_default_never_probes_the_hub(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert model_mod.hub_reachable() is False


@pytest.mark.parametrize("make_spec, message", [
    (lambda tmp: str(tmp / "missing.gguf"), "no such .gguf file"),
    (lambda tmp: str(tmp), "without config.json"),
    (lambda tmp: "not a model id", "not a Hub id"),
    (lambda tmp: (tmp / "junk.gguf").write_bytes(b"GGUF junk") and str(tmp / "junk.gguf"), "not a GGUF file"),
])
def test_bad_model_spec_is_one_line(tmp_path, monkeypatch, make_spec, message):
    monkeypatch.setenv("VINEPPO_CACHE", str(tmp_path / "cache"))
    spec = make_spec(tmp_path)
    with pytest.raises(SystemExit) as e:
        resolve_model.__wrapped__(spec)
    assert message in str(e.value) and "\n" not in str(e.value) and spec in str(e.value)


def test_response_logprobs_matches_direct_computation(smol):
    model, tokenizer = smol
    prompts = [tokenizer("Q: what is two plus two?\nA:").input_ids, tokenizer("Hi").input_ids]
    responses = [tokenizer(" It is four.").input_ids, tokenizer(" there, how are you today?").input_ids]
    P, R, pad = max(map(len, prompts)), max(map(len, responses)), tokenizer.pad_token_id
    rows = [[pad] * (P - len(p)) + p + r + [pad] * (R - len(r)) for p, r in zip(prompts, responses)]
    mask = [[0] * (P - len(p)) + [1] * (len(p) + len(r)) + [0] * (R - len(r)) for p, r in zip(prompts, responses)]
    temperature = 0.6
    with torch.no_grad():
        logprobs, entropy, _, _ = response_logprobs(model, input_ids=torch.tensor(rows), attention_mask=torch.tensor(mask),
                                              response_start=P, temperature=temperature, with_entropy=True)
        for i, (p, r) in enumerate(zip(prompts, responses)):
            logits = model(torch.tensor([p + r])).logits[0, len(p) - 1:-1] / temperature  # no padding at all
            direct = F.log_softmax(logits, -1)[torch.arange(len(r)), torch.tensor(r)]
            direct_entropy = torch.distributions.Categorical(logits=logits).entropy()
            torch.testing.assert_close(logprobs[i, :len(r)], direct, atol=2e-4, rtol=1e-4)
            torch.testing.assert_close(entropy[i, :len(r)], direct_entropy, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_output_layer_gives_the_same_logprobs_and_gradients(monkeypatch, dtype):
    """The output layer in chunks of positions, recomputed in backward (checkpoint), against all positions at once:
    the same log-probs and entropies, the same gradients up to summation order."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    tiny = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2))
    ids = torch.randint(0, 300, (3, 20))

    def run(chunk_tokens):
        monkeypatch.setattr(model_mod, "LOGIT_CHUNK_TOKENS", chunk_tokens)
        tiny.zero_grad()
        logprobs, entropy, _, _ = response_logprobs(tiny, input_ids=ids, attention_mask=torch.ones_like(ids),
                                                 response_start=5, temperature=0.6, with_entropy=True, dtype=dtype)
        (logprobs * torch.arange(15.0)).sum().backward()  # a different weight per position: chunks must line up
        return logprobs.detach(), entropy, [p.grad.clone() for p in tiny.parameters()]

    whole, chunked = run(10**6), run(4)  # 4 tokens = 1 position x 3 rows per chunk: 15 chunks
    # the same up to rounding: BLAS may block a matmul of 3 rows differently from one of 45 (seen on an AMD EPYC)
    torch.testing.assert_close(whole[0], chunked[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(whole[1], chunked[1], rtol=1e-6, atol=1e-6)
    # fp32: the same up to summation order. bf16: the trunk's backward rounds the (fp32-equal up to order) incoming
    # gradient to bf16 (8 bits), so a gradient differs by up to a few bf16 spacings of the largest one
    scale = max(g.abs().max() for g in whole[2])
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=float(scale) * 2e-2)
    for a, b in zip(whole[2], chunked[2]):
        torch.testing.assert_close(a, b, **tol)
    assert scale > 1  # gradients that are not all ~0
