"""split_steps on real gold solutions and hand-made cases; step/token mapping; estimate_values with a sampler
whose rewards are known exactly."""
import pytest

from conftest import shipped_rows
from advantages import token_step_index
from sampling import Sample, requests_in_waves, row_seed
from values import estimate_values, split_steps, step_token_starts, token_char_starts


def test_gsm8k_gold_one_step_per_reasoning_line():
    for row in shipped_rows("gsm8k", "test"):
        text = row["answer"]
        steps = split_steps(text, task="gsm8k")
        reasoning_lines = [l for l in text.split("\n") if l.strip() and not l.startswith("####")]
        assert "".join(steps) == text and all(s.strip() for s in steps)
        assert len(steps) == len(reasoning_lines) and steps[-1].rstrip().split("\n")[-1].startswith("####")


@pytest.mark.parametrize("split", ["test", "train"])
def test_math_gold_join_identity(split):
    counts = []
    for row in shipped_rows("math", split):
        steps = split_steps(row["solution"], task="math")
        assert "".join(steps) == row["solution"] and all(s.strip() for s in steps)
        counts.append(len(steps))
    assert 3 < sum(counts) / len(counts) < 15  # several steps per solution, not one per character


def test_gsm8k_rule_on_model_style_text():
    text = "\n\nStep 1: 3 + 4 = 7\n\nStep 2: 7 * 2 = 14\n#### 14\n"
    assert split_steps(text, task="gsm8k") == ["\n\nStep 1: 3 + 4 = 7\n\n", "Step 2: 7 * 2 = 14\n#### 14\n"]
    assert split_steps("", task="gsm8k") == []
    assert split_steps("no newline at all", task="gsm8k") == ["no newline at all"]


def test_math_rule_keeps_math_whole_and_splits_sentences():
    text = ("We have $x = 3. Then$ nothing splits inside math. Next we compute the sum of the values given. "
            "Finally we get $y = 2.$ So the answer is $\\boxed{5}$.")
    steps = split_steps(text, task="math")
    assert "".join(steps) == text
    assert steps[0] == "We have $x = 3. Then$ nothing splits inside math. "
    assert steps[1] == "Next we compute the sum of the values given. "
    assert steps[2:] == ["Finally we get $y = 2.$ ", "So the answer is $\\boxed{5}$."]  # after math ending in "."
    asy = "Draw it:\n[asy]\ndraw((0,0)--(1,1));\n\nlabel(\"A\", (0,0));\n[/asy]\nDone, the figure is shown above."
    assert any("[asy]\ndraw((0,0)--(1,1));\n\nlabel(\"A\", (0,0));\n[/asy]" in s for s in split_steps(asy, task="math"))
    assert split_steps("e.g. This stays. Whole.", task="math")[0].startswith("e.g. This stays.")


def test_math_rule_merges_short_and_cuts_long():
    assert split_steps("Hence\nthe answer follows from the above.", task="math") == [
        "Hence\nthe answer follows from the above."]  # "Hence\n" is short: merged forward
    long = "We first note that both numbers are positive integers, " + "so the sum of these two numbers must be even too."
    assert len(long) > 100
    steps = split_steps(long, task="math")
    assert steps == ["We first note that both numbers are positive integers, ",
                     "so the sum of these two numbers must be even too."]  # cut at ", ": both halves >= 40 chars
    short_tail = "We first note that both of the two numbers given here are positive even numbers, so their sum is even."
    assert len(short_tail) > 100 and split_steps(short_tail, task="math") == [short_tail]  # a half would be < 40


