"""Where to branch the vines: VinePPO's line boundaries against the rules of its follow-ups, on the testbed.

    python -m research.branching.branching --seeds 0,1,2      the grid (restartable: finished runs are skipped)
    python -m research.branching.branching --redraw           only the summary and the pictures from the finished runs

Every arm is `train.py --estimator vine` with the testbed's settings (research/grid.py SETTINGS, K = 9, from the
testbed's SFT model, made once into TESTBED/sft) and one --step-split rule (values.step_token_starts):
    lines     auto: a state before every line (VinePPO's rule for GSM8K-like text)
    tokens    tokens:10: every 10 tokens (the generic fallback; ~37-token responses: 4 states, as lines give)
    lowprob   lowprob:0.9: before sampled tokens of probability < 0.9 (SPO's cutpoints), at most lines' count
    entropy   entropy:0.2: before the top 20% of tokens by policy entropy (TreeRL's forks), at most lines' count
so that every arm asks for (at most) the same number of states per response x K vines. lowprob finds fewer
cutpoints than lines on this task (about one a response: 2 states x 9 vines), so one more arm,
    lowprob-k18   lowprob:0.9 with K = 18: about the same states per response x K as lines' 4 x 9
separates where the states are from how many vines they get. Identical states are estimated once
(values.estimate_values), so the vines sampled still differ by rule: the budget table reports them.
Runs go to OUT/<rule>-s<seed>; OUT/results.md has the testbed's summary (pass@1 against iterations and minutes,
paired differences to lines) and the budget table. --where prints where each rule cuts the SFT model's responses.
"""
import argparse
from pathlib import Path

from research.grid import OUT as TESTBED
from research.grid import grid_arguments, grid_choices
from research.readout import mean_se
from research.summary import arm_grid

OUT = "runs/branching"  # the default output, ignored by git (the committed grid: --out research/branching/results/branching)
RULES = {"lines": ["--estimator", "vine", "--step-split", "auto"],
         "tokens": ["--estimator", "vine", "--step-split", "tokens:10"],
         "lowprob": ["--estimator", "vine", "--step-split", "lowprob:0.9"],
         "entropy": ["--estimator", "vine", "--step-split", "entropy:0.2"],
         "lowprob-k18": ["--estimator", "vine", "--step-split", "lowprob:0.9", "--k", "18"]}


def budget_table(runs: dict[str, dict[int, list[dict]]]) -> str:
    """Per rule (runs: rule -> seed -> metrics, grid.done_runs), means over iterations then mean +- SE over seeds:
    states per response asked for, distinct states estimated, vines and vine tokens sampled, and seconds of the
    values section, per iteration."""
    keys = ("steps_per_response", "value_states", "vines", "vine_tokens", "seconds_values", "seconds")
    lines = ["| rule | states / response | distinct states | vines | vine tokens | s values | s / iteration |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for rule, by_seed in runs.items():
        trained = [[r for r in records if r["iteration"] > 0] for records in by_seed.values()]
        cells = []
        for key in keys:
            m, se = mean_se([sum(r[key] for r in t) / len(t) for t in trained])
            cells.append(f"{m:.2f} ± {se:.2f}" if m < 10 else f"{m:.0f} ± {se:.0f}")
        lines.append(f"| {rule} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def cut_kind(text: str, t: int) -> str:
    """Where, in a chain response (one character a token), a cut before character t falls: at the start of a line,
    at the first character of a line's result (just after '='), inside a result, in the expression, or in the
    '####' answer line."""
    line_start = text.rfind("\n", 0, t) + 1
    line = text[line_start:text.find("\n", t) if "\n" in text[t:] else len(text)]
    if line.startswith("####"):
        return "answer line"
    if t == line_start:
        return "line start"
    equals = text.find("=", line_start, line_start + len(line))
    if equals < 0 or t <= equals:
        return "expression"
    return "result's first char" if t == equals + 1 else "rest of result"


def where_cuts(model_dir: Path, *, prompts: int = 64, samples: int = 8, seed: int = 0) -> str:
    """A markdown table: how each rule cuts a batch of the model's responses to train problems (the testbed's sampling
    settings): states per response, tokens per segment, and where the cuts fall (cut_kind), in shares of all cuts."""
    import random

    import torch

    from ablations.branching import token_entropies
    from data import encode_prompt, load_split
    from engine import HFSampler
    from model import load_model, load_tokenizer
    from values import step_token_starts
    tokenizer = load_tokenizer(str(model_dir))
    model = load_model(str(model_dir), device=torch.device("cpu"), dtype=torch.float32, frozen=True)
    sampler = HFSampler(model, tokenizer, dtype=torch.float32)
    examples = random.Random(seed).sample(load_split("chain", "train", arith_ops=4), prompts)
    ids = [encode_prompt(e["question"], grader="chain", tokenizer=tokenizer, prompt_format="plain") for e in examples]
    groups = sampler.sample(ids, n=samples, temperature=0.6, top_p=0.9, max_new_tokens=64, seed=seed)
    pieces = [(prompt, s) for prompt, group in zip(ids, groups) for s in group if s.token_ids]
    entropies = [token_entropies(model, prompt, s.token_ids, temperature=0.6) for prompt, s in pieces]
    kinds = ("line start", "result's first char", "rest of result", "expression", "answer line")
    lines = ["| rule | states / response | tokens / segment | " + " | ".join(kinds) + " |",
             "| --- | --- | --- | " + " | ".join("---" for _ in kinds) + " |"]
    splits = {}  # each distinct rule once (lowprob-k18 cuts as lowprob does)
    for rule, flags in RULES.items():
        splits.setdefault(flags[flags.index("--step-split") + 1], rule)
    for split, rule in splits.items():
        counts, states, tokens = dict.fromkeys(kinds, 0), 0, 0
        for (prompt, s), ent in zip(pieces, entropies):
            starts = step_token_starts(s.token_ids, s.text, tokenizer=tokenizer, task="chain", split=split,
                                       logprobs=s.logprobs, entropies=ent)
            states, tokens = states + len(starts), tokens + len(s.token_ids)
            for t in starts[1:]:
                counts[cut_kind(s.text, t)] += 1  # one character a token: token t is character t
        cuts = max(sum(counts.values()), 1)
        lines.append(f"| {rule} | {states / len(pieces):.2f} | {tokens / states:.1f} | "
                     + " | ".join(f"{counts[k] / cuts:.2f}" for k in kinds) + " |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    grid_arguments(parser, arm="rule", arms=RULES, out=OUT)
    parser.add_argument("--testbed", default=TESTBED, help="the testbed's folder: its SFT model, in sft/ "
                        "(the committed grid: --out research/branching/results/branching --testbed research/testbed/results/testbed)")
    parser.add_argument("--where", action="store_true", help="run nothing: print where each rule cuts the SFT "
                        "model's responses (a batch of 64 x 8)")
    args, extra = parser.parse_known_args()  # anything else goes to train.py
    rules, seeds = grid_choices(args, arm="rule", arms=RULES)
    if args.where:
        return print(where_cuts(Path(args.testbed) / "sft"))
    arm_grid(args, extra, arms=RULES, chosen=rules, seeds=seeds, testbed=Path(args.testbed), baseline="lines",
             title="Vine budget per iteration (mean over iterations, ± SE over seeds)", table=budget_table)


if __name__ == "__main__":
    main()
