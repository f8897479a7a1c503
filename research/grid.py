"""What the studies' grids share: the arms every grid draws from, the machine a run ran on, the SFT stage a grid
starts from. Each study's own driver (research/<study>/) builds its cells from these; the testbed's grid runner
(scripts/testbed.py: run_grid, run_state, done_runs) runs them.
"""
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch

from checkpoint import weights_sha256
from model import cpu_bf16_units, pick_dtype
from runlog import read_metrics

ROOT = Path(__file__).resolve().parent.parent  # the repository root: train.py and sft.py run from there

ESTIMATORS = {"vine": ["--estimator", "vine"],  # K = 9
              "vine-adaptive": ["--estimator", "vine", "--k-mode", "adaptive", "--k-ci", "0.45"],  # research/adaptive_k
              # the committed grids' critic arms ran a head on the policy's trunk (then the only critic): pinned, so
              # that they reproduce; the paper's separate critic is free_samples' critic-separate (docs/critic.md)
              "critic": ["--estimator", "critic", "--critic", "head"],
              # the paper's PPO, a separate critic network (its value lr: SETTINGS' --value-lr)
              "critic-separate": ["--estimator", "critic", "--critic", "separate"],
              "grpo": ["--estimator", "grpo"], "rloo": ["--estimator", "rloo"]}


def this_machine() -> dict:
    """What a second of training buys: the CPU, its cores and torch's threads, its native bf16 units and the compute
    dtype that --dtype auto picks from them."""
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")),
               platform.processor() or platform.machine())
    return {"cpu": cpu, "cpus": os.cpu_count(), "threads": torch.get_num_threads(), "bf16_units": cpu_bf16_units(),
            "dtype": str(pick_dtype("auto", torch.device("cpu"))).removeprefix("torch."), "torch": torch.__version__}


def describe(machine: dict | None) -> str:
    if machine is None:
        return "machine not recorded"
    units = "+".join(machine["bf16_units"]) or "no bf16 units"
    sft = f", from SFT model {machine['sft_sha256'][:12]}" if "sft_sha256" in machine else ""
    return f"{machine['cpu']} ({units}), {machine['cpus']} CPUs, {machine['threads']} threads, {machine['dtype']}{sft}"


def record_machine(run_dir: Path, machine: dict, *, resuming: bool):
    """run_dir/machine.json: the machine (and runs at once) the run started on; a resume keeps it and appends its own
    under "resumes", so a run cut off and continued elsewhere, or beside other runs, says so."""
    path, latest = run_dir / "machine.json", run_dir / "latest"
    if resuming and path.exists():
        first = json.loads(path.read_text())
        at = latest.read_text().strip() if latest.exists() else None  # the checkpoint it goes on from
        machine = {**first, "resumes": first.get("resumes", []) + [{**machine, "from": at}]}
    path.write_text(json.dumps(machine) + "\n")


def sft_stage(out: Path, *, settings: list[str]) -> tuple[Path, str]:
    """The SFT model: sft.py with `settings` (a study's SFT recipe) into out/sft, once
    (resumed if it was cut off); returns its folder and the sha256 of its weights (what each cell records, and its
    block must share)."""
    sft_dir = out / "sft"
    decays = "--no-lr-decay" not in settings
    if (sft_dir / "metrics.jsonl").exists() and ended_decayed(sft_dir / "metrics.jsonl") not in (None, decays):
        raise SystemExit(f"error: {sft_dir}: its SFT lr {'did not decay' if decays else 'decayed'}, unlike the "
                         f"schedule asked for (--{'' if decays else 'no-'}sft-lr-decay); use another --out")
    if not (sft_dir / "config.json").exists():
        cmd = [sys.executable, "sft.py", *settings, "--out-dir", str(sft_dir),
               "--resume" if (sft_dir / "latest").exists() else "--overwrite"]
        print("$", " ".join(cmd), flush=True)
        if subprocess.run(cmd, cwd=ROOT).returncode != 0:
            raise SystemExit("error: the SFT stage failed; see its output above")
    digest = weights_sha256(sft_dir)  # what train.py records in each run's start.json
    (sft_dir / "model.sha256").write_text(digest + "\n")
    return sft_dir, digest


def ended_decayed(metrics: Path) -> bool | None:
    """Whether an SFT run's lr ended below its peak (decayed, fully or to a floor); None before its first step."""
    lrs = [r["lr"] for r in read_metrics(metrics) if "lr" in r]
    return None if not lrs else lrs[-1] < max(lrs)