def test_step_token_mapping(smol):
    _, tokenizer = smol
    text = "Step 1: 3 + 4 = 7\nStep 2: 7 * 2 = 14\n#### 14"
    ids = tokenizer(text, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
    starts = step_token_starts(ids, text, tokenizer=tokenizer, task="gsm8k")
    assert len(starts) == 2 and starts[0] == 0
    second = tokenizer.decode(ids[starts[1]:], skip_special_tokens=True)
    assert second.startswith("Step 2") or second.startswith("\nStep 2")
    assert token_char_starts(ids[:3], tokenizer=tokenizer)[0] == 0
    index = token_step_index(len(ids), starts)
    assert index[0] == 0 and index[-1] == 1 and index[starts[1]] == 1 and index[starts[1] - 1] == 0
    assert step_token_starts(ids, text, tokenizer=tokenizer, task="gsm8k", split="tokens:4") == list(
        range(0, len(ids), 4))


class CharTokenizer:
    """Token i decodes to VOCAB[i]; 9 is EOS (skipped)."""
    VOCAB = {0: "a\n", 1: "b\n", 2: "c\n", 3: "#### 1", 4: "#### 0", 9: ""}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.VOCAB[i] for i in ids)

    def batch_decode(self, seqs, skip_special_tokens=True):
        return [self.decode(s) for s in seqs]


class InWaves:
    """sample_requests as generate and vLLM have it: waves of sample_prefixes calls (sampling.requests_in_waves)."""

    def sample_requests(self, sequences, prefix_lens, requests, **kwargs):
        requests_in_waves(self.sample_prefixes, sequences, prefix_lens, requests, **kwargs)


class ScriptedSampler(InWaves):
    """From a state whose prefix has L response tokens, the first `wins[L]` of K vines answer "#### 1" (right),
    one more answers right but is cut by the length limit, the rest answer "#### 0"."""

    def __init__(self, wins):
        self.tokenizer, self.wins, self.calls = CharTokenizer(), wins, []

    def sample_prefixes(self, sequences, prefix_lens, *, n, temperature, top_p, max_new_tokens, seed):
        self.calls.append((sequences, prefix_lens, max_new_tokens))
        out = []
        for seq, L in zip(sequences, prefix_lens):
            w = self.wins[L - 2]  # prompts have 2 tokens
            out.append([Sample([3, 9], "#### 1", True, [0.0, 0.0])] * w + [Sample([3], "#### 1", False, [0.0])] +
                       [Sample([4, 9], "#### 0", True, [0.0, 0.0])] * (n - w - 1))
        return out


def test_estimate_values_exact_means_dedup_cap_truncation():
    prompt = [7, 7]
    responses = [[0, 1, 2, 3, 9], [0, 1, 4, 9], [0, 2, 3, 9]]
    starts = [[0, 1, 2, 3], [0, 1, 2], [0, 1, 2]]
    sampler = ScriptedSampler(wins={0: 2, 1: 4, 2: 6, 3: 8})
    values, stats = estimate_values(sampler=sampler, prompts=[prompt] * 3, responses=responses, step_starts=starts,
                                    rewards=[1.0, 0.0, 1.0], answers=["1"] * 3, grader="gsm8k", K=9,
                                    temperature=0.6, top_p=0.9, max_new_tokens=10, max_value_steps=None)
    # K = 9: wins w right, 1 truncated (scores 0 though its text is right), 8 - w wrong -> V = w / 9.
    assert values[0] == pytest.approx([2 / 9, 4 / 9, 6 / 9, 8 / 9, 0.0])
    assert values[1] == pytest.approx([2 / 9, 4 / 9, 6 / 9, 0.0])
    # States: [] (shared by all), [0] (shared by all), [0,1] (responses 0 and 1), [0,1,2], [0,2] -> 5 unique of 10.
    assert stats["value_states"] == 5 and stats["value_states_requested"] == 10 and stats["vines"] == 45
    sequences, prefix_lens, budgets = sampler.calls[0]
    assert len(prefix_lens) == 5 and budgets == [10 - (L - 2) for L in prefix_lens]

    capped, stats = estimate_values(sampler=ScriptedSampler(wins={0: 2, 1: 4, 2: 6, 3: 8}), prompts=[prompt],
                                    responses=responses[:1], step_starts=starts[:1], rewards=[1.0], answers=["1"],
                                    grader="gsm8k", K=9, temperature=0.6, top_p=0.9, max_new_tokens=10,
                                    max_value_steps=2)
    assert capped[0] == pytest.approx([2 / 9, 4 / 9, 1.0, 1.0, 0.0])  # past the cap: the final reward
    assert stats["value_states"] == 2


