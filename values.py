"""Monte Carlo values: split responses into steps, resume K vines from the state before each step, take the mean.

    1. split     a response into reasoning steps s_1..s_n (split_steps: lines; MATH: sentences, math kept whole),
                 mapped to tokens through each token's character offset (step_token_starts)
    2. states    x, x+s_1, ..., x+s_1..s_{n-1} (x = the prompt), each distinct one once over the batch (and over the
                 ranks of torchrun: pool_states); with the cap --max-value-steps only the first ones (response_states)
    3. K vines   from every state with the current policy (fixed_k_rewards), each graded as a whole response; a
                 vine cut by the length limit scores 0
    4. values    V(state) = the mean 0/1 reward of its vines; past the cap V = the response's reward (gamma = 1, so
                 the advantages there are 0); the terminal state's V = 0

A token belongs to the step holding its first character: the state before step j is prompt + response tokens[:start_j].
Ablations join at one call each: --step-split (ablations/branching.py) in step_token_starts, --k-mode
(ablations/adaptive_k.py) in state_rewards; --free-samples (ablations/free_samples.py) builds on state_vines.
"""
import re
from typing import NamedTuple

import torch

import dist
from ablations import adaptive_k
from ablations.branching import branch_starts
from grader import grade_vines
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
    split (--step-split): "auto", the dataset's text rule (text_step_starts); any other rule (tokens:N, lowprob:P
    from the sampler's `logprobs`, entropy:F from the policy's `entropies`) is ablations/branching.py's."""
    if split != "auto":  # --step-split: branch elsewhere than at the text's steps
        return branch_starts(token_ids, split=split, logprobs=logprobs, entropies=entropies,
                             text_starts=lambda: text_step_starts(token_ids, text, tokenizer=tokenizer, task=task))
    return text_step_starts(token_ids, text, tokenizer=tokenizer, task=task)


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


class State(NamedTuple):
    """A distinct state to estimate: the tokens sequence[:prefix_len] (its first prompt_len the prompt), continued
    from the first response that holds it (any will do)."""
    sequence: list[int]  # that response's prompt + response tokens
    prefix_len: int
    prompt_len: int
    answer: str  # the gold answer its vines are graded against
    cost: int  # expected vine tokens: vines to sample x what that response had left after the state
    prior: list[float]  # rewards it already has (--free-samples topup: the other responses through it), else []


def response_states(prompts: list[list[int]], responses: list[list[int]], step_starts: list[list[int]], *,
                    max_value_steps: int | None) -> list[list[tuple]]:
    """states[i][j]: the key of response i's state j, its tokens (prompt + the steps before j), up to the cap."""
    return [[tuple(prompt + response[:s]) for s in starts[:len(starts) if max_value_steps is None else max_value_steps]]
            for prompt, response, starts in zip(prompts, responses, step_starts)]


def vine_requests(states: list[list[tuple]], *, prompts, responses, step_starts, answers, K: int,
                  priors: dict[tuple, list[float]]) -> dict[tuple, State]:
    """Each distinct state once (key -> State), continued from the first response that holds it; priors: the
    rewards a state already has (--free-samples topup), which leave it fewer than K vines to sample."""
    requests = {}
    for i, (prompt, response, keys) in enumerate(zip(prompts, responses, states)):
        for key, s in zip(keys, step_starts[i]):
            prior = priors.get(key, [])
            requests.setdefault(key, State(prompt + response, len(key), len(prompt), answers[i],
                                           max(K - len(prior), 0) * (len(response) - s), prior))
    return requests


def pool_states(requests: dict[tuple, State]) -> tuple[dict[tuple, State], list[tuple], list[tuple]]:
    """Under torchrun, every rank's states pooled (a state on two ranks: the copy with fewer prior rewards, that is
    more vines), sorted the same on every rank, and dealt out by expected vine tokens (dist.deal): (the pooled
    states, all their keys, this rank's keys). One process: (requests, all, all)."""
    pooled = {}
    for part in dist.all_gather(requests):
        for key, state in part.items():
            if key not in pooled or len(state.prior) < len(pooled[key].prior):
                pooled[key] = state
    keys = sorted(pooled)
    return pooled, keys, [keys[i] for i in dist.deal([pooled[k].cost for k in keys], parts=dist.world())[dist.rank()]]


