"""--vines-where silent and --resample-silent: what to do with the groups whose responses all got one reward
(research/vines_where). In such a "silent" group grpo's advantages are all 0: no signal.

--vines-where silent: vines only for the responses whose group's others all agree (vine_responses: every response of
a silent group, and the one response that differs from all the others); their step advantages put in grpo's units
(in_group_units); the other responses take grpo's (silent_advantages). It joins the paper's path at
advantages.values_for and advantages.advantages_for (`if cfg.vines_where != "all"`).

--resample-silent M, its comparator: M fresh responses more to every silent group's prompt, joined to the group, so
that grpo compares each response with 8 + M (resample_silent, train.py's section 3); the grown batch keeps the plain
batch's number of optimizer steps, in near-equal minibatches (plain_steps, equal_minibatches: ppo.py).
"""
import dataclasses
import math
from collections import Counter
from itertools import accumulate

import torch

from grader import grade


def vine_responses(*, rewards: list[float], groups: list[int]) -> list[bool]:
    """Whether each response gets vines, decided on the *other* responses of its group (groups[i] names its prompt):
    yes where they all got one reward (every response of a silent group, and a response that alone differs from all
    the others), no where they differ among themselves. Its own reward plays no part, so it cannot select its credit.
    Deciding on the whole group, its own reward included, vines a response only when the others happen to match it,
    which weights its vine credit by that chance (on a hard prompt a wrong response's far more than a right one's)
    and tilts the expected update off the policy gradient (tests/test_advantages.py: the exact toy)."""
    counts = {}
    for g, r in zip(groups, rewards):
        counts.setdefault(g, Counter())[r] += 1
    return [len(counts[g]) - (counts[g][r] == 1) <= 1 for g, r in zip(groups, rewards)]


def in_group_units(advantages: list[torch.Tensor], *, prompt_values: list[float], K: int) -> list[torch.Tensor]:
    """Vined responses' step advantages in grpo's units. grpo divides r - mean by the sd of its group's outcomes
    (torch.std, Bessel-corrected over the group's n); here each response's advantages are divided by the population
    sd of a Bernoulli(p), sqrt(p (1 - p)) + 1e-4, p its prompt state's MC value (its vines are fresh samples,
    independent of the response, so the division only reweights prompts and keeps the update unbiased), held at least
    half a vine from 0 and 1 (p in [1 / 2K, 1 - 1 / 2K]) so that a prompt whose K vines all agreed is not divided by
    ~0. For n = 8 the two sds differ by sqrt(8 / 7) = 1.07. Applied before the batch whitening: a response whose vines
    found no contrast (all its values equal its reward) keeps advantages of 0 until then."""
    out = []
    for a, p in zip(advantages, prompt_values):
        p = min(max(p, 1 / (2 * K)), 1 - 1 / (2 * K))
        out.append(a / ((p * (1 - p)) ** 0.5 + 1e-4))
    return out


def silent_advantages(step: list[torch.Tensor], *, vined: list[int], values: list, grpo: list[torch.Tensor],
                      K: int) -> list[torch.Tensor]:
    """Every response's advantages (L,): the vined responses' step advantages (`step`, in the order of `vined`) in
    grpo's units (in_group_units, from their prompt state's value values[i][0]); the others grpo's (`grpo`)."""
    advantages = list(grpo)
    for i, a in zip(vined, in_group_units(step, prompt_values=[values[i][0] for i in vined], K=K)):
        advantages[i] = a
    return advantages


def resample_silent(sampler, episodes, rewards: list[float], *, extra: int, cfg, seed: int):
    """--resample-silent M: M fresh responses more to the prompt of every group whose responses all got the same
    reward, graded and joined to that group, so that grpo compares each response with 8 + M. Returns the grown
    episodes (rollout.Episodes) and rewards, and the stats: how many groups were silent (resampled_groups;
    silent_before_frac of all groups) and the share of them that the fresh responses gave contrast
    (resample_found_frac)."""
    first, outcomes = {}, {}  # each group's first response, and the rewards its responses got
    for i, (g, r) in enumerate(zip(episodes.groups, rewards)):
        first.setdefault(g, i)
        outcomes.setdefault(g, set()).add(r)
    silent = [g for g in first if len(outcomes[g]) == 1]
    if not silent or extra == 0:
        return episodes, rewards, {"resampled_groups": 0, "silent_before_frac": len(silent) / max(len(first), 1),
                                   "resample_found_frac": 0.0}
    prompts = [episodes.prompts[first[g]] for g in silent]
    fresh = sampler.sample(prompts, n=extra, temperature=cfg.temperature, top_p=cfg.top_p,
                           max_new_tokens=cfg.max_new_tokens, seed=seed)
    graded = [[grade(s.text, episodes.answers[first[g]], grader=cfg.grader, truncated=not s.finished) for s in group]
              for g, group in zip(silent, fresh)]
    found = sum(any(r != rewards[first[g]] for r in rs) for g, rs in zip(silent, graded))
    grown = dataclasses.replace(
        episodes, prompts=episodes.prompts + [p for p, group in zip(prompts, fresh) for _ in group],
        samples=episodes.samples + [s for group in fresh for s in group],
        answers=episodes.answers + [episodes.answers[first[g]] for g, grp in zip(silent, fresh) for _ in grp],
        groups=episodes.groups + [g for g, group in zip(silent, fresh) for _ in group])
    return grown, rewards + [r for rs in graded for r in rs], {"resampled_groups": len(silent),
                                                                "silent_before_frac": len(silent) / len(first),
                                                                "resample_found_frac": found / len(silent)}


def plain_steps(*, episodes: int, minibatch: int, micro: int) -> int:
    """Optimizer steps an epoch takes on a batch of `episodes` (micro-batches of `micro`, minibatches of `minibatch`)."""
    return math.ceil(math.ceil(episodes / micro) / max(1, minibatch // micro))


def equal_minibatches(groups: list[torch.Tensor], *, steps: int) -> list[list[torch.Tensor]]:
    """A grown batch's micro-batch `groups` in exactly `steps` minibatches of near-equal size: the groups split by
    position into runs of q or q + 1, the longer runs last, where micro_batches' short group sits."""
    steps = min(steps, len(groups))
    q, extra = divmod(len(groups), steps)
    ends = list(accumulate(q + (k >= steps - extra) for k in range(steps)))
    return [groups[a:b] for a, b in zip([0] + ends[:-1], ends)]
