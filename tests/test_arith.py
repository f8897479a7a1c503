"""The arith task: answers recomputed from the question text, fixed splits, and the gold solutions' format."""
import re

import pytest

from data import load_split, make_arith
from grader import grade_gsm8k
from values import split_steps

ADD = r"(?:buys|finds|gets|wins) (\d+) more"
SUB = r"(?:gives away|loses|uses|sells) (\d+)"


def recompute(question: str) -> int:
    """Read the story sentence by sentence and apply each operation (independent of the generator's code)."""
    sentences = re.split(r"(?<=\.) ", question)
    value = int(re.search(r"has (\d+)", sentences[0]).group(1))
    for sentence in sentences[1:-1]:
        if m := re.search(ADD, sentence):
            value += int(m.group(1))
        elif m := re.search(SUB, sentence):
            value -= int(m.group(1))
        elif "doubles" in sentence:
            value *= 2
        elif "triples" in sentence:
            value *= 3
        else:
            raise AssertionError(f"unparsed sentence: {sentence!r}")
    assert sentences[-1].startswith("How many")
    return value


@pytest.mark.parametrize("ops, max_number", [(2, 20), (3, 50), (1, 9)])
def test_answers_match_a_recomputation(ops, max_number):
    for e in make_arith(400, seed=3, ops=ops, max_number=max_number):
        assert int(e["answer"]) == recompute(e["question"]) >= 0
        steps = split_steps(e["solution"], task="arith")
        assert len(steps) == ops and grade_gsm8k(e["solution"], e["answer"]) == 1.0
        for line in e["solution"].splitlines()[:-1]:  # "a op b = c", each line worked correctly
            a, op, b, _, c = line.split()
            assert {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op] == int(c)


def test_splits_are_fixed_and_disjoint():
    train, test = load_split("arith", "train"), load_split("arith", "test")
    assert len(train) == 5000 and len(test) == 500
    assert not {e["question"] for e in test} & {e["question"] for e in train}
    assert load_split("arith", "train") == train  # same seed, same problems
    harder = load_split("arith", "test", arith_ops=3, arith_max=50)
    assert harder != test and all(len(e["solution"].splitlines()) == 4 for e in harder)
