"""One default CPU iteration two ways, in the same sitting: 1 process x all cores vs torchrun with 2 ranks x half the
cores each (gloo, DDP). Prints each section's seconds (rank 0's clock), the work done (vine tokens), and the bytes
each rank handed to collectives in the iteration; the last line holds the ratios.

    python -m bench.ranks [--dataset gsm8k] [--k 9] [extra train.py flags ...]      (about 10 minutes on 2 cores)
"""
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

SECTIONS = ("rollout", "values", "ppo", "sync", "eval")


def run(launch: list[str], out: Path, args: list[str], threads: int) -> dict:
    cmd = launch + ["train.py", "--iterations", "1", "--eval-every", "1", "--out-dir", str(out), *args]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    done = subprocess.run(cmd, cwd=Path(__file__).resolve().parent.parent, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"error: {' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    return json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])


def main(args: list[str]):
    args = args or ["--dataset", "gsm8k", "--k", "9"]
    cores = os.cpu_count() or 2
    with tempfile.TemporaryDirectory() as tmp:
        one = run([sys.executable], Path(tmp) / "one", args, threads=cores)
        two = run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"], Path(tmp) / "two", args,
                  threads=max(1, cores // 2))
    print(f"{'':24}{'1 rank x ' + str(cores) + ' threads':>22}{'2 ranks x ' + str(max(1, cores // 2)) + ' thr.':>22}")
    for key in [f"seconds_{s}" for s in SECTIONS] + ["seconds", "value_states", "vine_tokens", "tokens_per_s",
                                                      "optimizer_steps", "comm_bytes"]:
        print(f"{key:24}{one.get(key, 0):>22,.1f}{two.get(key, 0):>22,.1f}")
    train = [r["seconds"] - r.get("seconds_eval", 0) for r in (one, two)]
    per_vine = [t / max(r["vine_tokens"], 1) for t, r in zip(train, (one, two))]
    print(f"train_ratio={train[0] / train[1]:.2f} per_vine_token_ratio={per_vine[0] / per_vine[1]:.2f} "
          f"eval_ratio={one.get('seconds_eval', 0) / max(two.get('seconds_eval', 0), 1e-9):.2f} "
          f"comm_mb_per_rank={two['comm_bytes'] / 1e6:.1f}")


if __name__ == "__main__":
    main(sys.argv[1:])
