"""The value diagnoses' ground: groups of 8 responses from an SFT model on chain at the testbed's sampling settings
(sample_groups), and the true value of each of their states, the mean reward of many fresh vines from it
(true_values). research.free_samples.free_samples --values and research.credit.credit --diagnose measure the
estimators against it.
"""
import random
from pathlib import Path


def sample_groups(model_dir: Path, *, prompts: int, seed: int, ops: int = 4, filler: int = 0,
                  max_new_tokens: int = 64, batch_size: int = 256) -> tuple:
    """Groups of 8 responses to `prompts` train problems of chain (ops operations, filler lines) from the model at
    the testbed's sampling settings. Returns (sampler, batch: values.estimate_values' arguments, keys: each
    response's states, prompt + prefix tokens). batch_size: the sampler's decode slots."""
    import torch

    from data import encode_prompt, load_split
    from engine import HFSampler
    from grader import grade
    from model import load_model, load_tokenizer
    from values import step_token_starts
    tokenizer = load_tokenizer(str(model_dir))
    model = load_model(str(model_dir), device=torch.device("cpu"), dtype=torch.float32, frozen=True)
    sampler = HFSampler(model, tokenizer, dtype=torch.float32, batch_size=batch_size)
    examples = random.Random(seed).sample(load_split("chain", "train", arith_ops=ops, chain_filler=filler), prompts)
    ids = [encode_prompt(e["question"], grader="chain", tokenizer=tokenizer, prompt_format="plain") for e in examples]
    groups = sampler.sample(ids, n=8, temperature=0.6, top_p=0.9, max_new_tokens=max_new_tokens, seed=seed)
    batch = dict(prompts=[p for p, g in zip(ids, groups) for _ in g],
                 responses=[s.token_ids for g in groups for s in g],
                 answers=[e["answer"] for e, g in zip(examples, groups) for _ in g], grader="chain", temperature=0.6,
                 top_p=0.9, max_new_tokens=max_new_tokens)
    samples = [s for g in groups for s in g]
    batch["step_starts"] = [step_token_starts(s.token_ids, s.text, tokenizer=tokenizer, task="chain") for s in samples]
    batch["rewards"] = [grade(s.text, a, grader="chain", truncated=not s.finished) for s, a in
                        zip(samples, batch["answers"])]
    keys = [[tuple(p + r[:t]) for t in st] for p, r, st in zip(batch["prompts"], batch["responses"],
                                                                 batch["step_starts"])]
    return sampler, batch, keys


def true_values(sampler, batch: dict, keys: list[list[tuple]], *, truth: int, seed: int) -> dict[tuple, float]:
    """The mean reward of `truth` fresh vines from every distinct state of keys (sample_groups)."""
    from values import mc_rollouts
    distinct = sorted({k for ks in keys for k in ks})
    owner = {k: i for i, ks in enumerate(keys) for k in ks}
    scores, _ = mc_rollouts(sampler=sampler, sequences=[list(batch["prompts"][owner[k]] + batch["responses"][owner[k]])
                                                        for k in distinct], prefix_lens=[len(k) for k in distinct],
                            prompt_lens=[len(batch["prompts"][owner[k]]) for k in distinct],
                            answers=[batch["answers"][owner[k]] for k in distinct], grader="chain", K=truth,
                            temperature=batch["temperature"], top_p=batch["top_p"],
                            max_new_tokens=batch["max_new_tokens"], seed=seed)
    return {k: sum(sc) / len(sc) for k, sc in zip(distinct, scores)}
