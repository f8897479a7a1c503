"""Datasets and prompts: each example becomes (prompt question, gold answer).

gsm8k, math: the real data sets. Sources, in order:
  - a local folder (`--data-dir DIR` or $VINEPPO_DATA_DIR) holding DIR/<dataset>/<split>.jsonl (the fields below);
  - else the copy shipped in this repository, data/<dataset>/<split>.jsonl.gz, each file checked against
    data/SHA256SUMS (see data/README.md: provenance, licences), with no network call:
        gsm8k: GSM8K train 7,473 / test 1,319; gold = the number after "####".
        math:  train = the 4,500 MATH test problems not in MATH-500 (the part of Lightman et al.'s 12k train split
               that comes from MATH's test set; NOT the original 7,500 MATH train problems); test = MATH-500;
               gold = the `answer` field, or the last \\boxed{} of the solution;
  - `--data-dir hub`: the Hugging Face Hub through `datasets`, when its host answers within 3 s (checked once, no
    retries; HF_HUB_OFFLINE=1 skips it), kept in $VINEPPO_CACHE/data (default ~/.cache/vineppo/data) for later runs:
        gsm8k: openai/gsm8k "main" (the same rows as the shipped copy).
        math:  train = EleutherAI/hendrycks_math (the original 7,500 train problems, all subjects: different
               problems from the shipped train split); test = HuggingFaceH4/MATH-500 (the same 500).
arith: procedurally generated multi-step arithmetic word problems (a task the 135M model can learn on a CPU), with
fixed train/test splits from a seed; "#### <number>" answers graded like GSM8K.
Your own data: a folder with train.jsonl and test.jsonl, one {"question": ..., "answer": <final answer>} per line
("solution" optional), passed as `--dataset FOLDER`.
"""
import gzip
import hashlib
import json
import os
import random
from functools import partial
from pathlib import Path

from grader import extract_boxed, grader_of
from model import cache_dir, hub_reachable

DATASETS = ("gsm8k", "math", "arith", "chain")
SPLITS = ("train", "test")
SHIPPED = Path(__file__).resolve().parent / "data"  # the copies shipped with the code (data/README.md)
MATH_SUBJECTS = ("algebra", "counting_and_probability", "geometry", "intermediate_algebra", "number_theory",
                 "prealgebra", "precalculus")

CHAT_INSTRUCTION = {  # by grader: how the final answer must be written for it to be found
    "number": "Solve the problem step by step. Write one step per line. "
              "On the last line write the final answer as '#### <number>'.",
    "math": "Solve the problem step by step. Write one step per line. "
            "Put the final answer in \\boxed{...} on the last line.",
}
FIELDS = {"gsm8k": ("question", "answer"), "math": ("problem", "answer", "solution", "level", "type", "subject")}
SFT_TEMPLATE = "[MATH_TASK] Problem:\n{question}\n\nSolution:"  # the paper's SFT checkpoints were trained on this


def task_of(dataset: str) -> str:
    """What `--dataset` names: one of DATASETS, or "custom" (a folder of your own; see dataset_problem)."""
    return dataset if dataset in DATASETS else "custom"


def dataset_problem(dataset: str) -> str | None:
    """Why `--dataset` names neither a built-in data set nor a folder holding train.jsonl and test.jsonl, or None."""
    if dataset in DATASETS:
        return None
    folder = Path(dataset).expanduser()
    if not folder.is_dir():
        return f"not {', '.join(DATASETS)}, nor a folder holding train.jsonl and test.jsonl"
    missing = [f"{split}.jsonl" for split in SPLITS if not (folder / f"{split}.jsonl").is_file()]
    return f"no {' and no '.join(missing)} in that folder" if missing else None


def gold_answer(row: dict, *, dataset: str) -> str | None:
    """The gold final answer of a raw row: after '####' (gsm8k); `answer`, else the last \\boxed{} (math);
    `answer` as it is, a string or a number (custom)."""
    if dataset == "gsm8k":
        text = row.get("answer")
        return text.split("####")[-1].strip() if isinstance(text, str) and "####" in text else None
    if dataset == "custom":
        answer = row.get("answer")
        return str(answer) if isinstance(answer, (int, float)) and not isinstance(answer, bool) else answer
    return row.get("answer") or extract_boxed(row.get("solution", ""))


