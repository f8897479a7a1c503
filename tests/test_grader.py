"""Grader cases, written the way models actually answer, plus adversarial strings and the real gold solutions."""
import random
import string
import threading
import time
from types import SimpleNamespace

import pytest

from conftest import shipped_rows
from grader import (extract_boxed, extract_math_answer, first_wrong_line, grade, grade_gsm8k, grade_math, parse_number,
                    wrong_line_counts)

@pytest.mark.parametrize("response, answer, expected", [
    ("She sells 16 - 3 - 4 = 9 eggs.\nShe makes 9 * 2 = $18.\n#### 18", "18", 1.0),
    ("Step 1: 5 + 7 = 12\nStep 2: 12 * 3 = 36\n#### 36", "36", 1.0),
    ("The total is 1,000 + 234 = 1,234 dollars.\n#### 1,234", "1234", 1.0),
    ("#### $18.00", "18", 1.0),
    ("#### 18.", "18", 1.0),
    ("#### 18 dollars", "18", 1.0),
    ("He loses 5 points.\n#### -5", "-5", 1.0),
    ("#### 0.5", "0.5", 1.0),
    ("So half of it is #### 1/2", "0.5", 1.0),
    ("#### 180", "18", 0.0),
    ("#### 1.8", "18", 0.0),
    ("#### 18.01", "18", 0.0),
    ("#### 17\nWait, let me redo this.\n#### 18", "18", 1.0),     # the last marker wins
    ("#### 18\nWait, let me redo this.\n#### 17", "18", 0.0),
    ("So the answer is $\\boxed{42}$.", "42", 1.0),                # no ####: \boxed
    ("So the answer is \\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("Therefore, the answer is 42.", "42", 1.0),                   # no #### and no \boxed: "answer is"
    ("The answer is: $1,200", "1200", 1.0),
    ("She makes 9 * 2 = 18 dollars every day.", "18", 0.0),        # no marker: unfinished
    ("", "18", 0.0),
    ("####", "18", 0.0),
    ("#### eighteen", "18", 0.0),
    ("#### 1,2", "12", 0.0),                                       # not a thousands separator
])
def test_grade_gsm8k(response, answer, expected):
    assert grade_gsm8k(response, answer) == expected


def test_truncated_scores_zero_whatever_it_contains():
    assert grade_gsm8k("#### 18", "18") == 1.0
    assert grade_gsm8k("#### 18", "18", truncated=True) == 0.0
    assert grade_math("$\\boxed{3}$", "3", truncated=True) == 0.0
    assert grade("#### 18", "18", grader="gsm8k", truncated=True) == 0.0


@pytest.mark.parametrize("response, answer, expected", [
    ("We have $r = 3$. So the answer is $\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}$.",
     "\\left( 3, \\frac{\\pi}{2} \\right)", 1.0),
    ("Thus $x = \\boxed{\\dfrac{9}{7}}$.", "\\frac{9}{7}", 1.0),
    ("The probability is $\\boxed{0.5}$.", "\\frac{1}{2}", 1.0),           # decimal vs fraction
    ("The probability is $\\boxed{\\frac12}$.", "\\frac{1}{2}", 1.0),
    ("So the answer is $\\boxed{(3,\\frac{\\pi}{2})}$.", "\\left( 3, \\frac{\\pi}{2} \\right)", 1.0),
    ("The interval is $\\boxed{(-\\infty, 3]}$", "(-\\infty,3]", 1.0),
    ("The interval is $\\boxed{(-\\infty, 3)}$", "(-\\infty,3]", 0.0),
    ("The name is $\\boxed{\\text{Evelyn}}$.", "\\text{Evelyn}", 1.0),
    ("We get $\\boxed{2\\sqrt{2}}$.", "\\sqrt{8}", 1.0),
    ("We get $\\boxed{p - q}$.", "p - q", 1.0),
    ("We get $\\boxed{q - p}$.", "p - q", 0.0),
    ("The sum is $\\boxed{10}$.", "10", 1.0),
    ("The sum is $\\boxed{11}$.", "10", 0.0),
    ("\\fbox{10}", "10", 1.0),
    ("First $\\boxed{7}$, but actually $\\boxed{10}$.", "10", 1.0),   # the last box wins
    ("So the final answer is $\\frac{3}{4}$. I hope it is correct.", "\\frac{3}{4}", 1.0),
    ("So the final answer is $0.75$.", "\\frac34", 1.0),
    ("The answer is 10.", "10", 0.0),                                 # MATH needs \boxed or "final answer is $...$"
    ("The sum is $\\boxed{10", "10", 0.0),                            # cut inside the box
    ("", "10", 0.0),
])
def test_grade_math(response, answer, expected):
    assert grade_math(response, answer) == expected


def test_extract_boxed_balances_braces():
    assert extract_boxed("a \\boxed{\\frac{1}{2}} b") == "\\frac{1}{2}"
    assert extract_boxed("\\boxed{1} and \\boxed{{2}}") == "{2}"
    assert extract_boxed("\\boxed{1") is None
    assert extract_boxed("\\boxed 5$") == "5"
    assert extract_boxed("no box") is None
    assert extract_math_answer("final answer is $$x+1$$") == "x+1"


def test_parse_number():
    assert parse_number(" $1,234.50 per day") == 1234.5
    assert parse_number("-7") == -7
    assert parse_number("\\frac{3}{4}") == 0.75
    assert parse_number("3/0") is None
    assert parse_number("none") is None


ADVERSARIAL = [
    "#" * 200_000, "{" * 5000, "}" * 5000, "\\boxed{" + "{" * 5000, "\\boxed{" + "(" * 900 + "}",
    "\\boxed{9^{9^{9^{9^{9}}}}}", "\\boxed{(10^{100})!}", "\\boxed{100!!!!!!}", "#### " + "9" * 100_000,
    "answer is " * 20_000, "\\boxed " + "x" * 100_000, "$" * 10_000, "\\boxed{" + "\\frac{1}{" * 300 + "}" * 301,
    "\x00\ud800\uffff", "#### 1e999999", "\\boxed{" + "1+" * 400 + "1}",
]


@pytest.mark.parametrize("text", ADVERSARIAL, ids=range(len(ADVERSARIAL)))
def test_adversarial_inputs_never_raise_or_hang(text):
    for fn, answer in ((grade_gsm8k, "18"), (grade_math, "3"), (grade_math, text)):
        start = time.monotonic()
        assert fn(text, answer) in (0.0, 1.0)
        assert time.monotonic() - start < 1.5  # the bound is 1 s of work; slack for a loaded CI machine


def test_random_strings_never_raise():
    rng = random.Random(0)
    alphabet = string.printable + "\\{}$#^_"
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 300)))
        assert grade_gsm8k(text, "18") in (0.0, 1.0)
        assert grade_math(text, "\\frac{1}{2}") in (0.0, 1.0)
    assert grade_gsm8k(None, "18") == 0.0  # wrong types too
    assert grade_math(b"\\boxed{3}", "3") == 0.0


