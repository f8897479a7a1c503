"""Monte Carlo values: split responses into steps, resume K vines from the state before each step.

A response with steps s_1..s_n has states x, x+s_1, ..., x+s_1..s_{n-1} (x = prompt) plus the terminal state (value
0). V(state) = mean 0/1 reward of K continuations sampled from it with the current policy; a continuation that hits
the length limit scores 0. Identical states across the batch are estimated once. With a cap, only the first
`max_value_steps` states are estimated; later ones are filled from the final reward (their advantages are then 0).

Steps are found in text (`split_steps`) and mapped to tokens through each token's character offset: a token belongs
to the step holding its first character, so the state before step j is prompt + response tokens[:start_j].

How many vines a state gets is `round_sizes`' rule (fixed K, or rounds: adaptive, budget, official). The rounds are
requests (sampling.Request) to the sampler's sample_requests, which hands each state's vines back to
`grade_and_continue` as soon as they are done; that grades them and asks for what comes next: fixed, adaptive and
official decide each state from its own rewards, so a state's next round is asked for at once and no state waits for
another; budget shares its vines out over all states, so its next round is asked for when every state's round is
graded (a barrier per round). Our decode loop puts a next round into the running batch (no new prefill);
generate and vLLM sample the rounds in waves, one call per round and vine count (sampling.requests_in_waves). Every
(state, round, vine) row draws its own noise: round r's n vines of state i are the rows i * n + j of seed
row_seed(seed, r, n) (with generate and vLLM, j of the state's place in its call); fixed K is round 0, one request
of K for every state.
"""
import math
import re
from functools import partial

import torch

import dist
from grader import grade
from sampling import Request, row_seed

# Math that must stay whole: $$..$$, $..$ (not \$), \(..\), \[..\], \begin{env}..\end{env}, [asy]..[/asy].
MATH_SPAN = re.compile(r"(?<!\\)\$\$.+?(?<!\\)\$\$|(?<!\\)\$.+?(?<!\\)\$|\\\(.+?\\\)|\\\[.+?\\\]"
                       r"|\\begin\{([a-zA-Z]+\*?)\}.+?\\end\{\1\}|\[asy\].+?\[/asy\]", re.S)
ATOMIC = ("[asy]", "\\begin{tabular}", "\\begin{asy}")  # never split inside these, not even at newlines
SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")
ABBREVIATIONS = ("e.g.", "i.e.", "Mr.", "Mrs.", "Ms.", "Dr.", "vs.", "etc.", "St.", "Fig.", "No.", "cf.")
PROSE_CUTS, MATH_CUTS = (", ", " and ", ": ", " to "), (",$", "=", "\\equiv", "+")
MIN_STEP_CHARS, MAX_STEP_CHARS = 20, 100


def split_steps(text: str, *, task: str) -> list[str]:
    """Reasoning steps of a response; "".join(steps) == text and no step is blank (unless the text is)."""
    return split_math(text) if task == "math" else split_lines(text)


def split_lines(text: str) -> list[str]:
    """GSM8K rule: one step per line. Blank lines join a neighbour; "#### answer" lines join the step before."""
    steps = []
    for line in re.findall(r"[^\n]*\n|[^\n]+", text):
        if steps and (not steps[-1].strip() or not line.strip() or line.lstrip().startswith("####")):
            steps[-1] += line  # a blank line (or a leading run of them) and the answer line are not steps
        else:
            steps.append(line)
    return steps


def math_spans(text: str) -> list[tuple[int, int, bool]]:
    """(start, end, atomic) of each math span; atomic spans ([asy], tabular) are never split."""
    return [(m.start(), m.end(), m.group(0).startswith(ATOMIC)) for m in MATH_SPAN.finditer(text)]


def inside(pos: int, spans, *, atomic_only: bool = False) -> bool:
    """Is `pos` strictly inside a span (a cut there would split it)?"""
    return any(s < pos < e and (atomic or not atomic_only) for s, e, atomic in spans)