def test_free_samples_leave_one_out_on_a_hand_built_group():
    """--free-samples: the other responses through a state are samples of its value; a response's own reward never
    enters its own states' values. States of the group (prompt [7, 7]): [] and [0] are passed through by all three
    responses, [0, 1] by responses 0 and 1 (response 1 has no boundary of its own there), [0, 1, 2] by 0, [0, 2] by 2."""
    from ablations.adaptive_k import round_sizes
    from ablations.free_samples import estimate_values, responses_through
    prompt, responses = [7, 7], [[0, 1, 2, 3, 9], [0, 1, 4, 9], [0, 2, 3, 9]]
    starts, rewards = [[0, 1, 2, 3], [0, 1], [0, 1, 2]], [1.0, 0.0, 1.0]
    sequences = [tuple(prompt + r) for r in responses]
    keys = [(7, 7), (7, 7, 0), (7, 7, 0, 1), (7, 7, 0, 1, 2), (7, 7, 0, 2), (7, 7, 1)]
    assert [responses_through(key, prompt=(7, 7), sequences=sequences, groups={(7, 7): [0, 1, 2]}) for key in keys] == [
        [0, 1, 2], [0, 1, 2], [0, 1], [0], [2], []]
    assert round_sizes([[1.0, 0.0], [], [1.0] * 9], k_mode="fixed", K=9, k_round=3, k_max=27, k_ci=0.5) == [7, 9, 0]
    run = dict(prompts=[prompt] * 3, responses=responses, step_starts=starts, answers=["1"] * 3, grader="gsm8k",
               temperature=0.6, top_p=0.9, max_new_tokens=10)
    # add: K = 9 fresh vines (w / 9 right, ScriptedSampler) plus the others' rewards
    values, stats = estimate_values(sampler=ScriptedSampler(wins={0: 2, 1: 4, 2: 6, 3: 8}), rewards=rewards, K=9,
                                    free_samples="add", **run)
    assert values[0] == pytest.approx([(2 + 0 + 1) / 11, (4 + 0 + 1) / 11, (6 + 0) / 10, 8 / 9, 0.0])
    assert values[1] == pytest.approx([(2 + 1 + 1) / 11, (4 + 1 + 1) / 11, 0.0])
    assert values[2] == pytest.approx([(2 + 1 + 0) / 11, (4 + 1 + 0) / 11, 6 / 9, 0.0])
    assert stats["vines"] == 45 and stats["free_per_state"] == pytest.approx((2 + 2 + 1 + 0 + 0) / 5)
    flipped, _ = estimate_values(sampler=ScriptedSampler(wins={0: 2, 1: 4, 2: 6, 3: 8}), rewards=[0.0, 0.0, 1.0], K=9,
                                 free_samples="add", **run)
    assert flipped[0] == values[0] and flipped[1] != values[1]  # its own reward is not in its own values
    # topup: fresh vines only up to K with the others counted: [] and [0] get 9 - 2, [0, 1] 9 - 1, the rest 9
    sampler = ScriptedSampler(wins={0: 2, 1: 4, 2: 6, 3: 8})
    values, stats = estimate_values(sampler=sampler, rewards=rewards, K=9, free_samples="topup", **run)
    assert stats["vines"] == 7 + 7 + 8 + 9 + 9
    assert values[0] == pytest.approx([(2 + 0 + 1) / 9, (4 + 0 + 1) / 9, (6 + 0) / 9, 8 / 9, 0.0])
    assert values[1] == pytest.approx([(2 + 1 + 1) / 9, (4 + 1 + 1) / 9, 0.0])
    # where the others alone reach K, no vine is sampled: K = 2 leaves [] and [0] to the other two responses
    sampler = Unanimous()
    values, stats = estimate_values(sampler=sampler, rewards=rewards, K=2, free_samples="topup", **run)
    assert stats["vines"] == 0 + 0 + 1 + 2 + 2 and sorted(L for _, lens, _ in sampler.calls for L in lens) == [4, 4, 5]
    assert values[0] == pytest.approx([(0 + 1) / 2, (0 + 1) / 2, (1 + 0) / 2, 1.0, 0.0])
    assert values[1] == pytest.approx([(1 + 1) / 2, (1 + 1) / 2, 0.0])


