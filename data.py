"""Datasets and prompts: each example becomes (prompt question, gold answer).

arith: procedurally generated multi-step arithmetic word problems (a task the 135M model can learn on a CPU), with
fixed train/test splits from a seed; "#### <number>" answers graded like GSM8K.

Sources, in order: a local folder (`--data-dir DIR` or $VINEPPO_DATA_DIR) holding DIR/<dataset>/<split>.jsonl; the
copy a first Hub download left in $VINEPPO_CACHE/data (default ~/.cache/vineppo/data); the Hugging Face Hub through
`datasets`, when its host answers within 3 s (checked once, no retries; HF_HUB_OFFLINE=1 skips it):
    gsm8k: openai/gsm8k "main" (train 7,473 / test 1,319); gold = the number after "####".
    math:  train = EleutherAI/hendrycks_math (7,500, all subjects); test = HuggingFaceH4/MATH-500;
           gold = the `answer` field, or the last \\boxed{} of the solution.
The local files use the same fields as the Hub rows (see ../shared/data/README.md).
"""
import json
import os
import random
from pathlib import Path

from grader import extract_boxed
from model import cache_dir, hub_reachable

DATASETS = ("gsm8k", "math", "arith")
SPLITS = ("train", "test")
MATH_SUBJECTS = ("algebra", "counting_and_probability", "geometry", "intermediate_algebra", "number_theory",
                 "prealgebra", "precalculus")

CHAT_INSTRUCTION = {
    "gsm8k": "Solve the problem step by step. Write one step per line. "
             "On the last line write the final answer as '#### <number>'.",
    "arith": "Solve the problem step by step. Write one step per line. "
             "On the last line write the final answer as '#### <number>'.",
    "math": "Solve the problem step by step. Write one step per line. "
            "Put the final answer in \\boxed{...} on the last line.",
}
FIELDS = {"gsm8k": ("question", "answer"), "math": ("problem", "answer", "solution", "level", "type", "subject")}
SFT_TEMPLATE = "[MATH_TASK] Problem:\n{question}\n\nSolution:"  # the paper's SFT checkpoints were trained on this


def gold_answer(row: dict, *, dataset: str) -> str | None:
    """The gold final answer of a raw row: after '####' (gsm8k); `answer`, else the last \\boxed{} (math)."""
    if dataset == "gsm8k":
        return row["answer"].split("####")[-1].strip() if "####" in row.get("answer", "") else None
    return row.get("answer") or extract_boxed(row.get("solution", ""))


def to_example(row: dict, *, dataset: str, where: str) -> dict:
    """A raw row -> {"question", "answer", "solution"}; a one-line error naming `where` if it is malformed."""
    question = row.get("question" if dataset == "gsm8k" else "problem") if isinstance(row, dict) else None
    answer = gold_answer(row, dataset=dataset) if isinstance(row, dict) and isinstance(question, str) else None
    if not isinstance(question, str) or not isinstance(answer, str) or not answer:
        fields = '"question" and "answer" ending in "#### <number>"' if dataset == "gsm8k" else \
            '"problem" and "answer", or a "solution" with \\boxed{}'
        raise SystemExit(f"error: {where}: malformed {dataset} row (expected {fields})")
    solution = row.get("answer") if dataset == "gsm8k" else row.get("solution", "")
    return {"question": question, "answer": answer, "solution": solution or ""}


def read_jsonl(path: Path, *, dataset: str) -> list[dict]:
    """Examples of a local .jsonl file; a malformed line stops with `file:line`."""
    examples = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise SystemExit(f"error: {path}:{number}: not valid JSON ({e.msg})") from None
            examples.append(to_example(row, dataset=dataset, where=f"{path}:{number}"))
    if not examples:
        raise SystemExit(f"error: {path}: no rows")
    return examples


def find_local_file(data_dir: str, *, dataset: str, split: str) -> Path:
    """DIR/<dataset>/<split>.jsonl, or DIR/<split>.jsonl when DIR is the dataset's own folder."""
    root = Path(data_dir).expanduser()
    for path in (root / dataset / f"{split}.jsonl", root / f"{split}.jsonl"):
        if path.is_file():
            return path
    raise SystemExit(f"error: --data-dir {data_dir}: no {dataset}/{split}.jsonl there "
                     f"(expected {root / dataset / f'{split}.jsonl'})")


def hub_rows(*, dataset: str, split: str) -> list[dict]:
    """Raw rows from the Hugging Face Hub."""
    from datasets import load_dataset  # imported here: loading from a folder needs no `datasets`
    if dataset == "gsm8k":
        return list(load_dataset("openai/gsm8k", "main", split=split))
    if split == "test":
        return list(load_dataset("HuggingFaceH4/MATH-500", split="test"))
    return [row for subject in MATH_SUBJECTS for row in load_dataset("EleutherAI/hendrycks_math", subject, split="train")]


