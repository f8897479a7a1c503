"""Data parallelism on the CPU: 2 ranks under torchrun (gloo) against 1 process on the same global batch.
The worker (tests/dist_worker.py) runs each case; these tests compare what rank 0 wrote."""
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dist import deal

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "dist_worker.py"


def run_worker(cases: list[str], out: Path, *, ranks: int) -> dict:
    """Each of `cases` run by tests/dist_worker.py in one launch on `ranks` ranks: case -> what rank 0 wrote."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
              "--standalone"] if ranks > 1 else [sys.executable]
    done = subprocess.run(launch + [str(WORKER), ",".join(cases), str(out)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(out, weights_only=False)  # our own test output


PPO_CASES = ["ppo", "ppo-critic", "ppo-fsdp", "critic-separate", "critic-separate-fsdp"]
SFT_CASES = ["sft", "sft-fsdp"]


@pytest.fixture(scope="module")
def one_and_two_ranks(tmp_path_factory) -> tuple[dict, dict]:
    """Every case of PPO_CASES and SFT_CASES, and split, on 1 rank and on 2 ranks, one launch each."""
    out = tmp_path_factory.mktemp("ranks")
    return (run_worker(PPO_CASES + SFT_CASES + ["split"], out / "one.pt", ranks=1),
            run_worker(PPO_CASES + SFT_CASES + ["split"], out / "two.pt", ranks=2))


@pytest.mark.parametrize("case", PPO_CASES)
@pytest.mark.slow  # end to end: torchrun processes
def test_two_ranks_with_half_the_episodes_each_take_the_one_rank_step(one_and_two_ranks, case):
    """Two PPO steps (SGD: the step is the gradient, scale included) on 2 ranks x 4 episodes leave the parameters
    where 1 rank x 8 episodes does. One rank's responses are 2-4 tokens, the other's 9-14: a loss normalised by each
    rank's own token count, or gradients averaged without the world-size factor, would move them elsewhere."""
    one, two = one_and_two_ranks[0][case], one_and_two_ranks[1][case]
    assert one["stats"]["optimizer_steps"] == two["stats"]["optimizer_steps"] == 2
    moved = max((one["weights"][k] - one["start"][k]).abs().max().item() for k in one["start"])
    assert moved > 1e-3  # the step is real
    for name, w in one["weights"].items():
        assert torch.allclose(w, two["weights"][name], atol=3e-6, rtol=0), (name, (w - two["weights"][name]).abs().max())
    keys = ("value_loss", "value_grad_norm") if case.startswith("critic") else \
        ("loss", "ratio", "approx_kl", "kl_ref", "entropy", "grad_norm") + (("value_loss",) if "critic" in case else ())
    for key in keys:
        assert two["stats"][key] == pytest.approx(one["stats"][key], rel=1e-5, abs=1e-7), key


@pytest.mark.parametrize("case", SFT_CASES)
@pytest.mark.slow  # end to end: torchrun processes
def test_two_ranks_with_half_the_batch_each_take_the_one_rank_sft_step(one_and_two_ranks, case):
    """One sft.py step (SGD, no clipping) on 2 ranks x 4 instances leaves the parameters where 1 rank x 8 does, and
    logs the same loss and token counts. One rank's targets are 2-4 tokens, the other's 9-14: gradients averaged
    without the world-size factor, or a loss normalised by each rank's own batch, would move them elsewhere."""
    one, two = one_and_two_ranks[0][case], one_and_two_ranks[1][case]
    moved = max((one["weights"][k] - one["start"][k]).abs().max().item() for k in one["start"])
    assert moved > 1e-3  # the step is real
    for name, w in one["weights"].items():
        assert torch.allclose(w, two["weights"][name], atol=3e-6, rtol=0), (name, (w - two["weights"][name]).abs().max())
    assert (two["stats"]["tokens"], two["stats"]["tokens_all"]) == (one["stats"]["tokens"], one["stats"]["tokens_all"])
    from safetensors.torch import load_file
    for run in (one, two):  # the saved final model is the stepped one (under FSDP2 gathered whole from the shards)
        saved = load_file(Path(run["saved"]) / "model.safetensors")
        assert all(torch.equal(saved[k], run["weights"][k]) for k in saved) and "model.embed_tokens.weight" in saved
    for key in ("loss", "grad_norm"):
        assert two["stats"][key] == pytest.approx(one["stats"][key], rel=1e-5), key


