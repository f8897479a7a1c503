"""Rewards: grade a model's response against the gold answer, 1.0 or 0.0.

Public API (external checks call these names):
    grade_gsm8k(response, answer, *, truncated=False) -> float
    grade_math(response, answer, *, truncated=False) -> float
    grade(response, answer, *, grader, truncated=False) -> float    # dispatch by data set or grader name
    grade_vines(samples, *, sequence, prefix_len, ...) -> [float]  # a state's vines, each as a whole response
Diagnostics (sft.py logs them for worked solutions such as arith's): first_wrong_line, wrong_line_counts.

Rules (see README and ../shared/notes/vineppo-reference.md):
- A response stopped by the length limit (`truncated=True`) scores 0 whatever it contains.
- A response with no final-answer marker is unfinished and scores 0.
- GSM8K: the final answer is the text after the last "####"; failing that, the last \\boxed{...}; failing that,
  the last "answer is X". It is compared with the gold answer as an exact number (commas, "$" and trailing zeros
  are tolerated; 180 or 1.8 against 18 is wrong).
- MATH: the final answer is the last \\boxed{...} (or \\fbox{...}) with balanced braces; failing that, "final answer
  is $...$". Equivalence is decided by math-verify (`parse` + `verify`).

Model text is untrusted: nothing here evaluates it as code and every scan is linear in its length. The symbolic
check runs in a forked worker process that is killed if a call takes more than GRADE_TIMEOUT_S seconds in all;
such a call scores 0. Neither function ever raises.
"""
import logging
import multiprocessing
import re
import threading
import time
from fractions import Fraction
from functools import lru_cache

from math_verify import LatexExtractionConfig, parse, verify

logging.getLogger("math_verify").setLevel(logging.ERROR)  # we bound time ourselves; silence its warning

GRADE_TIMEOUT_S = 0.9  # leaves room for killing the worker inside a 1 s bound
MAX_ANSWER_CHARS = 1000  # a "final answer" longer than this is not an answer; skips pathological sympy work

# A number: optional sign, digits with optional thousands commas ("1,234"), optional decimals, or a fraction a/b.
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?|-?\.\d+")


# ---------------------------------------------------------------------------------------------------------------
# Extraction: find the final answer in a response (pure string scans, linear time)
# ---------------------------------------------------------------------------------------------------------------
def extract_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} or \\fbox{...}, with balanced braces; None if absent or unbalanced."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = start + (len("\\boxed") if text.startswith("\\boxed", start) else len("\\fbox"))
    if text.startswith(" ", i):  # "\boxed 5" (DeepSeekMath style): up to the next "$" or white space
        words = text[i:i + MAX_ANSWER_CHARS].split("$")[0].split()
        return words[0] if words else None
    if i >= len(text) or text[i] != "{":
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1:j]
    return None  # unbalanced: the response was cut inside its answer


def extract_after_marker(text: str, marker: str) -> str | None:
    """The text after the last occurrence of `marker` (case-insensitive), or None."""
    i = text.lower().rfind(marker)
    return None if i < 0 else text[i + len(marker):]


def extract_gsm8k_answer(text: str) -> str | None:
    """The final-answer text of a GSM8K-style response: after "####", else \\boxed{}, else "answer is"."""
    for candidate in (extract_after_marker(text, "####"), extract_boxed(text),
                      extract_after_marker(text, "answer is")):
        if candidate is not None and parse_number(candidate) is not None:
            return candidate
    return None


def extract_math_answer(text: str) -> str | None:
    """The final answer of a MATH-style response: last \\boxed{}, else "final answer is $...$"."""
    boxed = extract_boxed(text)
    if boxed is not None:
        return boxed
    after = extract_after_marker(text, "final answer is")
    if after is None:
        return None
    parts = after.lstrip(" :").split("$")  # "$x$" -> ["", "x", ...]; "$$x$$" -> ["", "", "x", ...]
    inner = [p for p in parts[1:4] if p.strip()]
    return inner[0] if parts[0].strip() == "" and inner else None