class Unanimous(InWaves):
    """Every vine right; records the prefix lengths it is asked to continue."""

    def __init__(self):
        self.tokenizer, self.calls = CharTokenizer(), []

    def sample_prefixes(self, sequences, prefix_lens, *, n, temperature, top_p, max_new_tokens, seed):
        self.calls.append((sequences, prefix_lens, n))
        return [[Sample([3, 9], "#### 1", True, [0.0, 0.0])] * n for _ in sequences]


class SeededSampler(InWaves):
    """Each vine right ("#### 1") with its state's probability p(L) (L = prefix tokens past the 2-token prompt), drawn
    from a hash of (seed, state, vine index): the same seed gives the same vines."""

    def __init__(self, p):
        self.tokenizer, self.p, self.asked = CharTokenizer(), p, 0

    def sample_prefixes(self, sequences, prefix_lens, *, n, temperature, top_p, max_new_tokens, seed):
        import random
        self.asked += n * len(sequences)
        return [[Sample([3, 9], "#### 1", True, [0.0, 0.0]) if random.Random(hash((seed, tuple(seq[:L]), j))).random()
                 < self.p[L - 2] else Sample([4, 9], "#### 0", True, [0.0, 0.0]) for j in range(n)]
                for seq, L in zip(sequences, prefix_lens)]


def run_modes(k_mode, seed=0, **kwargs):
    prompt, responses = [7, 7], [[0, 1, 2, 3, 9], [0, 2, 1, 9], [1, 0, 2, 9]]
    starts = [[0, 1, 2, 3], [0, 1, 2], [0, 1, 2]]
    sampler = SeededSampler(p={0: 0.0, 1: 0.5, 2: 1.0, 3: 0.3})
    values, stats = estimate_values(sampler=sampler, prompts=[prompt] * 3, responses=responses, step_starts=starts,
                                    rewards=[1.0, 0.0, 1.0], answers=["1"] * 3, grader="gsm8k", K=9, temperature=0.6,
                                    top_p=0.9, max_new_tokens=10, seed=seed, k_mode=k_mode, **kwargs)
    return values, stats, sampler


def test_stopping_rules_on_hand_made_rewards():
    from ablations.adaptive_k import round_sizes, wilson_width
    assert wilson_width(0, 3) == pytest.approx(0.56, abs=0.01) and wilson_width(3, 3) == wilson_width(0, 3)
    assert wilson_width(1, 3) > wilson_width(0, 3) > wilson_width(0, 9) > wilson_width(0, 27)
    rules = dict(K=9, k_round=3, k_max=12, k_ci=0.6)
    # adaptive: a first round for everyone; all-0 and all-1 after 3 stop (0.56 < 0.6); mixed go on, up to k_max
    assert round_sizes([[], [], []], k_mode="adaptive", **rules) == [3, 3, 3]
    assert round_sizes([[0, 0, 0], [1, 1, 1], [1, 0, 0]], k_mode="adaptive", **rules) == [0, 0, 3]
    assert round_sizes([[1, 0] * 3, [1, 0] * 6], k_mode="adaptive", **rules) == [3, 0]  # 3/6: width 0.63; k_max
    assert round_sizes([[1, 0] * 5 + [1]], k_mode="adaptive", **dict(rules, k_ci=0.3)) == [1]  # the last one to 12
    # official: 10 first; unanimous 10 stop (normal width 0); mixed add 4 up to 30
    assert round_sizes([[]], k_mode="official", **rules) == [10]
    assert round_sizes([[0] * 10, [1] * 10, [1] + [0] * 9, [1, 0] * 15], k_mode="official", **rules) == [0, 0, 4, 0]
    # fixed: K once
    assert round_sizes([[], [1] * 9], k_mode="fixed", **rules) == [9, 0]


