"""Moving code changes no number: every arm's first iteration (tests/golden.py) against the record kept for this
machine kind in tests/golden.json."""
import json
import os
import subprocess
import sys

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "tests"))
import golden  # noqa: E402


@pytest.mark.slow  # every arm end to end on a tiny scratch model: ~2 minutes on 2 cores
def test_every_arm_computes_what_it_did_when_the_record_was_kept(tmp_path):
    kept = json.loads((REPO / "tests" / "golden.json").read_text())
    kind = golden.machine_kind()
    if kind not in kept:
        pytest.skip(f"no golden record for {kind!r}; keep one with `python tests/golden.py OUT --keep` on a tree "
                    f"known to be right")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"}
    run = subprocess.run([sys.executable, str(REPO / "tests" / "golden.py"), str(tmp_path)], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    fresh, expected = json.loads((tmp_path / "record.json").read_text()), kept[kind]
    assert fresh.keys() == expected.keys()
    for arm in expected:
        assert fresh[arm] == expected[arm], arm