def to_example(row: dict, *, dataset: str, where: str) -> dict:
    """A raw row -> {"question", "answer", "solution", "where"}; a one-line error naming `where` (file:line) if it
    is malformed."""
    question = row.get("problem" if dataset == "math" else "question") if isinstance(row, dict) else None
    answer = gold_answer(row, dataset=dataset) if isinstance(row, dict) and isinstance(question, str) else None
    solution = (row.get("answer") if dataset == "gsm8k" else row.get("solution", "")) if isinstance(row, dict) else ""
    if not isinstance(question, str) or not question.strip() or not isinstance(answer, str) or not answer.strip() \
            or not isinstance(solution, (str, type(None))):
        fields = {"gsm8k": '"question" and "answer" ending in "#### <number>"',
                  "math": '"problem" and "answer", or a "solution" with \\boxed{}',
                  "custom": '"question" and "answer" (the final answer), "solution" optional'}[dataset]
        raise SystemExit(f"error: {where}: malformed {dataset} row (expected {fields})")
    return {"question": question, "answer": answer.strip(), "solution": solution or "", "where": where}


def read_jsonl(path: Path, *, dataset: str) -> list[dict]:
    """Examples of a local .jsonl (or .jsonl.gz) file; a malformed line stops with `file:line`."""
    examples = []
    with (gzip.open if path.suffix == ".gz" else open)(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise SystemExit(f"error: {path}:{number}: not UTF-8 text (byte {raw[e.start]:#04x} at column "
                                 f"{e.start + 1})") from None
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


def shipped_file(dataset: str, split: str) -> Path:
    """data/<dataset>/<split>.jsonl.gz, its bytes checked against data/SHA256SUMS; a one-line error naming the file
    if it is missing or damaged."""
    path, name = SHIPPED / dataset / f"{split}.jsonl.gz", f"{dataset}/{split}.jsonl.gz"
    listing = SHIPPED / "SHA256SUMS"
    lines = listing.read_text().splitlines() if listing.is_file() else []
    sums = {file: digest for digest, file in (line.split() for line in lines if line.strip())}
    if not path.is_file():
        raise SystemExit(f"error: {path}: missing from this checkout (git checkout -- data restores the shipped "
                         f"copy; or pass --data-dir DIR holding {dataset}/{split}.jsonl)")
    if hashlib.sha256(path.read_bytes()).hexdigest() != sums.get(name):
        raise SystemExit(f"error: {path}: checksum mismatch with {listing}: the shipped copy is "
                         f"damaged (git checkout -- data restores it; or pass --data-dir DIR)")
    return path


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


def hub_split(dataset: str, split: str) -> list[dict]:
    """`--data-dir hub`: the Hub's rows, downloaded once into $VINEPPO_CACHE/data and read from there after."""
    cached = cache_dir() / "data" / dataset / f"{split}.jsonl"
    if not cached.is_file():
        if not hub_reachable():
            raise SystemExit(f"error: {dataset}/{split}: --data-dir hub, but the Hugging Face Hub is unreachable; "
                             f"drop --data-dir for the shipped copy, or pass --data-dir DIR holding "
                             f"{dataset}/{split}.jsonl (docs/data-and-model.md)")
        try:
            rows = hub_rows(dataset=dataset, split=split)
        except Exception as e:  # no `datasets`, a moved repository, a dropped connection: all end the same way
            raise SystemExit(f"error: could not load {dataset}/{split} from the Hub ({type(e).__name__}); drop "
                             f"--data-dir for the shipped copy, or pass --data-dir DIR holding {dataset}/{split}.jsonl "
                             f"(docs/data-and-model.md)") from None
        for i, row in enumerate(rows):  # every row checked before any is cached
            to_example(row, dataset=dataset, where=f"hub:{dataset}/{split}[{i}]")
        write_cache(cached, [{field: row[field] for field in FIELDS[dataset] if field in row} for row in rows])
    return read_jsonl(cached, dataset=dataset)


def load_split(dataset: str, split: str, *, data_dir: str | None = None, arith_ops: int = 1,
               arith_max: int = 20, arith_size: int = 5000, chain_filler: int = 0, chain_bug: str = "none",
               chain_bug_rate: float = 0.0) -> list[dict]:
    """Examples ({"question", "answer", "solution"}) of one split. gsm8k, math: from `data_dir` (or
    $VINEPPO_DATA_DIR) if given, "hub" meaning the Hub, else the shipped copy. A folder of your own: its
    <split>.jsonl. arith, chain: generated (the test split is the first 500 problems of its own seed that are not in
    train; the validation split, the first 500 of a third seed in neither). chain_bug: the train split's solutions
    only (the SFT demonstrations); the other splits' stay right."""
    problem = dataset_problem(dataset)
    if problem or split not in SPLITS and not (split == "validation" and dataset in ("arith", "chain")):
        raise SystemExit(f"error: --dataset {dataset}: {problem}" if problem else
                         f"error: unknown split {split} of {dataset} (choose from {SPLITS}; validation: arith and "
                         f"chain only)")
    if dataset in ("arith", "chain"):
        make = make_arith if dataset == "arith" else partial(make_chain, filler=chain_filler)
        rows = train = make(arith_size, seed=0, ops=arith_ops, max_number=arith_max)
        if split == "train" and chain_bug != "none":  # the same problems, a buggy solver's demonstrations
            rows = make_chain(arith_size, seed=0, ops=arith_ops, max_number=arith_max, filler=chain_filler,
                              bug=chain_bug, bug_rate=chain_bug_rate)
        if split in ("test", "validation"):  # validation: sft.py's --stop-at, never the test problems
            seen = {e["question"] for e in train}
            test = [e for e in make(4 * 500, seed=1, ops=arith_ops, max_number=arith_max)
                    if e["question"] not in seen][:500]
            seen |= {e["question"] for e in test}
            rows = test if split == "test" else [e for e in make(4 * 500, seed=2, ops=arith_ops, max_number=arith_max)
                                                 if e["question"] not in seen][:500]
        fill = f" --chain-filler {chain_filler}" if chain_filler else ""
        fill += f" --chain-bug {chain_bug}" if split == "train" and chain_bug != "none" else ""
        return [{**e, "where": f"--dataset {dataset} --arith-ops {arith_ops}{fill}: {split} problem {i + 1}"}
                for i, e in enumerate(rows)]
    if task_of(dataset) == "custom":
        return read_jsonl(Path(dataset).expanduser() / f"{split}.jsonl", dataset="custom")
    data_dir = data_dir or os.environ.get("VINEPPO_DATA_DIR")
    if not data_dir:
        return read_jsonl(shipped_file(dataset, split), dataset=dataset)
    if data_dir == "hub":
        return hub_split(dataset, split)
    return read_jsonl(find_local_file(data_dir, dataset=dataset, split=split), dataset=dataset)


def load_splits(dataset: str, *, data_dir: str | None, arith_ops: int, arith_max: int, eval_size: int,
                chain_filler: int = 0, chain_bug: str = "none",
                chain_bug_rate: float = 0.0) -> tuple[list[dict], list[dict]]:
    """(the train split, the first eval_size problems of the test split): what train.py and sft.py work on."""
    train, test = (load_split(dataset, split, data_dir=data_dir, arith_ops=arith_ops, arith_max=arith_max,
                              chain_filler=chain_filler, chain_bug=chain_bug, chain_bug_rate=chain_bug_rate)
                   for split in ("train", "test"))
    return train, test[:eval_size]


def write_cache(path: Path, rows: list[dict]):
    """The Hub's rows as .jsonl, written atomically, so that later runs need no network."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    os.replace(tmp, path)


def make_prompt(question: str, *, grader: str, tokenizer, prompt_format: str = "chat") -> str:
    """The prompt text. "chat": the model's chat template asking for one step per line and the final answer the way
    the grader finds it (`grader`: a data set's name, or a grader's: number, math); "sft": the paper's plain
    template for its SFT checkpoints; "plain": the question as it is and a newline (the from-scratch testbed)."""
    if prompt_format == "plain":
        return question + "\n"
    if prompt_format == "sft" or getattr(tokenizer, "chat_template", None) is None:
        return SFT_TEMPLATE.format(question=question)
    message = f"{CHAT_INSTRUCTION[grader_of(grader)]}\n\nProblem: {question}"
    return tokenizer.apply_chat_template([{"role": "user", "content": message}], tokenize=False,
                                         add_generation_prompt=True)


def unknown_chars(tokenizer, chars: set[str]) -> list[str]:
    """The characters of `chars` that `tokenizer` turns into its unknown token (none for byte-level tokenizers)."""
    if tokenizer.unk_token_id is None or not chars:
        return []
    chars = sorted(chars)
    ids = tokenizer(chars, add_special_tokens=False).input_ids
    return [c for c, row in zip(chars, ids) if tokenizer.unk_token_id in row]


def input_problem(tokenizer, *, examples: list[dict], prompt_format: str, grader: str, max_new_tokens: int,
                  max_positions: int | None) -> str | None:
    """What the model cannot take of this run's inputs, in one line (None if nothing): a prompt format whose template
    holds characters its tokenizer turns into <unk> (e.g. a character tokenizer and the chat or sft format); a
    question, solution or answer holding such characters (named, with the first row's file:line); the longest prompt
    plus max_new_tokens past the model's max_positions."""
    template = make_prompt("", grader=grader, tokenizer=tokenizer, prompt_format=prompt_format)
    if bad := unknown_chars(tokenizer, set(template)):
        return (f"--prompt-format {prompt_format}: the model's tokenizer cannot write its characters "
                f"{''.join(bad)!r} (they would be <unk>); a character tokenizer takes the format it was made with")
    texts = ("question", "solution", "answer")
    if bad := unknown_chars(tokenizer, set().union(*(e.get(k, "") for e in examples for k in texts))):
        first = next(e for e in examples if any(c in e.get(k, "") for k in texts for c in bad))
        return (f"{first.get('where', 'the data')}: characters the model's tokenizer cannot write (they would be "
                f"<unk>): {''.join(bad)!r}")
    if max_positions:  # the 32 longest questions in characters stand for the longest in tokens
        longest = sorted(examples, key=lambda e: -len(e["question"]))[:32]
        prompts = [make_prompt(e["question"], grader=grader, tokenizer=tokenizer, prompt_format=prompt_format)
                   for e in longest]
        lengths = [len(ids) for ids in tokenizer(prompts, add_special_tokens=False).input_ids]
        i = max(range(len(lengths)), key=lengths.__getitem__)
        if lengths[i] + max_new_tokens > max_positions:
            return (f"{longest[i].get('where', 'the data')}: its prompt is {lengths[i]} tokens; with "
                    f"--max-new-tokens {max_new_tokens} that is past the model's {max_positions} positions")
    return None


def encode_prompt(question: str, *, grader: str, tokenizer, prompt_format: str = "chat") -> list[int]:
    """The prompt's token ids (the template already holds the special tokens it needs)."""
    return tokenizer(make_prompt(question, grader=grader, tokenizer=tokenizer, prompt_format=prompt_format),
                     add_special_tokens=False).input_ids


FILLER_TAGS = "abcd"  # chain --chain-filler: the free choice of a filler line
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


CHAIN_BUGS = {"none": "", "borrow": "-", "borrow-carry": "-+"}  # --chain-bug: the operations whose lines it bugs


def buggy_result(a: int, op: str, b: int) -> int | None:
    """A solver's consistent bug, or None where it does not apply: a subtraction that needs a borrow done without it
    (each digit the smaller from the larger: 32-17=25), an addition that needs a carry done without it (each digit
    sum mod 10: 38+25=53)."""
    if a < 0 or b < 0 or op not in "+-" or op == "-" and a < b:
        return None
    da, db = str(a)[::-1], str(b)[::-1].ljust(len(str(a)), "0")  # digits, units first
    if op == "-" and all(x >= y for x, y in zip(da, db)) or op == "+" and all(
            int(x) + int(y) < 10 for x, y in zip(da.ljust(len(db), "0"), db)):
        return None  # no borrow (carry) needed: the solver gets it right
    if op == "-":
        return int("".join(str(abs(int(x) - int(y))) for x, y in zip(da, db))[::-1])
    return int("".join(str((int(x) + int(y)) % 10) for x, y in zip(da.ljust(len(db), "0"), db))[::-1])


def bugged_solution(question: str, *, ops: str, rate: float, rng: random.Random) -> str:
    """The chain solution of a solver that applies buggy_result to each line of an operation in `ops` that needs a
    borrow (carry) with probability `rate`, and goes on from what it wrote: the demonstrations of --chain-bug."""
    start, *steps = question.split(" ")
    value, lines = int(start), []
    for step in steps:
        op, b = step[0], int(step[1:])
        right = value + b if op == "+" else value - b if op == "-" else value * b
        wrong = buggy_result(value, op, b) if op in ops else None
        new = wrong if wrong is not None and rng.random() < rate else right
        lines.append(f"{value}{op}{b}={new}")
        value = new
    return "\n".join(lines) + f"\n####{value}"


def make_chain(count: int, *, seed: int, ops: int, max_number: int, filler: int = 0, bug: str = "none",
               bug_rate: float = 0.0) -> list[dict]:
    """make_arith's problems (the same numbers for the same seed) written compactly, for the from-scratch testbed:
    question "13 *3 -3 -30 -4" (the start, then each operation), solution one "a op b = c" line per operation without
    spaces, then "####N": "13*3=39\n39-3=36\n36-30=6\n6-4=2\n####2". filler: that many lines "~x" more, x a tag
    drawn uniformly from FILLER_TAGS that the reward ignores, dealt round-robin into the gaps after the operation
    lines (the first gap first): the horizon grows, the arithmetic does not (the credit issue's filler control).
    bug (a CHAIN_BUGS key): the solutions are a buggy solver's (bugged_solution, at bug_rate), the answers still the
    right ones: demonstrations that SFT cannot see past (the paper-regime tasks, research/paper_regime)."""
    examples, tags, coins = [], random.Random(f"filler {seed}"), random.Random(f"bug {seed}")
    for e in make_arith(count, seed=seed, ops=ops, max_number=max_number):
        steps = [line.split(" ") for line in e["solution"].split("\n")[:-1]]  # ["13", "*", "3", "=", "39"]
        question = " ".join([steps[0][0]] + [op + b for _, op, b, _, _ in steps])
        lines = [[f"{a}{op}{b}={c}"] for a, op, b, _, c in steps]
        for i in range(filler):
            lines[i % ops].append("~" + tags.choice(FILLER_TAGS))
        solution = "\n".join(line for gap in lines for line in gap) + f"\n####{e['answer']}"
        if CHAIN_BUGS[bug]:
            solution = bugged_solution(question, ops=CHAIN_BUGS[bug], rate=bug_rate, rng=coins)
        examples.append({"question": question, "answer": e["answer"], "solution": solution})
    return examples


def task_chars(examples: list[dict]) -> str:
    """Every character the task's questions and gold solutions use."""
    return "".join(sorted({c for e in examples for text in (e["question"], e.get("solution", "")) for c in text}))


def prompt_chars(prompt_format: str, *, grader: str) -> str:
    """Every character a prompt format writes around the question (plain: a newline; sft: the paper's template).
    chat needs the model's chat template, which a character tokenizer does not have."""
    if prompt_format == "chat":
        raise ValueError("a character tokenizer has no chat template")
    return "".join(sorted(set(make_prompt("", grader=grader, tokenizer=None, prompt_format=prompt_format))))