def split_math(text: str) -> list[str]:
    """MATH rule: split at newlines and sentence ends outside math, after math ending in a period; merge short
    pieces forward; cut pieces over MAX_STEP_CHARS near their middle."""
    spans = math_spans(text)
    cuts = {m.end() for m in re.finditer("\n", text) if not inside(m.start(), spans, atomic_only=True)
            and not any(s < m.start() < e and not text.startswith(("$$", "\\[", "\\begin"), s) for s, e, _ in spans)}
    cuts |= {m.end() for m in SENTENCE_END.finditer(text) if not inside(m.start(), spans)
             and not text[:m.start()].endswith(ABBREVIATIONS)}
    cuts |= {m.end() for s, e, _ in spans if re.search(r"\.(\$\$|\$|\\\)|\\\])$", text[s:e])
             for m in [re.compile(r"\s*").match(text, e)]}
    bounds = sorted({0, len(text)} | cuts)
    pieces = [(a, text[a:b]) for a, b in zip(bounds, bounds[1:]) if b > a]
    steps = []
    for start, piece in merge_short(pieces):
        steps.extend(cut_long(piece, start=start, spans=spans))
    return steps


def merge_short(pieces: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """Merge pieces under MIN_STEP_CHARS that do not end a sentence into the next one (the last into the previous)."""
    merged, carry = [], None
    for start, piece in pieces:
        if carry is not None:
            start, piece = carry[0], carry[1] + piece
        short = len(piece.strip()) < MIN_STEP_CHARS and not piece.rstrip().endswith(".")
        carry = (start, piece) if short else None
        if not short:
            merged.append((start, piece))
    if carry is not None:
        if merged:
            merged[-1] = (merged[-1][0], merged[-1][1] + carry[1])
        else:
            merged.append(carry)
    return merged


def cut_long(piece: str, *, start: int, spans) -> list[str]:
    """Cut a piece over MAX_STEP_CHARS once, near its middle: at a prose separator (both halves >= 40 chars), else
    at a math one (both halves >= 20). Never inside [asy] or tabular."""
    if len(piece) <= MAX_STEP_CHARS:
        return [piece]
    middle = len(piece) / 2
    for seps, min_half, in_math in ((PROSE_CUTS, 40, False), (MATH_CUTS, 20, True)):
        options = [i + (len(sep) if sep in (", ", ": ", ",$") else 1 if sep.startswith(" ") else 0)
                   for sep in seps for i in [m.start() for m in re.finditer(re.escape(sep), piece)]]
        options = [i for i in options if min_half <= i <= len(piece) - min_half
                   and inside(start + i, spans) == in_math and not inside(start + i, spans, atomic_only=True)]
        if options:
            cut = min(options, key=lambda i: abs(i - middle))
            return [piece[:cut], piece[cut:]]
    return [piece]


def token_char_starts(token_ids: list[int], *, tokenizer) -> list[int]:
    """Character offset, in the decoded text, at which each token starts (by decoding every prefix)."""
    prefixes = tokenizer.batch_decode([token_ids[:i] for i in range(len(token_ids))], skip_special_tokens=True)
    return [len(p) for p in prefixes]


def step_token_starts(token_ids: list[int], text: str, *, tokenizer, task: str, split: str = "auto",
                      logprobs: list[float] | None = None, entropies: list[float] | None = None) -> list[int]:
    """Index of the first token of each step (where the response branches into vines); always starts with 0.
    split (--step-split): "auto", the dataset's text rule (lines, or MATH's sentences); "tokens:N", every N tokens;
    "lowprob:P", before each sampled token whose probability under the sampler (`logprobs`) was below P (SPO's
    cutpoints), evenly thinned; "entropy:F", before the tokens in the top fraction F of the response's per-token
    policy entropies (`entropies`; TreeRL's forks), highest first. lowprob and entropy keep at most as many states as
    the text rule gives the same response, so that every rule but tokens:N spends at most its vine budget."""
    rule, _, arg = split.partition(":")
    if rule == "tokens":
        return list(range(0, max(len(token_ids), 1), int(arg)))
    starts = text_step_starts(token_ids, text, tokenizer=tokenizer, task=task)
    if rule == "auto":
        return starts
    cuts, at_most = [], len(starts) - 1  # cuts: candidate first tokens of a step; state 0 (the prompt) is kept
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


def text_step_starts(token_ids: list[int], text: str, *, tokenizer, task: str) -> list[int]:
    """First token of each step of split_steps' text rule, through each token's character offset."""
    steps = split_steps(text, task=task)
    char_starts = token_char_starts(token_ids, tokenizer=tokenizer)
    starts, boundary = [0], 0
    for step in steps[:-1]:
        boundary += len(step)
        first = next((i for i, c in enumerate(char_starts) if c >= boundary), len(token_ids))
        if starts[-1] < first < len(token_ids):  # a step with no token of its own merges into the one before
            starts.append(first)
    return starts


def token_step_index(n_tokens: int, starts: list[int]) -> list[int]:
    """For each response token, the index of its step (EOS and trailing tokens belong to the last step)."""
    index, step = [], 0
    for t in range(n_tokens):
        while step + 1 < len(starts) and t >= starts[step + 1]:
            step += 1
        index.append(step)
    return index


def mc_rollouts(*, sampler, sequences: list[list[int]], prefix_lens: list[int], prompt_lens: list[int],
                answers: list[str], grader: str, K: int, temperature: float, top_p: float, max_new_tokens: int,
                seed: int = 0) -> tuple[list[list[float]], int]:
    """The 0/1 rewards of K continuations of every state sequences[i][:prefix_lens[i]] (the first prompt_lens[i]
    tokens being the prompt), and the number of tokens sampled. Each continuation is graded as a whole response,
    prefix included; one cut by the length limit (max_new_tokens for the whole response) scores 0. One
    sample_prefixes call: scripts/diagnose.py's fixed-K values (training's go through vine_rewards)."""
    budgets = [max_new_tokens - (L - p) for L, p in zip(prefix_lens, prompt_lens)]
    vines = sampler.sample_prefixes(sequences, prefix_lens, n=K, temperature=temperature, top_p=top_p,
                                    max_new_tokens=budgets, seed=seed) if sequences else []
    scores = [grade_vines(samples, sequence=seq, prefix_len=L, prompt_len=p, answer=answer, grader=grader,
                          tokenizer=sampler.tokenizer)
              for seq, L, p, answer, samples in zip(sequences, prefix_lens, prompt_lens, answers, vines)]
    return scores, sum(len(v.token_ids) for samples in vines for v in samples)


def grade_vines(samples, *, sequence, prefix_len: int, prompt_len: int, answer: str, grader: str,
                tokenizer) -> list[float]:
    """The 0/1 rewards of a state's vines, each graded as a whole response (the state's response tokens + the vine);
    a vine cut by the length limit scores 0."""
    texts = tokenizer.batch_decode([sequence[prompt_len:prefix_len] + v.token_ids for v in samples],
                                   skip_special_tokens=True)
    return [grade(text, answer, grader=grader, truncated=not v.finished) for text, v in zip(texts, samples)]


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


PER_STATE_RULES = ("fixed", "adaptive", "official")  # round_sizes decides each of these from the state's own rewards


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


def split_states(costs: list[float], *, parts: int) -> list[list[int]]:
    """Indices of `costs` dealt into `parts` lists of about equal total cost: costliest first, each to the part that is
    lightest so far, so that no part ends more than one item's cost above another."""
    loads, out = [0.0] * parts, [[] for _ in range(parts)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        part = min(range(parts), key=lambda p: (loads[p], p))
        out[part].append(i)
        loads[part] += costs[i]
    return [sorted(part) for part in out]


def responses_through(key: tuple, *, prompt: tuple, sequences: list[tuple],
                      groups: dict[tuple, list[int]]) -> list[int]:
    """The responses that pass through a state (key: its tokens, prompt + prefix): those of its prompt (groups:
    prompt -> response indices) whose prompt + response tokens (sequences) begin with the state's tokens. From the
    state on, each of them is a sample of the policy, as a vine is."""
    return [j for j in groups[prompt] if sequences[j][:len(key)] == key]


def free_value(*, fresh_sum: float, fresh_count: int, through: list[int], rewards: list[float], own: int) -> float:
    """A state's value for response `own` with free samples: the mean over its fresh vines and the returns of the
    other responses through it (leave-one-out: response `own`'s reward never enters its own states' values)."""
    others = [rewards[j] for j in through if j != own]
    return (fresh_sum + sum(others)) / max(fresh_count + len(others), 1)


def response_states(prompts: list[list[int]], responses: list[list[int]], step_starts: list[list[int]], *,
                    max_value_steps: int | None) -> list[list[tuple]]:
    """states[i][j]: the key of response i's state j, its tokens (prompt + the steps before j), for the first
    max_value_steps steps (None: all)."""
    return [[tuple(prompt + response[:s]) for s in starts[:len(starts) if max_value_steps is None else max_value_steps]]
            for prompt, response, starts in zip(prompts, responses, step_starts)]


def passing_through(states: list[list[tuple]], *, prompts: list[list[int]],
                    responses: list[list[int]]) -> dict[tuple, list[int]]:
    """--free-samples: each distinct state's responses_through, the responses of its prompt that pass through it."""
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


def vine_requests(states: list[list[tuple]], *, prompts, responses, step_starts, answers, K: int,
                  priors: dict[tuple, list[float]]) -> dict[tuple, tuple]:
    """Each distinct state once, continued from the first response that holds it (any will do): key -> (its
    sequence, prefix length, prompt length, answer, expected vine tokens: (K - its prior rewards) x what that response
    had left after the state, its prior: --free-samples topup's rewards of the others through it)."""
    requests = {}
    for i, (prompt, response, keys) in enumerate(zip(prompts, responses, states)):
        for key, s in zip(keys, step_starts[i]):
            prior = priors.get(key, [])
            requests.setdefault(key, (prompt + response, len(key), len(prompt), answers[i],
                                      max(K - len(prior), 0) * (len(response) - s), prior))
    return requests


def pool_states(requests: dict[tuple, tuple]) -> tuple[dict[tuple, tuple], list[tuple], list[tuple]]:
    """Under torchrun, every rank's states pooled (a state on two ranks: the copy with fewer free samples, that is
    more vines), sorted the same on every rank, and dealt out by expected vine tokens (split_states): (the pooled
    requests, all their keys, this rank's keys). One process: (requests, all, all)."""
    pooled = {}
    for part in dist.all_gather(requests):
        for key, request in part.items():
            if key not in pooled or len(request[5]) < len(pooled[key][5]):
                pooled[key] = request
    keys = sorted(pooled)
    return pooled, keys, [keys[i] for i in split_states([pooled[k][4] for k in keys], parts=dist.world())[dist.rank()]]


def estimate_values(*, sampler, prompts: list[list[int]], responses: list[list[int]], step_starts: list[list[int]],
                    rewards: list[float], answers: list[str], grader: str, K: int, temperature: float, top_p: float,
                    max_new_tokens: int, max_value_steps: int | None = None, seed: int = 0, k_mode: str = "fixed",
                    k_round: int = 3, k_max: int = 27, k_ci: float = 0.5, free_samples: str = "off"):
    """MC value of every state of every response: its distinct states, K vines from each, the mean reward.

    prompts[i], responses[i]: token ids; step_starts[i]: first token of each step (from step_token_starts);
    rewards[i]: the response's own 0/1 reward; answers[i]: its gold answer, against which each continuation is
    graded as a whole response (prefix + continuation). Returns (values, stats): values[i] has
    len(step_starts[i]) + 1 entries, the last being the terminal value 0. The options, each a step of its own:
    max_value_steps caps the states per response (response_states; past the cap V = the final reward, gamma = 1);
    k_mode etc. decide how many vines (round_sizes); under torchrun the states of all ranks are pooled and dealt out
    (pool_states): each is estimated once, on one rank, and every rank gets every value back. free_samples
    (docs/free-samples.md): the responses passing through a state (passing_through) are samples of its value too;
    "add": response i's value is the mean over K fresh vines and the rewards of the other responses through it
    (free_value, leave-one-out); "topup": the same mean, with fresh vines only where the others fall short of K
    (round_sizes counts the |through| - 1 rewards of all but the first response through the state; fixed K only,
    config.py). Under torchrun a rank's free samples are its own responses.
    """
    # 1. The states: where each response's steps begin (prompt + the steps before), up to the cap
    states = response_states(prompts, responses, step_starts, max_value_steps=max_value_steps)
    through = passing_through(states, prompts=prompts, responses=responses) if free_samples != "off" else {}
    priors = {key: [rewards[j] for j in members[1:]] for key, members in through.items()} if (
        free_samples == "topup") else {}
    requests = vine_requests(states, prompts=prompts, responses=responses, step_starts=step_starts, answers=answers,
                             K=K, priors=priors)
    pooled, keys, mine = pool_states(requests)  # each distinct state once, over all ranks; this rank's share

    # 2. K vines from each state (fewer where free samples top it up; more or fewer with adaptive rules)
    scores, vine_tokens = vine_rewards(sampler=sampler, sequences=[pooled[k][0] for k in mine],
                                       prefix_lens=[pooled[k][1] for k in mine],
                                       prompt_lens=[pooled[k][2] for k in mine],
                                       answers=[pooled[k][3] for k in mine], grader=grader, K=K, k_mode=k_mode,
                                       k_round=k_round, k_max=k_max, k_ci=k_ci, temperature=temperature, top_p=top_p,
                                       max_new_tokens=max_new_tokens, seed=seed, prior=[pooled[k][5] for k in mine])
    fresh = {}  # key -> (sum, count) of its fresh vines' rewards, from every rank
    for part in dist.all_gather({key: (sum(sc), len(sc)) for key, sc in zip(mine, scores)}):
        fresh.update(part)

    # 3. The value: the mean reward of the vines (with free samples: and of the others through the state)
    values = []
    for i, keys_i in enumerate(states):
        estimated = [fresh[key][0] / max(fresh[key][1], 1) if free_samples == "off" else
                     free_value(fresh_sum=fresh[key][0], fresh_count=fresh[key][1], through=through[key],
                                rewards=rewards, own=i) for key in keys_i]
        filled = [rewards[i]] * (len(step_starts[i]) - len(keys_i))  # past the cap: V = final reward (gamma = 1)
        values.append(estimated + filled + [0.0])
    return values, value_stats(states, keys=keys, scores=scores, vine_tokens=vine_tokens,
                               through=through if free_samples != "off" else None)


def value_stats(states: list[list[tuple]], *, keys: list[tuple], scores: list[list[float]], vine_tokens: int,
                through: dict[tuple, list[int]] | None) -> dict:
    """The values section's metrics over all ranks: distinct states, states asked for, vines, vine tokens, vines per
    state (mean, most), and with free samples the others through a state (per distinct state of this rank)."""
    counts = [len(sc) for sc in scores]
    totals = dist.all_sum(torch.tensor([sum(map(len, states)), vine_tokens, sum(counts)]))
    most = max(dist.all_gather(max(counts, default=0)))
    stats = {"value_states": len(keys), "value_states_requested": int(totals[0]), "vines": int(totals[2]),
             "vine_tokens": int(totals[1]), "vines_per_state": int(totals[2]) / max(len(keys), 1),
             "vines_per_state_max": most}
    if through is not None:  # on every rank alike: dist.mean is collective
        stats["free_per_state"] = dist.mean([len(members) - 1 for members in through.values()])
    return stats