def test_budget_never_exceeds_its_budget_and_gives_every_state_a_round():
    import random
    from ablations.adaptive_k import round_sizes
    for K, k_round, states in ((9, 3, 7), (2, 3, 4), (9, 4, 1), (5, 3, 6)):
        rng, rewards = random.Random(K), [[] for _ in range(states)]
        truth = [rng.random() for _ in range(states)]
        while any(sizes := round_sizes(rewards, k_mode="budget", K=K, k_round=k_round, k_max=99, k_ci=0.1)):
            for r, n, p in zip(rewards, sizes, truth):
                r += [float(rng.random() < p) for _ in range(n)]
        assert sum(map(len, rewards)) == K * states, (K, k_round, states)  # all of the budget, never more
        assert min(map(len, rewards)) >= min(k_round, K)


def test_fixed_mode_is_one_round_of_k_and_modes_are_deterministic():
    from values import mc_rollouts
    values, stats, sampler = run_modes("fixed", seed=5)
    assert stats["vines"] == 9 * stats["value_states"] == sampler.asked and stats["vines_per_state_max"] == 9
    again = SeededSampler(p={0: 0.0, 1: 0.5, 2: 1.0, 3: 0.3})  # today's single mc_rollouts call, same seed
    keys = sorted({tuple([7, 7] + r[:s]) for r, st in zip([[0, 1, 2, 3, 9], [0, 2, 1, 9], [1, 0, 2, 9]],
                                                           [[0, 1, 2, 3], [0, 1, 2], [0, 1, 2]]) for s in st})
    scores, _ = mc_rollouts(sampler=again, sequences=[list(k) + [9] for k in keys], prefix_lens=[len(k) for k in keys],
                            prompt_lens=[2] * len(keys), answers=["1"] * len(keys), grader="gsm8k", K=9,
                            temperature=0.6, top_p=0.9, max_new_tokens=10, seed=row_seed(5, 0, 9))  # round 0, 9 vines
    today = {k: sum(s) / 9 for k, s in zip(keys, scores)}
    assert values[0][:4] == [today[tuple([7, 7] + [0, 1, 2, 3][:s])] for s in [0, 1, 2, 3]]
    for mode in ("adaptive", "budget", "official"):
        first, second = run_modes(mode, seed=3, k_ci=0.6)[:2], run_modes(mode, seed=3, k_ci=0.6)[:2]
        assert first == second, mode
    adaptive = run_modes("adaptive", seed=3, k_ci=0.6)[1]
    assert adaptive["vines_per_state"] < 9 and adaptive["vines_per_state_max"] > 3  # unanimous states stop at 3
    assert run_modes("budget", seed=3)[1]["vines"] == 9 * adaptive["value_states"]


class KeyedSampler:
    """Vines keyed like our sampler's rows: vine j of the i-th state of a call of n each is right with its state's
    probability p(L) (L = prefix tokens past the 2-token prompt), drawn from a hash of (seed, i * n + j).
    sample_requests answers its requests in an order shuffled by `order`: a state's next round may be answered
    before another state's first. `answered`: (state, round) in the order answered; `calls`: the sample_prefixes
    calls, (prefix lengths, n, seed, budgets) each."""

    def __init__(self, p, order: int):
        import random
        self.tokenizer, self.p, self.order, self.answered, self.calls = CharTokenizer(), p, random.Random(order), [], []

    def vine(self, L, seed, key):
        import random
        right = random.Random(hash((seed, key))).random() < self.p[L - 2]
        return Sample([3, 9], "#### 1", True, [0.0, 0.0]) if right else Sample([4, 9], "#### 0", True, [0.0, 0.0])

    def sample_prefixes(self, sequences, prefix_lens, *, n, temperature, top_p, max_new_tokens, seed):
        self.calls.append((list(prefix_lens), n, seed, list(max_new_tokens)))
        return [[self.vine(L, seed, i * n + j) for j in range(n)] for i, L in enumerate(prefix_lens)]

    def sample_requests(self, sequences, prefix_lens, requests, *, on_done, temperature, top_p, max_new_tokens):
        pending = list(requests)
        while pending:
            r = pending.pop(self.order.randrange(len(pending)))
            self.answered.append((r.state, r.round))
            pending += on_done(r, [self.vine(prefix_lens[r.state], r.seed, r.state * r.n + j) for j in range(r.n)])