def test_deal_balances_cost_and_deals_each_state_once():
    costs = [50, 7, 7, 30, 1, 22, 22, 9, 64, 3, 18]
    for parts in (1, 2, 3, 5):
        split = deal(costs, parts=parts)
        assert sorted(i for part in split for i in part) == list(range(len(costs)))
        loads = [sum(costs[i] for i in part) for part in split]
        assert max(loads) - min(loads) <= max(costs)


@pytest.mark.slow  # end to end: real train.py / torchrun processes
def test_states_are_pooled_deduplicated_and_balanced_across_ranks(one_and_two_ranks):
    """estimate_values on 2 ranks estimates exactly the states 1 rank does, each once, with the expected vine tokens
    of the two ranks within one state's worth of each other, and every rank gets its responses' values back."""
    one, two = one_and_two_ranks[0]["split"], one_and_two_ranks[1]["split"]
    single = one["ranks"][0]["states"]
    pooled = [s for rank in two["ranks"] for s in rank["states"]]
    assert len(set(single)) == len(single) and len(set(pooled)) == len(pooled)  # each state once
    assert set(pooled) == set(single) and len(single) < 12 * 4  # shared first steps were deduplicated
    costs = [rank["cost"] for rank in two["ranks"]]
    biggest = 3 * 32  # K x the longest response (3 + at most 29 tokens): no state costs more
    assert abs(costs[0] - costs[1]) <= biggest and sum(costs) == one["ranks"][0]["cost"]
    assert two["stats"] == one["stats"]
    values = {i: v for rank in two["ranks"] for i, v in rank["values"].items()}
    assert values == one["ranks"][0]["values"]


def torchrun_train(out: Path, *args, pause: str | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone", "train.py", "--dataset", "gsm8k", "--k", "2",
           "--prompts-per-iter", "2", "--samples-per-prompt", "2", "--max-new-tokens", "24", "--eval-size", "2",
           "--eval-samples", "1", "--out-dir", str(out), "--sampler", "hf", *args]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("VINEPPO_PAUSE_AT", None)
    if pause:
        env["VINEPPO_PAUSE_AT"] = pause
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def check_run(out: Path, iterations: int):
    """metrics.jsonl holds each iteration once; the checkpoint loads in transformers and holds both ranks' RNG."""
    import json
    from transformers import AutoModelForCausalLM
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == list(range(iterations + 1))
    assert all(r["optimizer_steps"] >= 1 and r["vines"] == 2 * r["value_states"] and r["comm_bytes"] > 0
               for r in records[1:])
    assert (out / "latest").read_text() == f"ckpt-{iterations:06d}"
    assert AutoModelForCausalLM.from_pretrained(out / f"ckpt-{iterations:06d}").config.model_type == "llama"
    state = torch.load(out / f"ckpt-{iterations:06d}" / "trainer_state.pt", weights_only=True)
    assert len(state["torch_rng"]) == 2 and state["iteration"] == iterations


