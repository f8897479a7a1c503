"""--step-split tokens:N / lowprob:P / entropy:F: where vines may branch other than at the text rule's steps.

The paper branches at reasoning steps found in the text (values.split_steps: lines, or MATH's sentences). These rules
put the branch points elsewhere, each as a list of the first token of every step (0 first: the prompt's state):

    tokens:N    every N tokens
    lowprob:P   before each sampled token whose probability under the sampler was below P (SPO's cutpoints), evenly
                thinned
    entropy:F   before the tokens in the top fraction F of the response's per-token policy entropies (TreeRL's
                forks), highest first; the entropies come from the policy's pass that also gives the update its old
                log-probs (policy_entropies), or, for one response outside training, from token_entropies (the
                diagnostics: scripts/diagnose.py, research.branching.branching --where)

lowprob and entropy keep at most as many states as the text rule gives the same response, so that every rule but
tokens:N spends at most its vine budget. It joins the paper's path at values.step_token_starts
(`if split != "auto"`), and advantages.values_for asks for the entropies (`if cfg.step_split.startswith("entropy:")`).
"""
import math

import torch

from model import response_logprobs
from ppo import score_batch


def branch_starts(token_ids: list[int], *, split: str, text_starts, logprobs: list[float] | None = None,
                  entropies: list[float] | None = None) -> list[int]:
    """Index of the first token of each step under rule `split` (tokens:N, lowprob:P, entropy:F); always starts with
    0. text_starts(): the text rule's starts of the same response (asked for only by lowprob and entropy, whose
    number of states it caps)."""
    rule, _, arg = split.partition(":")
    if rule == "tokens":
        return list(range(0, max(len(token_ids), 1), int(arg)))
    at_most = len(text_starts()) - 1  # cuts: candidate first tokens of a step; state 0 (the prompt) is kept
    if rule == "lowprob":
        cuts = spread([t for t in range(1, len(token_ids)) if logprobs[t] < math.log(float(arg))], at_most=at_most)
    elif rule == "entropy":
        top = math.ceil(float(arg) * len(token_ids))
        cuts = sorted(sorted(range(1, len(token_ids)), key=lambda t: (-entropies[t], t))[:min(top, at_most)])
    else:
        raise ValueError(f"unknown step split {split!r}")
    return [0] + cuts


def spread(items: list, *, at_most: int) -> list:
    """At most `at_most` of `items`, evenly spaced (all of them if they are few enough), in order."""
    if len(items) <= at_most:
        return items
    return [items[int((j + 0.5) * len(items) / at_most)] for j in range(at_most)]


def policy_entropies(scorer, batch: dict, P: int, *, micro: list, responses: list[list[int]], temperature: float,
                     top_p: float) -> list[list[float]]:
    """entropy:F's scores: the policy's entropy at every response token (one list per response), from the pass that
    gives the update its old log-probs, which are kept in `batch` (old_logprobs, log_mass: (B, R) each)."""
    scored = score_batch(scorer, batch, P, groups=micro, temperature=temperature, top_p=top_p, with_entropy=True)
    batch["old_logprobs"], batch["log_mass"] = scored["logprobs"], scored["log_mass"]  # (B, R) each
    return [scored["entropy"][i, :len(r)].tolist() for i, r in enumerate(responses)]


@torch.no_grad()
def token_entropies(model, context: list[int], tokens: list[int], *, temperature: float) -> list[float]:
    """The policy's entropy (temperature-scaled, full vocabulary) at each of `tokens`, given `context` before them:
    model.response_logprobs' entropies, as training's scoring pass computes them."""
    ids = torch.tensor([context + tokens])
    _, entropy, _, _ = response_logprobs(model, input_ids=ids, attention_mask=torch.ones_like(ids),
                                         response_start=len(context), temperature=temperature, with_entropy=True)
    return entropy[0].float().tolist()