# ---------------------------------------------------------------------------------------------------------------
# Comparison
# ---------------------------------------------------------------------------------------------------------------
def parse_number(text: str) -> Fraction | None:
    """The first number in `text` (at most 100 characters in), exactly, as a Fraction; None if there is none."""
    cleaned = text[:100].replace("\\$", "$").replace("\\!", "").replace("{,}", ",")
    frac = re.search(r"\\d?frac\{(-?\d+)\}\{(\d+)\}", cleaned)
    match = _NUMBER.search(cleaned)
    if frac and (match is None or frac.start() <= match.start()):
        return Fraction(int(frac.group(1)), int(frac.group(2))) if int(frac.group(2)) else None
    if match is None:
        return None
    num, _, den = match.group(0).replace(",", "").partition("/")
    if den and int(den) == 0:
        return None
    return Fraction(num) / (Fraction(den) if den else 1)


def normalize_latex(text: str) -> str:
    """A light string normalisation used as a fast exact-match check before math-verify."""
    for old, new in (("\\left", ""), ("\\right", ""), ("\\!", ""), ("\\,", ""), ("\\;", ""), ("dfrac", "frac"),
                     ("tfrac", "frac"), ("^\\circ", ""), ("^{\\circ}", ""), ("\\%", ""), ("$", "")):
        text = text.replace(old, new)
    text = re.sub(r"\\text\{\s*([^{}]*?)\s*\}", r"\1", text)
    return "".join(text.split()).rstrip(".")


@lru_cache(maxsize=8192)
def parse_gold_math(answer: str) -> tuple:
    """math-verify's parse of a gold answer, cached (gold answers repeat across samples)."""
    return tuple(parse("\\boxed{" + answer + "}", extraction_config=[LatexExtractionConfig()], parsing_timeout=None))


def math_equal(pred: str, answer: str) -> bool:
    """Is the extracted answer `pred` equivalent to the gold `answer`, by math-verify? Unbounded: see run_bounded."""
    gold = list(parse_gold_math(answer))
    target = parse("\\boxed{" + pred + "}", extraction_config=[LatexExtractionConfig()], parsing_timeout=None)
    return bool(gold and target and verify(gold, target, timeout_seconds=None))


# ---------------------------------------------------------------------------------------------------------------
# Time bound. sympy can spend minutes inside C code (e.g. 9^{9^{9^{9}}}) where no signal reaches it, so the
# symbolic check runs in a worker process that is killed when it runs out of time, and restarted on the next call.
# ---------------------------------------------------------------------------------------------------------------
_worker = None  # (process, connection) of the running worker, or None
_worker_lock = threading.Lock()


def worker_loop(conn):
    """Body of the worker process: answer (fn, args) requests with fn(*args), or False if it raises."""
    while True:
        fn, args = conn.recv()
        try:
            conn.send(bool(fn(*args)))
        except Exception:
            conn.send(False)


def start_worker():
    """Fork a worker. Forked, it starts in milliseconds with math-verify already warm (see the end of this file)."""
    ctx = multiprocessing.get_context("fork")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=worker_loop, args=(theirs,), daemon=True)
    proc.start()
    return proc, ours


def run_bounded(fn, *args, seconds: float = GRADE_TIMEOUT_S) -> bool:
    """fn(*args) in the worker process; False if it raises or the call takes longer than `seconds` in all."""
    global _worker
    deadline = time.monotonic() + seconds
    with _worker_lock:
        try:
            if _worker is None or not _worker[0].is_alive():
                _worker = start_worker()
            proc, conn = _worker
            conn.send((fn, args))
            if conn.poll(max(0.0, deadline - time.monotonic())):
                return conn.recv()
            proc.kill()  # out of time: the worker may be stuck in C code, so it goes; the next call forks another
            proc.join()
            _worker = None
            return False
        except Exception:  # a dead or broken worker: drop it, and this answer is "not shown equal"
            _worker = None
            return False


# ---------------------------------------------------------------------------------------------------------------
# Public graders
# ---------------------------------------------------------------------------------------------------------------
def _gsm8k_correct(response: str, answer: str) -> bool:
    pred = extract_gsm8k_answer(response)
    gold = parse_number(answer)
    return pred is not None and gold is not None and parse_number(pred) == gold