class KeyedInWaves(InWaves, KeyedSampler):
    """KeyedSampler's vines, its requests answered as generate and vLLM answer them (requests_in_waves)."""


@pytest.mark.parametrize("k_mode", ["fixed", "adaptive", "budget", "official"])
def test_rounds_without_barriers_give_the_rounds_results(k_mode):
    """vine_rewards through sample_requests, its requests answered in two shuffled orders, equals the rounds one
    after another (every state's round r before any round r + 1) on the same keyed vines: the same stopping rule,
    the same results. Per-state rules really run without a barrier; budget keeps its barrier per round. Fixed K
    through requests is a single call of K (row_seed(seed, 0, K)). With generate's and vLLM's sample_requests
    (requests_in_waves), the sample_prefixes calls are the rounds one after another, one call per round and vine
    count, of seed row_seed(seed, round, n), its states in order, rows keyed by their place in the call."""
    from ablations.adaptive_k import round_sizes, vine_rewards
    from values import mc_rollouts
    p = {0: 0.0, 1: 0.5, 2: 1.0, 3: 0.3, 4: 0.6}
    lens = [2, 3, 4, 5, 6, 3, 4]  # prefix lengths (the prompt is 2 tokens); two pairs of states share a prefix
    sequences, rule = [[7, 7, 0, 1, 2, 3, 9]] * len(lens), dict(K=9, k_round=3, k_max=15, k_ci=0.45)
    common = dict(sequences=sequences, prefix_lens=lens, prompt_lens=[2] * len(lens), answers=["1"] * len(lens),
                  grader="gsm8k", temperature=0.6, top_p=0.9, max_new_tokens=10, seed=11)
    reference, keyed = [[] for _ in lens], KeyedSampler(p, order=0)
    for round_ in range(100):  # the rounds one after another, each row keyed (state, round, vine)
        for i, n in enumerate(round_sizes(reference, k_mode=k_mode, **rule)):
            reference[i] += [float(keyed.vine(L, row_seed(11, round_, n), i * n + j).text == "#### 1")
                             for L in [lens[i]] for j in range(n)]
    assert len({len(r) for r in reference}) > 1 or k_mode == "fixed"  # states got different numbers of vines
    for order in (1, 2):
        sampler = KeyedSampler(p, order=order)
        rewards, tokens = vine_rewards(sampler=sampler, k_mode=k_mode, **rule, **common)
        assert rewards == reference and tokens == 2 * sum(map(len, reference))
        rounds = [tag for _, tag in sampler.answered]
        later_first = any(a > b for a, b in zip(rounds, rounds[1:]))  # a later round answered before an earlier one
        assert later_first == (k_mode in ("adaptive", "official")), rounds
    if k_mode == "fixed":
        today, _ = mc_rollouts(sampler=KeyedSampler(p, order=0), K=9, **{**common, "seed": row_seed(11, 0, 9)})
        assert rewards == today
    calls, in_calls = KeyedSampler(p, order=0), [[] for _ in lens]  # the rounds one after another, a call per n
    for round_ in range(100):
        sizes = round_sizes(in_calls, k_mode=k_mode, **rule)
        for n in sorted(set(sizes) - {0}):
            idx = [i for i, size in enumerate(sizes) if size == n]
            part = {key: [common[key][i] for i in idx] for key in ("sequences", "prefix_lens", "prompt_lens", "answers")}
            scores, _ = mc_rollouts(sampler=calls, K=n, **{**common, **part, "seed": row_seed(11, round_, n)})
            for i, sc in zip(idx, scores):
                in_calls[i] += sc
    waves = KeyedInWaves(p, order=0)
    rewards, tokens = vine_rewards(sampler=waves, k_mode=k_mode, **rule, **common)
    assert waves.calls == calls.calls and rewards == in_calls and tokens == 2 * sum(map(len, in_calls))
    assert len(waves.calls) > 1 or k_mode == "fixed"
    if k_mode == "fixed":
        assert in_calls == reference