@pytest.mark.slow  # end to end: real train.py / torchrun processes
def test_torchrun_fsdp_rank_killed_mid_update_then_resume(tmp_path, scratch):
    """torchrun --nproc_per_node=2 train.py --fsdp (gloo, FSDP2) with the tiny scratch model on chain (what is checked
    is the resume, not the model): rank 1 is killed with SIGKILL in iteration 2's update, which takes the job down;
    the same command with --resume continues from the iteration-1 checkpoint (full weights and the full AdamW state,
    sharded again) and finishes, each iteration logged once. (The real SmolLM2 under torchrun end to end: the
    torchrun sft.py test below; FSDP2's step against one process: the sft-fsdp and ppo-fsdp cases above.)"""
    out = tmp_path / "OUT"
    proc = torchrun_train(out, *scratch, "--fsdp", "--iterations", "2", "--save-every", "1", pause="ppo:2")
    log = []
    for line in proc.stdout:
        log.append(line)
        paused = re.search(r"paused at ppo:2 \(rank 1, pid (\d+)\)", line)
        if paused:
            os.kill(int(paused.group(1)), signal.SIGKILL)
    assert proc.wait(timeout=900) != 0 and (out / "latest").read_text() == "ckpt-000001", "".join(log)[-4000:]
    proc = torchrun_train(out, *scratch, "--fsdp", "--iterations", "2", "--save-every", "1", "--resume")
    log = proc.communicate(timeout=900)[0]
    assert proc.returncode == 0 and "resumed from" in log, log[-4000:]
    check_run(out, 2)


@pytest.mark.slow  # end to end: real sft.py / torchrun processes
def test_torchrun_sft_trains_checkpoints_resumes_and_saves_the_model(tmp_path, smol_path):
    """torchrun --nproc_per_node=2 sft.py (DDP) on real arith rows with the real SmolLM2: one step, then --resume to
    two; each step logged once, a checkpoint with both ranks' RNG, and a final HF folder of the trained weights.
    (sft.py's FSDP2 step and its gathered final model: the sft-fsdp case above.)"""
    import json
    from transformers import AutoModelForCausalLM
    out = tmp_path / "SFT"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    for args in (["--max-steps", "1"], ["--max-steps", "2", "--resume"]):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone", "sft.py",
               "--dataset", "arith", "--batch-size", "4", "--micro-batch-size", "1", "--eval-size", "2",
               "--eval-samples", "1", "--max-new-tokens", "16", "--lr", "5e-5", "--save-every", "1",
               "--out-dir", str(out), *args]
        run = subprocess.run(cmd, cwd=ROOT, env=env, text=True, capture_output=True, timeout=600)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "resumed from" in run.stdout and "torchrun: 2 ranks, gloo" in run.stdout
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [0, 1, 2] and "eval_accuracy" in records[2]
    assert all(r["loss"] > 0 and r["tokens"] > 0 for r in records[1:])
    wrong = round(2 * (1 - records[2]["eval_accuracy"]))  # 2 problems x 1 sample, one problem on each rank
    assert sum(records[2]["first_wrong_line"].values()) == wrong  # both ranks' wrong samples, each counted once
    state = torch.load(out / "ckpt-000002" / "trainer_state.pt", weights_only=True)
    assert len(state["torch_rng"]) == 2 and state["iteration"] == 2
    model, base = AutoModelForCausalLM.from_pretrained(out), AutoModelForCausalLM.from_pretrained(smol_path)
    assert not torch.equal(model.lm_head.weight, base.lm_head.weight)  # trained
    assert model.lm_head.weight.shape == base.lm_head.weight.shape


def test_finish_leaves_alone_a_process_group_it_did_not_make(tmp_path):
    """In-process vLLM makes a process group of its own and destroys it at its shutdown; dist.finish (train.py's last
    call, no torchrun) must not destroy it first, or every `--sampler vllm` run ends in a traceback."""
    code = ("import torch, torch.distributed as d, dist; "
            f"d.init_process_group('gloo', init_method='file://{tmp_path}/store', rank=0, world_size=1); "
            "assert dist.init(torch.device('cpu')) == (0, 1); dist.finish(); "
            "print('still there' if d.is_initialized() else 'destroyed'); d.destroy_process_group()")
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "WORLD_SIZE")}
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "still there", run.stdout + run.stderr[-2000:]