def test_bounded_off_the_main_thread():
    result = {}
    def work():
        result["slow"] = grade_math("\\boxed{9^{9^{9^{9^{9}}}}}", "3")
        result["fine"] = grade_math("\\boxed{\\frac12}", "0.5")
    thread = threading.Thread(target=work)
    start = time.monotonic()
    thread.start()
    thread.join(timeout=10)
    assert result == {"slow": 0.0, "fine": 1.0} and time.monotonic() - start < 5


def test_gsm8k_gold_solutions_grade_one():
    data = shipped_rows("gsm8k", "test")
    golds = [row["answer"].split("####")[-1].strip() for row in data]
    own = sum(grade_gsm8k(row["answer"], gold) for row, gold in zip(data, golds))
    other = sum(grade_gsm8k(row["answer"], golds[i - 1]) for i, row in enumerate(data) if golds[i - 1] != golds[i])
    assert own == len(data) and other == 0


def test_math500_gold_solutions_grade_one():
    data = shipped_rows("math", "test")
    own = sum(grade_math(row["solution"], row["answer"]) for row in data)
    other = sum(grade_math(row["solution"], data[i - 1]["answer"]) for i, row in enumerate(data))
    assert own == len(data) and other <= 5  # a few neighbours share an answer ("7" and "7", "x=5" and "5")


def test_first_wrong_line_is_where_a_response_leaves_the_gold_solution():
    gold = "7 + 5 = 12\n12 * 2 = 24\n24 - 3 = 21\n#### 21"
    assert first_wrong_line(gold, gold) == 0
    assert first_wrong_line("7 + 5 = 12\n\n12 * 2 =  24\n24 - 3 = 21\n#### 21\n", gold) == 0  # blanks, spaces
    assert first_wrong_line("7 + 5 = 13\n13 * 2 = 26\n26 - 3 = 23\n#### 23", gold) == 1
    assert first_wrong_line("7 + 5 = 12\n12 * 2 = 24\n24 - 3 = 20\n#### 20", gold) == 3
    assert first_wrong_line("7 + 5 = 12\n12 * 2 = 24\n24 - 3 = 21", gold) == 4  # the answer line is missing
    assert first_wrong_line("", gold) == 1
    example = {"solution": gold}
    texts = [gold, "7 + 5 = 13", "7 + 5 = 12\n12 * 2 = 25", "7 + 5 = 12\nx", gold + "\nmore"]
    graded = [(example, SimpleNamespace(text=t), float(t == gold)) for t in texts]  # a sample: only its text is read
    assert wrong_line_counts(graded) == {"1": 1, "2": 2, "after": 1}
