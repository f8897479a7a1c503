"""--k-mode adaptive / budget / official: how many vines each state gets, decided in rounds from its rewards so far.

The paper gives every state K vines at once (values.fixed_k_rewards). Here a state's vines come in rounds, and
`round_sizes` says how many more each state gets after every round (0 = done):

    fixed     K at once (one round; what values.py does itself)
    adaptive  rounds of k_round until the Wilson interval is narrower than k_ci, at most k_max
    budget    K x states in all: a first round of k_round each, then rounds to the most uncertain half
    official  the official repository's expander: 10, then 4 more while the normal interval is wider than 0.05, to 30

The rounds are requests (sampling.Request) to the sampler's sample_requests, which hands each state's vines back to
`grade_and_continue` as soon as they are done; that grades them and asks for what comes next. fixed, adaptive and
official decide each state from its own rewards, so a state's next round is asked for at once and no state waits for
another; budget shares its vines over all states, so its next round is asked for when every state's round is graded
(a barrier per round). Our decode loop puts a next round into the running batch (no new prefill); generate and vLLM
sample the rounds in waves, one call per round and vine count (sampling.requests_in_waves). Every (state, round,
vine) row draws its own noise: round r's n vines of state i are the rows i * n + j of seed row_seed(seed, r, n) (with
generate and vLLM, j of the state's place in its call); fixed K is round 0, one request of K for every state.

It joins the paper's path at values.state_rewards (`if k_mode != "fixed"`).
"""
import math
from functools import partial

from grader import grade_vines
from sampling import Request, row_seed

PER_STATE_RULES = ("fixed", "adaptive", "official")  # round_sizes decides each of these from the state's own rewards


def wilson_width(successes: float, n: int, *, z: float = 1.96) -> float:
    """Width of the Wilson score interval of a 0/1 mean after n draws: sensible at 0/n and n/n, where the normal
    approximation's width is 0 (e.g. 0/3: 0.56, 0/9: 0.30, 0/27: 0.12; 1/3: 0.73)."""
    if n == 0:
        return 1.0
    p, z2 = successes / n, z * z
    return 2 * z / (1 + z2 / n) * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))


def posterior_variance(successes: float, n: int) -> float:
    """Variance of the mean under the Beta(1 + successes, 1 + failures) posterior (uniform prior)."""
    a, b = 1 + successes, 1 + n - successes
    return a * b / ((a + b) ** 2 * (a + b + 1))


def round_sizes(rewards: list[list[float]], *, k_mode: str, K: int, k_round: int, k_max: int, k_ci: float) -> list[int]:
    """How many more vines each state gets in the next round, given the rewards its vines have had so far (0 = done).
    fixed: K at once. adaptive: rounds of k_round until the Wilson interval is narrower than k_ci or k_max vines.
    budget: K x states in all; a first round of k_round (at most K) each, then a round to the most uncertain half
    (largest posterior variance) while the budget lasts. official: the official repository's expander: 10, then 4 more
    while the normal interval 2 x 1.96 sqrt(p (1 - p) / n) is wider than 0.05, up to 30."""
    counts = [len(r) for r in rewards]
    if k_mode == "fixed":  # K in all: K at once, or what free samples (counted in `rewards`) leave of K
        return [max(0, K - n) for n in counts]
    if k_mode == "official":
        return [10 if n == 0 else 0 if n >= 30 or 2 * 1.96 * math.sqrt(p * (1 - p) / n) <= 0.05 else min(4, 30 - n)
                for n, p in ((len(r), sum(r) / max(len(r), 1)) for r in rewards)]
    if k_mode == "adaptive":
        return [k_round if n == 0 else 0 if n >= k_max or wilson_width(sum(r), n) <= k_ci else min(k_round, k_max - n)
                for n, r in zip(counts, rewards)]
    left = K * len(rewards) - sum(counts)  # budget
    if 0 in counts:
        return [min(k_round, K)] * len(rewards)
    order = sorted(range(len(rewards)), key=lambda i: (-posterior_variance(sum(rewards[i]), counts[i]), i))
    sizes = [0] * len(rewards)
    for i in order[:min((len(rewards) + 1) // 2, left // k_round)]:
        sizes[i] = k_round
    if left > 0 and not any(sizes):
        sizes[order[0]] = left  # the last few vines, to the most uncertain state
    return sizes


def vine_rewards(*, sampler, sequences, prefix_lens, prompt_lens, answers, grader: str, K: int, k_mode: str,
                 k_round: int, k_max: int, k_ci: float, temperature: float, top_p: float, max_new_tokens: int,
                 seed: int = 0, prior: list[list[float]] | None = None) -> tuple[list[list[float]], int]:
    """The rewards of every state's vines, sampled in rounds (round_sizes; `fixed` is one round of K), and the number
    of tokens sampled: one sampler.sample_requests call, whose on_done (grade_and_continue) grades each state's
    round and asks for its next one (budget: once every state's round is graded). prior[i]: rewards state i already
    has (--free-samples topup), which round_sizes counts but which are not returned."""
    rule = dict(k_mode=k_mode, K=K, k_round=k_round, k_max=k_max, k_ci=k_ci)
    prior = prior or [[] for _ in sequences]
    tally = {"rewards": [list(p) for p in prior], "tokens": 0, "open": 0}  # open: requests of a budget round
    first = round_requests(tally, round_=0, rule=rule, seed=seed)
    if first:
        on_done = partial(grade_and_continue, tally=tally, rule=rule, seed=seed, sequences=sequences,
                          prefix_lens=prefix_lens, prompt_lens=prompt_lens, answers=answers, grader=grader,
                          tokenizer=sampler.tokenizer)
        sampler.sample_requests(sequences, prefix_lens, first, on_done=on_done, temperature=temperature, top_p=top_p,
                                max_new_tokens=[max_new_tokens - (L - p) for L, p in zip(prefix_lens, prompt_lens)])
    return [r[len(p):] for r, p in zip(tally["rewards"], prior)], tally["tokens"]


def round_requests(tally: dict, *, round_: int, rule: dict, seed: int) -> list[Request]:
    """Round `round_` for every state that round_sizes gives vines to, given all the rewards so far."""
    sizes = round_sizes(tally["rewards"], **rule)
    requests = [Request(i, n, row_seed(seed, round_, n), round=round_) for i, n in enumerate(sizes) if n]
    tally["open"] += len(requests)
    return requests


def grade_and_continue(request: Request, samples, *, tally: dict, rule: dict, seed: int, sequences, prefix_lens,
                       prompt_lens, answers, grader: str, tokenizer) -> list[Request]:
    """on_done of vine_rewards' requests: grade one state's round of vines into `tally` (its rewards, the tokens
    sampled), then ask for what comes next: that state's next round at once (per-state rules), or, once the last
    state of a budget round is graded, the next round of every state that round_sizes picks."""
    i, next_round = request.state, request.round + 1
    tally["rewards"][i] += grade_vines(samples, sequence=sequences[i], prefix_len=prefix_lens[i],
                                       prompt_len=prompt_lens[i], answer=answers[i], grader=grader,
                                       tokenizer=tokenizer)
    tally["tokens"] += sum(len(v.token_ids) for v in samples)
    tally["open"] -= 1
    if rule["k_mode"] in PER_STATE_RULES:
        n = round_sizes([tally["rewards"][i]], **rule)[0]
        return [Request(i, n, row_seed(seed, next_round, n), round=next_round)] if n else []
    return [] if tally["open"] else round_requests(tally, round_=next_round, rule=rule, seed=seed)
