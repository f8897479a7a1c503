"""--free-samples add / topup: the group's own responses as samples of a state's value (research/free_samples).

Every response of a prompt that passes through a state (its tokens begin with the state's) is, from the state on, a
sample of the policy, as a vine is: its reward is a free sample of the state's value. For response i:

    add     V = the mean over K fresh vines and the rewards of the other responses through the state
    topup   the same mean, with fresh vines only where the others fall short of K (--k-mode fixed only, config.py)

Leave-one-out (free_value): response i's own reward never enters its own states' values. Under torchrun a rank's free
samples are its own responses. It joins the paper's path at advantages.values_for (`if cfg.free_samples != "off"`),
in place of values.estimate_values, and reuses its states and vines (response_states, state_vines).
"""
import dist
import values


def responses_through(key: tuple, *, prompt: tuple, sequences: list[tuple],
                      groups: dict[tuple, list[int]]) -> list[int]:
    """The responses that pass through a state (key: its tokens, prompt + prefix): those of its prompt (groups:
    prompt -> response indices) whose prompt + response tokens (sequences) begin with the state's tokens. From the
    state on, each of them is a sample of the policy, as a vine is."""
    return [j for j in groups[prompt] if sequences[j][:len(key)] == key]


def passing_through(states: list[list[tuple]], *, prompts: list[list[int]],
                    responses: list[list[int]]) -> dict[tuple, list[int]]:
    """Each distinct state's responses_through, the responses of its prompt that pass through it."""
    sequences = [tuple(p + r) for p, r in zip(prompts, responses)]
    groups = {}  # prompt -> its responses (a prompt drawn twice in a batch: all its responses)
    for i, prompt in enumerate(prompts):
        groups.setdefault(tuple(prompt), []).append(i)
    through = {}
    for i, keys in enumerate(states):
        for key in keys:
            if key not in through:  # a state several responses share: once
                through[key] = responses_through(key, prompt=tuple(prompts[i]), sequences=sequences, groups=groups)
    return through


def free_value(*, fresh_sum: float, fresh_count: int, through: list[int], rewards: list[float], own: int) -> float:
    """A state's value for response `own` with free samples: the mean over its fresh vines and the returns of the
    other responses through it (leave-one-out: response `own`'s reward never enters its own states' values)."""
    others = [rewards[j] for j in through if j != own]
    return (fresh_sum + sum(others)) / max(fresh_count + len(others), 1)


def estimate_values(*, free_samples: str, sampler, prompts: list[list[int]], responses: list[list[int]],
                    step_starts: list[list[int]], rewards: list[float], answers: list[str], grader: str, K: int,
                    temperature: float, top_p: float, max_new_tokens: int, max_value_steps: int | None = None,
                    seed: int = 0, k_mode: str = "fixed", k_round: int = 3, k_max: int = 27, k_ci: float = 0.5):
    """values.estimate_values with the responses through a state as samples of its value too (free_samples add or
    topup; off: values.estimate_values itself). topup counts the |through| - 1 rewards of all but the first
    response through a state as rewards it already has, so that it gets K less those fresh vines. The stats add
    free_per_state: the others through a state, per distinct state of this rank."""
    paper = dict(sampler=sampler, prompts=prompts, responses=responses, step_starts=step_starts, answers=answers,
                 grader=grader, K=K, temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens, seed=seed,
                 k_mode=k_mode, k_round=k_round, k_max=k_max, k_ci=k_ci)
    if free_samples == "off":
        return values.estimate_values(rewards=rewards, max_value_steps=max_value_steps, **paper)
    # 1. The states, and the responses through each
    states = values.response_states(prompts, responses, step_starts, max_value_steps=max_value_steps)
    through = passing_through(states, prompts=prompts, responses=responses)
    priors = {key: [rewards[j] for j in members[1:]] for key, members in through.items()} if (
        free_samples == "topup") else {}

    # 2. Fresh vines from each distinct state (topup: fewer, where the others through it stand in for some)
    vines = values.state_vines(states, priors=priors, **paper)

    # 3. The value: the mean over the fresh vines and the other responses through the state (leave-one-out)
    estimates = []
    for i, keys_i in enumerate(states):
        estimated = [free_value(fresh_sum=vines.fresh[key][0], fresh_count=vines.fresh[key][1], through=through[key],
                                rewards=rewards, own=i) for key in keys_i]
        estimates.append(estimated + [rewards[i]] * (len(step_starts[i]) - len(keys_i)) + [0.0])
    stats = values.value_stats(states, vines)
    stats["free_per_state"] = dist.mean([len(members) - 1 for members in through.values()])  # collective: every rank
    return estimates, stats