def load_split(dataset: str, split: str, *, data_dir: str | None = None, arith_ops: int = 1,
               arith_max: int = 20, arith_size: int = 5000) -> list[dict]:
    """Examples ({"question", "answer", "solution"}) of one split: from a local folder if given, else the Hub
    (arith: generated; the test split is the first 500 problems of its own seed that are not in train)."""
    if dataset not in DATASETS or split not in SPLITS:
        raise SystemExit(f"error: unknown dataset/split {dataset}/{split} (choose from {DATASETS} x {SPLITS})")
    if dataset == "arith":
        train = make_arith(arith_size, seed=0, ops=arith_ops, max_number=arith_max)
        if split == "train":
            return train
        seen = {e["question"] for e in train}
        return [e for e in make_arith(4 * 500, seed=1, ops=arith_ops, max_number=arith_max)
                if e["question"] not in seen][:500]
    data_dir = data_dir or os.environ.get("VINEPPO_DATA_DIR")
    if data_dir:
        return read_jsonl(find_local_file(data_dir, dataset=dataset, split=split), dataset=dataset)
    cached = cache_dir() / "data" / dataset / f"{split}.jsonl"
    if not cached.is_file():
        if not hub_reachable():
            raise SystemExit(f"error: {dataset}/{split}: the Hugging Face Hub is unreachable and no data folder was "
                             f"given; pass --data-dir DIR holding {dataset}/{split}.jsonl (README: Data)")
        try:
            rows = hub_rows(dataset=dataset, split=split)
        except Exception as e:  # no `datasets`, a moved repository, a dropped connection: all end the same way
            raise SystemExit(f"error: could not load {dataset}/{split} from the Hub ({type(e).__name__}); pass "
                             f"--data-dir DIR holding {dataset}/{split}.jsonl (README: Data)") from None
        for i, row in enumerate(rows):  # every row checked before any is cached
            to_example(row, dataset=dataset, where=f"hub:{dataset}/{split}[{i}]")
        write_cache(cached, [{field: row[field] for field in FIELDS[dataset] if field in row} for row in rows])
    return read_jsonl(cached, dataset=dataset)


def write_cache(path: Path, rows: list[dict]):
    """The Hub's rows as .jsonl, written atomically, so that later runs need no network."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    os.replace(tmp, path)


def make_prompt(question: str, *, dataset: str, tokenizer, prompt_format: str = "chat") -> str:
    """The prompt text. "chat": the model's chat template asking for one step per line and a final-answer marker;
    "sft": the paper's plain template for its SFT checkpoints."""
    if prompt_format == "sft" or getattr(tokenizer, "chat_template", None) is None:
        return SFT_TEMPLATE.format(question=question)
    message = f"{CHAT_INSTRUCTION[dataset]}\n\nProblem: {question}"
    return tokenizer.apply_chat_template([{"role": "user", "content": message}], tokenize=False,
                                         add_generation_prompt=True)


def encode_prompt(question: str, *, dataset: str, tokenizer, prompt_format: str = "chat") -> list[int]:
    """The prompt's token ids (the template already holds the special tokens it needs)."""
    return tokenizer(make_prompt(question, dataset=dataset, tokenizer=tokenizer, prompt_format=prompt_format),
                     add_special_tokens=False).input_ids


NAMES = ("Tom", "Anna", "Ben", "Lily", "Sam", "Maya", "Omar", "Nina", "Leo", "Zoe", "Ravi", "Emma")
ITEMS = ("apples", "marbles", "stickers", "coins", "books", "cookies", "pencils", "shells", "cards", "stamps")


def arith_step(rng, value: int, *, max_number: int, item: str, pronoun: str) -> tuple[str, str, int]:
    """One operation on the running value: (sentence, worked step "a op b = c", new value). Stays non-negative."""
    kind = rng.choice(["add", "sub", "mul"] if value <= max_number else ["add", "sub"])
    if kind == "sub" and value >= 2:
        b = rng.randint(1, value - 1)
        verb = rng.choice(["gives away", "loses", "uses", "sells"])
        return f"{pronoun} {verb} {b} {item}.", f"{value} - {b} = {value - b}", value - b
    if kind == "mul":
        k = rng.choice([2, 3])
        return (f"Then {pronoun.lower()} {'doubles' if k == 2 else 'triples'} the number of {item}.",
                f"{value} * {k} = {value * k}", value * k)
    b = rng.randint(2, max_number)
    verb = rng.choice(["buys", "finds", "gets", "wins"])
    return f"{pronoun} {verb} {b} more {item}.", f"{value} + {b} = {value + b}", value + b


def make_arith(count: int, *, seed: int, ops: int, max_number: int) -> list[dict]:
    """`count` word problems of `ops` operations (add, subtract, double/triple) on numbers up to `max_number`.
    The gold solution has one worked step per line and ends with "#### <answer>"."""
    rng = random.Random(seed)
    examples = []
    for _ in range(count):
        name, item = rng.choice(NAMES), rng.choice(ITEMS)
        pronoun = "She" if name in ("Anna", "Lily", "Maya", "Nina", "Zoe", "Emma") else "He"
        value = rng.randint(2, max_number)
        sentences, steps = [f"{name} has {value} {item}."], []
        for _ in range(ops):
            sentence, step, value = arith_step(rng, value, max_number=max_number, item=item, pronoun=pronoun)
            sentences.append(sentence)
            steps.append(step)
        question = " ".join(sentences) + f" How many {item} does {name} have now?"
        examples.append({"question": question, "answer": str(value),
                         "solution": "\n".join(steps) + f"\n#### {value}"})
    return examples
