"""Where the vines branch (--step-split): the text rule, tokens:N, lowprob:P and entropy:F of values.step_token_starts,
the config's one-line errors, the tracker's view of the steps used, and research/branching/branching.py's arms and budget table."""
import json
import math

import pytest
import torch

from config import step_split_problem
from runlog import response_steps
from model import char_tokenizer
from ablations.branching import spread
from values import step_token_starts, text_step_starts

TEXT = "13*3=39\n39-3=36\n36-30=6\n####6"  # 29 characters = tokens; three steps (the answer line joins the last)
TOKENIZER = char_tokenizer("0123456789+-*=#\n")


def ids():
    return TOKENIZER(TEXT, add_special_tokens=False).input_ids


def test_text_rule_cuts_at_lines_and_auto_is_it():
    assert len(ids()) == 29
    assert text_step_starts(ids(), TEXT, tokenizer=TOKENIZER, task="chain") == [0, 8, 16]
    assert step_token_starts(ids(), TEXT, tokenizer=TOKENIZER, task="chain") == [0, 8, 16]
    assert step_token_starts(ids(), TEXT, tokenizer=TOKENIZER, task="chain", split="tokens:10") == [0, 10, 20]


def test_lowprob_cuts_before_unlikely_tokens_and_thins_evenly_to_the_line_count():
    n = len(ids())
    logprobs = [0.0] * n  # every token certain: no cut, only the prompt's state
    assert step_token_starts(ids(), TEXT, tokenizer=TOKENIZER, task="chain", split="lowprob:0.9",
                             logprobs=logprobs) == [0]
    logprobs[5] = logprobs[12] = math.log(0.5)
    logprobs[13] = math.log(0.95)  # above P: no cut
    assert step_token_starts(ids(), TEXT, tokenizer=TOKENIZER, task="chain", split="lowprob:0.9",
                             logprobs=logprobs) == [0, 5, 12]
    logprobs[20] = math.log(0.5)  # three cutpoints, the text rule has two cuts: thinned, spread out
    assert step_token_starts(ids(), TEXT, tokenizer=TOKENIZER, task="chain", split="lowprob:0.9",
                             logprobs=logprobs) == [0, 5, 20]
    starts = step_token_starts(ids(), TEXT, tokenizer=TOKENIZER, task="chain", split="lowprob:0.9",
                               logprobs=[math.log(0.1)] * n)  # every token a cutpoint
    assert starts == [0, 8, 22]
    # the first token never makes a state of its own: state 0 is the prompt
    assert step_token_starts(ids(), TEXT, tokenizer=TOKENIZER, task="chain", split="lowprob:0.9",
                             logprobs=[math.log(0.1)] + [0.0] * (n - 1)) == [0]


def test_entropy_cuts_before_the_highest_entropy_tokens():
    entropies = [0.1] * len(ids())
    entropies[3], entropies[9], entropies[20] = 2.0, 1.5, 1.0
    # the top 3% of 29 tokens is 1 token: the highest
    assert step_token_starts(ids(), TEXT, tokenizer=TOKENIZER, task="chain", split="entropy:0.03",
                             entropies=entropies) == [0, 3]
    # the top 10% is 3 tokens, capped at the text rule's 2 cuts: the two highest, in order
    for split in ("entropy:0.1", "entropy:1"):
        assert step_token_starts(ids(), TEXT, tokenizer=TOKENIZER, task="chain", split=split,
                                 entropies=entropies) == [0, 3, 9]
    entropies[9] = 0.5  # now the 20th token's is the second highest
    assert step_token_starts(ids(), TEXT, tokenizer=TOKENIZER, task="chain", split="entropy:0.1",
                             entropies=entropies) == [0, 3, 20]


def test_a_one_line_response_gets_only_the_prompt_state_under_every_capped_rule():
    one = TOKENIZER("####6", add_special_tokens=False).input_ids
    for split, kw in (("lowprob:0.9", {"logprobs": [math.log(0.1)] * len(one)}),
                      ("entropy:0.5", {"entropies": [1.0] * len(one)})):
        assert step_token_starts(one, "####6", tokenizer=TOKENIZER, task="chain", split=split, **kw) == [0]


def test_spread():
    assert spread([1, 2, 3], at_most=5) == [1, 2, 3]
    assert spread(list(range(10)), at_most=2) == [2, 7]
    assert spread(list(range(10)), at_most=0) == []


@pytest.mark.parametrize("split,ok", [("auto", True), ("tokens:8", True), ("lowprob:0.9", True), ("entropy:0.2", True),
                                      ("entropy:1", True), ("lines", False), ("tokens:0", False), ("lowprob:0", False),
                                      ("lowprob:1.5", False), ("entropy:x", False), ("entropy", False),
                                      ("lowprob:nan", False)])
def test_step_split_values(split, ok):
    problem = step_split_problem(split)
    assert (problem is None) == ok and (ok or "\n" not in problem)


def test_tracker_shows_the_steps_the_vines_used():
    advantages = torch.arange(len(ids()), dtype=torch.float32)
    texts, means = response_steps(token_ids=ids(), advantages=advantages, starts=[0, 5, 12], tokenizer=TOKENIZER)
    assert "".join(texts) == TEXT and texts[0] == "13*3=" and means == [2.0, 8.0, 20.0]