def fixed_k_rewards(*, sampler, states: list[State], K: int, grader: str, temperature: float, top_p: float,
                    max_new_tokens: int, seed: int) -> tuple[list[list[float]], int]:
    """The 0/1 rewards of K vines from every state (K less its prior rewards), and the tokens sampled: one request of
    n vines per state (sampling.Request, seed row_seed(seed, 0, n)) to sampler.sample_requests, whose on_done grades
    a state's vines as soon as they are done. Each vine is graded as a whole response (grader.grade_vines); its
    length limit is what the response had left after the state's prefix."""
    rewards, tokens = [[] for _ in states], [0]

    def grade_state(request: Request, samples) -> list[Request]:
        s = states[request.state]
        rewards[request.state] += grade_vines(samples, sequence=s.sequence, prefix_len=s.prefix_len,
                                              prompt_len=s.prompt_len, answer=s.answer, grader=grader,
                                              tokenizer=sampler.tokenizer)
        tokens[0] += sum(len(v.token_ids) for v in samples)
        return []  # K at once: nothing more to ask for

    requests = [Request(i, n, row_seed(seed, 0, n)) for i, s in enumerate(states) if (n := max(0, K - len(s.prior)))]
    if requests:
        sampler.sample_requests([s.sequence for s in states], [s.prefix_len for s in states], requests,
                                on_done=grade_state, temperature=temperature, top_p=top_p,
                                max_new_tokens=[max_new_tokens - (s.prefix_len - s.prompt_len) for s in states])
    return rewards, tokens[0]


def state_rewards(*, sampler, states: list[State], K: int, k_mode: str, k_round: int, k_max: int, k_ci: float,
                  grader: str, temperature: float, top_p: float, max_new_tokens: int, seed: int):
    """Every state's fresh vine rewards and the tokens sampled: K each (fixed_k_rewards), or --k-mode's rounds."""
    if k_mode != "fixed":  # --k-mode: how many vines each state gets, decided in rounds
        return adaptive_k.vine_rewards(
            sampler=sampler, sequences=[s.sequence for s in states], prefix_lens=[s.prefix_len for s in states],
            prompt_lens=[s.prompt_len for s in states], answers=[s.answer for s in states], grader=grader, K=K,
            k_mode=k_mode, k_round=k_round, k_max=k_max, k_ci=k_ci, temperature=temperature, top_p=top_p,
            max_new_tokens=max_new_tokens, seed=seed, prior=[s.prior for s in states])
    return fixed_k_rewards(sampler=sampler, states=states, K=K, grader=grader, temperature=temperature, top_p=top_p,
                           max_new_tokens=max_new_tokens, seed=seed)


class Vines(NamedTuple):
    """state_vines' result: what the values and their metrics are made of."""
    fresh: dict[tuple, tuple[float, int]]  # every distinct state of every rank -> (sum, count) of its vines' rewards
    keys: list[tuple]  # every distinct state, over all ranks
    scores: list[list[float]]  # this rank's states' vine rewards
    tokens: int  # vine tokens this rank sampled


def state_vines(states: list[list[tuple]], *, sampler, prompts, responses, step_starts, answers, grader: str, K: int,
                temperature: float, top_p: float, max_new_tokens: int, seed: int, k_mode: str, k_round: int,
                k_max: int, k_ci: float, priors: dict[tuple, list[float]]) -> Vines:
    """Vines from each distinct state of `states` (response_states), estimated once over all ranks (pool_states);
    every rank gets every state's (sum, count) back."""
    pooled, keys, mine = pool_states(vine_requests(states, prompts=prompts, responses=responses,
                                                   step_starts=step_starts, answers=answers, K=K, priors=priors))
    scores, tokens = state_rewards(sampler=sampler, states=[pooled[k] for k in mine], K=K, k_mode=k_mode,
                                   k_round=k_round, k_max=k_max, k_ci=k_ci, grader=grader, temperature=temperature,
                                   top_p=top_p, max_new_tokens=max_new_tokens, seed=seed)
    fresh = {}
    for part in dist.all_gather({key: (sum(sc), len(sc)) for key, sc in zip(mine, scores)}):
        fresh.update(part)
    return Vines(fresh, keys, scores, tokens)


