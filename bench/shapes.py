"""Random-weight models of real models' shapes: for speed measurements and device checks that need no weights, only a
tokenizer (a few MB). The weights are random, so what they generate is gibberish: use them for speed, memory and
"do two code paths compute the same thing", never for accuracy.

    135m: SmolLM2-135M (the default model): hidden 576, 30 layers, 9 heads, 3 KV heads, MLP 1536, tied embeddings
    1b:   a ~1.1B Llama of TinyLlama-1.1B's shape: hidden 2048, 22 layers, 32 heads, 4 KV heads, MLP 5632, untied
    tiny: 2 layers of width 64, for running the same checks on a CPU in seconds

Every shape takes the tokenizer's vocabulary and special tokens, so any prompt the tokenizer makes is valid input.
The weights are drawn with std `initializer_range` 0.1 (0.2 for tiny), not the real configs' 0.02: at 0.02 attention
is near uniform, the residual stream barely changes from one position to the next, and a greedy continuation repeats
one token (measured: 135m and tiny), which no comparison of two decoders can tell apart. At 0.1 a greedy continuation
of 32 tokens from the 135m shape has 32 distinct tokens. The final norm's weight is LOGIT_SCALE (4), not 1, which
scales the logits and leaves every argmax as it was: at 1 the next-token distribution over 49152 tokens is nearly
flat (greedy log-prob -3.5 for 135m, -5.3 for tiny) and at T = 0.6 the top-p nucleus of 94-100% of the rows is wider
than the 64 likeliest tokens, so decoding.sample_tokens would sort the whole vocabulary for them, which a trained
model rarely makes it do; at 4 no row's nucleus is wider and the greedy log-prob is -0.4 (135m), -0.8 (tiny).
"""
import torch

SHAPES = {
    "135m": dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                 intermediate_size=1536, tie_word_embeddings=True, rope_theta=100000.0, rms_norm_eps=1e-5,
                 max_position_embeddings=8192, initializer_range=0.1),
    "1b": dict(hidden_size=2048, num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
               intermediate_size=5632, tie_word_embeddings=False, rope_theta=10000.0, rms_norm_eps=1e-5,
               max_position_embeddings=2048, initializer_range=0.1),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, tie_word_embeddings=True, rope_theta=100000.0, rms_norm_eps=1e-5,
                 max_position_embeddings=2048, initializer_range=0.2),
}
LOGIT_SCALE = 4.0
REAL_135M = {"vocab_size": 49152}  # what the real SmolLM2-135M config also has, beside SHAPES["135m"]


def shape_config(shape: str, *, tokenizer):
    """A LlamaConfig of `shape` (a key of SHAPES) whose vocabulary and special tokens are `tokenizer`'s."""
    from transformers import LlamaConfig
    if shape not in SHAPES:
        raise SystemExit(f"error: --shape {shape}: not one of {', '.join(SHAPES)}")
    eos = tokenizer.eos_token_id
    return LlamaConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=eos,
                       pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos,
                       **SHAPES[shape])


def random_model(shape: str, *, tokenizer, device: torch.device, seed: int = 0):
    """A LlamaForCausalLM of `shape` with random fp32 weights (transformers' own initialisation, seeded), frozen,
    built on `device` (a 1b model is drawn in seconds on a GPU, a minute on a few cores). Its generation config stops
    at the tokenizer's EOS, as a loaded model's does."""
    from transformers import LlamaForCausalLM
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(shape_config(shape, tokenizer=tokenizer))
    with torch.no_grad():
        model.model.norm.weight.fill_(LOGIT_SCALE)  # peaked next-token distributions, as a trained model's
    model.generation_config.eos_token_id = model.generation_config.pad_token_id = tokenizer.eos_token_id
    return model.eval().requires_grad_(False)


def write_model_folder(shape: str, *, tokenizer, out_dir, seed: int = 0) -> str:
    """An HF folder (fp32 safetensors + the tokenizer) of a random `shape` model, which `--model DIR` loads like any
    other; returns its path. 0.5 GB for 135m."""
    model = random_model(shape, tokenizer=tokenizer, device=torch.device("cpu"), seed=seed)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return str(out_dir)


def config_differences(shape: str, real: dict) -> list[str]:
    """`name: ours != real` for every field of SHAPES[shape] (and the vocabulary, for 135m) that a real model's
    config.json (as a dict) sets differently, the context length and the init's std aside; rope_theta is read from
    rope_parameters where the config keeps it."""
    real = dict(real)
    if "rope_theta" not in real and isinstance(real.get("rope_parameters"), dict):
        real["rope_theta"] = real["rope_parameters"].get("rope_theta")
    ours = {**SHAPES[shape], **(REAL_135M if shape == "135m" else {})}
    return [f"{k}: {v} != {real.get(k)}" for k, v in ours.items()
            if k not in ("max_position_embeddings", "initializer_range") and real.get(k) != v and not (
                isinstance(v, float) and isinstance(real.get(k), float) and abs(real[k] - v) <= 1e-6 * abs(v))]