def test_branching_arms_and_budget_table(tmp_path):
    from research.branching.branching import RULES, budget_table
    from research.grid import ITERATIONS, done_runs
    from research.summary import iteration_table
    splits = [flags[flags.index("--step-split") + 1] for flags in RULES.values()]
    assert splits == ["auto", "tokens:10", "lowprob:0.9", "entropy:0.2", "lowprob:0.9"]
    assert all(step_split_problem(split) is None for split in splits)
    for seed, states in ((0, 300), (1, 340)):
        run = tmp_path / f"lowprob-s{seed}"
        run.mkdir()
        records = [{"iteration": 0, "eval_accuracy": 0.5, "eval_se": 0.02}]
        records += [{"iteration": i, "steps_per_response": 2.0, "value_states": states, "vines": 9 * states,
                     "vine_tokens": 100 * states, "seconds_values": 4.0, "seconds": 10.0} for i in range(1, ITERATIONS + 1)]
        records[-1].update(eval_accuracy=0.6, eval_se=0.02)
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    table = budget_table(done_runs(tmp_path, arms=RULES, start=None)[0]).splitlines()
    assert len(table) == 3 and table[2].startswith("| lowprob | 2.00 ± 0.00 | 320 ± 20 | 2880 ± 180 |")
    for seed, final in ((0, 0.7), (1, 0.5)):  # lines: evaluations 0.6 (iterations 3-27) and `final`
        run = tmp_path / f"lines-s{seed}"
        run.mkdir()
        records = [{"iteration": i, "eval_accuracy": 0.5 if i == 0 else 0.6, "eval_se": 0.02}
                   for i in range(0, ITERATIONS, 3)] + [{"iteration": ITERATIONS, "eval_accuracy": final, "eval_se": 0.02}]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    rows = iteration_table(done_runs(tmp_path, arms=RULES, start=None)[0], baseline="lines").splitlines()[2:]  # lowprob's only evaluation after 0: 0.6 at the end
    assert rows[0] == "| lines | 2 | 0.600 ± 0.010 | – |"
    assert rows[1] == "| lowprob | 2 | 0.600 ± 0.000 | +0.000 ± 0.010 (2) |"


def test_entropy_pass_gives_the_update_the_same_old_logprobs(tmp_path):
    """values_for's scoring pass (score_batch with entropies) leaves in `batch` what policy_update would compute."""
    from transformers import AutoModelForCausalLM

    from model import Scorer
    from ppo import batch_logprobs, micro_batches, pad_episodes, score_batch
    from model import new_scratch_model
    chars = "0123456789+-*=#\n"
    model = AutoModelForCausalLM.from_pretrained(new_scratch_model(tmp_path / "m", chars=chars, layers=2, width=32,
                                                                   heads=2, seed=0))
    prompts = [TOKENIZER("13 *3", add_special_tokens=False).input_ids, TOKENIZER("7 +1", add_special_tokens=False).input_ids]
    responses = [ids(), TOKENIZER("7+1=8\n####8", add_special_tokens=False).input_ids]
    input_ids, attention_mask, response_mask, P = pad_episodes(prompts, responses, pad_id=TOKENIZER.pad_token_id)
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "response_mask": response_mask}
    groups = micro_batches(2, size=1)
    scored = score_batch(Scorer(model), batch, P, groups=groups, temperature=0.6, top_p=0.9, with_entropy=True)
    logprobs, _, log_mass = batch_logprobs(Scorer(model), batch, P, groups=groups, temperature=0.6, top_p=0.9)
    assert torch.equal(scored["logprobs"], logprobs) and torch.equal(scored["log_mass"], log_mass)
    entropy = scored["entropy"][response_mask.bool()]  # (N,)
    assert (entropy > 0).all() and (entropy <= math.log(model.config.vocab_size) + 1e-5).all()


def test_cut_kind_names_where_a_chain_cut_falls():
    from research.branching.branching import cut_kind
    text = "13*3=39\n39-3=36\n####36"
    kinds = [cut_kind(text, t) for t in range(len(text))]
    assert kinds[0] == kinds[8] == "line start" and kinds[5] == kinds[13] == "result's first char"
    assert kinds[3] == kinds[12] == "expression" and kinds[6] == "rest of result" and kinds[16] == "answer line"


def test_branching_flags_bad_values_are_one_line(tmp_path):
    import subprocess
    import sys
    from pathlib import Path
    for args, message in ((["--rules", "lines,spo"], "error: --rules: unknown ['spo']"),
                          (["--seeds", "1,"], "error: --seeds: expected comma-separated non-negative integers"),
                          (["--jobs", "0"], "error: --jobs must be at least 1 (got 0)")):
        run = subprocess.run([sys.executable, "-m", "research.branching.branching", "--out", str(tmp_path), *args],
                             cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True, timeout=120)
        assert run.returncode == 1 and run.stderr.strip().startswith(message) and len(run.stderr.strip().splitlines()) == 1