def estimate_values(*, sampler, prompts: list[list[int]], responses: list[list[int]], step_starts: list[list[int]],
                    rewards: list[float], answers: list[str], grader: str, K: int, temperature: float, top_p: float,
                    max_new_tokens: int, max_value_steps: int | None = None, seed: int = 0, k_mode: str = "fixed",
                    k_round: int = 3, k_max: int = 27, k_ci: float = 0.5):
    """MC value of every state of every response: its distinct states, K vines from each, the mean reward.

    prompts[i], responses[i]: token ids; step_starts[i]: first token of each step (step_token_starts); rewards[i]: the
    response's 0/1 reward; answers[i]: its gold answer (each vine is graded as a whole response, prefix + vine).
    Returns (values, stats): values[i] has len(step_starts[i]) + 1 entries, the last the terminal value 0.
    max_value_steps caps the states per response (past it V = the final reward); k_mode etc.: --k-mode."""
    # 1. The states: where each response's steps begin (prompt + the steps before), up to the cap
    states = response_states(prompts, responses, step_starts, max_value_steps=max_value_steps)

    # 2. K vines from each distinct state, over all ranks
    vines = state_vines(states, sampler=sampler, prompts=prompts, responses=responses, step_starts=step_starts,
                        answers=answers, grader=grader, K=K, temperature=temperature, top_p=top_p,
                        max_new_tokens=max_new_tokens, seed=seed, k_mode=k_mode, k_round=k_round, k_max=k_max,
                        k_ci=k_ci, priors={})

    # 3. The value: the mean reward of the state's vines; past the cap the final reward; the terminal state 0
    values = []
    for i, keys_i in enumerate(states):
        estimated = [vines.fresh[key][0] / max(vines.fresh[key][1], 1) for key in keys_i]
        values.append(estimated + [rewards[i]] * (len(step_starts[i]) - len(keys_i)) + [0.0])
    return values, value_stats(states, vines)


def value_stats(states: list[list[tuple]], vines: Vines) -> dict:
    """The values section's metrics over all ranks: states (distinct, asked for), vines, their tokens, per state."""
    counts = [len(sc) for sc in vines.scores]
    totals = dist.all_sum(torch.tensor([sum(map(len, states)), vines.tokens, sum(counts)]))
    most = max(dist.all_gather(max(counts, default=0)))
    return {"value_states": len(vines.keys), "value_states_requested": int(totals[0]), "vines": int(totals[2]),
            "vine_tokens": int(totals[1]), "vines_per_state": int(totals[2]) / max(len(vines.keys), 1),
            "vines_per_state_max": most}


def mc_rollouts(*, sampler, sequences: list[list[int]], prefix_lens: list[int], prompt_lens: list[int],
                answers: list[str], grader: str, K: int, temperature: float, top_p: float, max_new_tokens: int,
                seed: int = 0) -> tuple[list[list[float]], int]:
    """The 0/1 rewards of K continuations of every state sequences[i][:prefix_lens[i]] (the first prompt_lens[i]
    tokens being the prompt), and the number of tokens sampled, in one sample_prefixes call: the diagnostics'
    fixed-K values (scripts/diagnose.py, research/free_samples; training's go through state_rewards)."""
    budgets = [max_new_tokens - (L - p) for L, p in zip(prefix_lens, prompt_lens)]
    vines = sampler.sample_prefixes(sequences, prefix_lens, n=K, temperature=temperature, top_p=top_p,
                                    max_new_tokens=budgets, seed=seed) if sequences else []
    scores = [grade_vines(samples, sequence=seq, prefix_len=L, prompt_len=p, answer=answer, grader=grader,
                          tokenizer=sampler.tokenizer)
              for seq, L, p, answer, samples in zip(sequences, prefix_lens, prompt_lens, answers, vines)]
    return scores, sum(len(v.token_ids) for samples in vines for v in samples)