def _math_correct(response: str, answer: str) -> bool:
    pred = extract_math_answer(response)
    if pred is None or not 0 < len(pred.strip()) <= MAX_ANSWER_CHARS:
        return False
    return normalize_latex(pred) == normalize_latex(answer) or run_bounded(math_equal, pred, answer)


def grade_gsm8k(response: str, answer: str, *, truncated: bool = False) -> float:
    """1.0 if the response's final number equals the gold number, else 0.0. Never raises."""
    if truncated or not isinstance(response, str) or not isinstance(answer, str):
        return 0.0
    try:
        return 1.0 if _gsm8k_correct(response, answer) else 0.0
    except Exception:  # pure string and Fraction work; nothing should raise, but the contract is "never raises"
        return 0.0


def grade_math(response: str, answer: str, *, truncated: bool = False) -> float:
    """1.0 if the response's final answer is equivalent to the gold answer (math-verify), else 0.0. Never raises."""
    if truncated or not isinstance(response, str) or not isinstance(answer, str):
        return 0.0
    try:
        return 1.0 if _math_correct(response, answer) else 0.0
    except Exception:
        return 0.0


def grader_of(dataset: str) -> str:
    """The grader of a data set: "math" for math; "number" (grade_gsm8k) for gsm8k and arith. A grader's own name
    (number, math) maps to itself, so `dataset` may be either."""
    return "math" if dataset == "math" else "number"


def is_number(text: str) -> bool:
    """Is `text`, stripped, one plain number ("1,234", "-5", "0.5", "3/4") and nothing else?"""
    return _NUMBER.fullmatch(text.strip()) is not None


def grade(response: str, answer: str, *, grader: str, truncated: bool = False) -> float:
    """Grade with the rule of `grader`: a data set's (gsm8k, arith, math) or a grader's (--grader number, math); "math" uses
    grade_math; everything else uses grade_gsm8k."""
    fn = grade_math if grader_of(grader) == "math" else grade_gsm8k
    return fn(response, answer, truncated=truncated)


def grade_vines(samples, *, sequence, prefix_len: int, prompt_len: int, answer: str, grader: str,
                tokenizer) -> list[float]:
    """The 0/1 rewards of a state's vines (values.py), each graded as a whole response: the state's response tokens
    (sequence[prompt_len:prefix_len]) + the vine; a vine cut by the length limit scores 0."""
    texts = tokenizer.batch_decode([sequence[prompt_len:prefix_len] + v.token_ids for v in samples],
                                   skip_special_tokens=True)
    return [grade(text, answer, grader=grader, truncated=not v.finished) for text, v in zip(texts, samples)]


def first_wrong_line(response: str, solution: str) -> int:
    """Where a response first leaves the gold worked solution: the 1-based number of its first line (blank lines
    skipped, spaces normalised) that differs from the gold solution's line there, or that is missing; 0 if every line
    matches. For arith, whose solution is one operation per line, this is the step of the first arithmetic (or
    copying) error; the last line is the "#### N" answer."""
    ours = [" ".join(line.split()) for line in response.strip().splitlines() if line.strip()]
    gold = [" ".join(line.split()) for line in solution.strip().splitlines() if line.strip()]
    for i, line in enumerate(gold):
        if i >= len(ours) or ours[i] != line:
            return i + 1
    return 0


def wrong_line_counts(graded: list[tuple[dict, object, float]]) -> dict[str, int]:
    """How many wrong samples first leave the gold solution at each line: {"1": n1, "2": n2, ...} (rollout.evaluate's
    `keep` triples). A wrong sample whose lines all match the gold (only possible if it goes on after them) is
    counted under "after"."""
    counts = {}
    for example, sample, correct in graded:
        if not correct:
            line = first_wrong_line(sample.text, example["solution"])
            key = str(line) if line else "after"
            counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: (kv[0] == "after", int(kv[0]) if kv[0].isdigit() else 0)))


# math-verify builds its LaTeX parser on first use (~0.1 s). Do it once at import, so that forked workers start warm
# and no call's time bound is spent on it.
parse_gold_math("\\frac{1}{2}")
