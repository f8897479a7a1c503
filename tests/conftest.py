"""Shared fixtures: the real data folder (skip when absent) and the real SmolLM2 model (fetched/converted once)."""
import os
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ["HF_HUB_OFFLINE"] = "1"  # tests never touch the network: the default model comes from the GGUF wheel
torch.set_num_threads(min(2, os.cpu_count() or 1))


def find_data_dir() -> Path | None:
    for candidate in (os.environ.get("VINEPPO_DATA_DIR"), REPO.parent / "shared" / "data"):
        if candidate and (Path(candidate) / "gsm8k" / "test.jsonl").exists():
            return Path(candidate)
    return None


DATA_DIR = find_data_dir()
needs_data = pytest.mark.skipif(DATA_DIR is None, reason="real data not found (../shared/data or VINEPPO_DATA_DIR)")


@pytest.fixture(scope="session")
def data_dir() -> Path:
    if DATA_DIR is None:
        pytest.skip("real data not found (../shared/data or VINEPPO_DATA_DIR)")
    return DATA_DIR


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
