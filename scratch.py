"""A model trained from scratch, for the laptop testbed: a character-level tokenizer and a random-initialised Llama.

`sft.py --model scratch` builds both (new_scratch_model) and saves them as an ordinary Hugging Face folder: the
tokenizer is a real transformers tokenizer (tokenizer.json, loads with AutoTokenizer, EOS and padding defined, no chat
template), the model a LlamaForCausalLM. Everything downstream (train.py, both samplers, model.response_logprobs,
checkpoints, scripts/diagnose.py, vLLM) loads that folder as it loads any other model. Nothing is downloaded.

The vocabulary is the characters of the task (every character of its questions and solutions) and of the prompt
format's template, plus <eos>, <pad> and <unk>; one token per character (newlines too), so a token's text is its
character and decoding joins them. Whether a model's tokenizer can write a run's prompts and data is asked by
data.input_problem before train.py and sft.py run.
"""
from pathlib import Path

import torch

from data import make_prompt

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


def task_chars(examples: list[dict]) -> str:
    """Every character the task's questions and gold solutions use."""
    return "".join(sorted({c for e in examples for text in (e["question"], e.get("solution", "")) for c in text}))


def prompt_chars(prompt_format: str, *, grader: str) -> str:
    """Every character a prompt format writes around the question (plain: a newline; sft: the paper's template).
    chat needs the model's chat template, which a character tokenizer does not have."""
    if prompt_format == "chat":
        raise ValueError("a character tokenizer has no chat template")
    return "".join(sorted(set(make_prompt("", grader=grader, tokenizer=None, prompt_format=prompt_format))))


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
