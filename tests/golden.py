"""The golden record: one iteration of every arm the committed grids ran (two where a resume or the critic's own
optimizer matters), on a tiny scratch model of the chain task with fixed seeds, one thread, fp32; every metric that
is not a timing, and the sha256 of every saved weight file. tests/test_golden.py compares a fresh record with the one
kept in tests/golden.json for this machine kind, so that moving code around changes no number.

    python tests/golden.py OUT            write OUT/record.json (the SFT model and every arm's run under OUT)
    python tests/golden.py OUT --keep     also store it in tests/golden.json under this machine kind

A machine kind is its CPU model, its native bf16 units and torch's version: fp32 kernels round differently on
another kind, so each kind keeps its own record (a kind without one is skipped, with the command that records it).
"""
import hashlib
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

CHAIN = ["--dataset", "chain", "--arith-ops", "1", "--prompt-format", "plain"]
SFT = [*CHAIN, "--model", "scratch", "--scratch-layers", "2", "--scratch-width", "64", "--scratch-heads", "2",
       "--max-steps", "250", "--batch-size", "16", "--micro-batch-size", "16", "--lr", "3e-3", "--eval-size", "2",
       "--eval-samples", "1", "--threads", "1", "--seed", "0"]
RUN = [*CHAIN, "--prompts-per-iter", "6", "--samples-per-prompt", "4", "--minibatch-size", "8", "--temperature", "1.0",
       "--micro-batch-size", "4", "--max-new-tokens", "32", "--eval-size", "4", "--eval-samples", "2",
       "--eval-temperature", "0.35", "--eval-every", "1", "--save-every", "1", "--iterations", "1", "--threads", "1",
       "--dtype", "float32", "--sampler", "hf", "--seed", "0", "--lr", "1e-3", "--value-lr", "1e-3"]
ARMS = {  # name: (flags, iterations): every arm of the committed grids
    "vine": (["--estimator", "vine", "--k", "9"], 1),
    "vine-adaptive": (["--estimator", "vine", "--k-mode", "adaptive", "--k-round", "3", "--k-max", "9"], 1),
    "vine-official": (["--estimator", "vine", "--k-mode", "official"], 1),
    "vine-budget": (["--estimator", "vine", "--k", "4", "--k-mode", "budget"], 1),
    "vine-free-topup": (["--estimator", "vine", "--k", "9", "--free-samples", "topup"], 1),
    "vine-free-add": (["--estimator", "vine", "--k", "3", "--free-samples", "add"], 1),
    "vine-tokens": (["--estimator", "vine", "--k", "3", "--step-split", "tokens:4"], 1),
    "vine-lowprob": (["--estimator", "vine", "--k", "3", "--step-split", "lowprob:0.9"], 1),
    "vine-entropy": (["--estimator", "vine", "--k", "3", "--step-split", "entropy:0.2"], 1),
    "vine-silent": (["--estimator", "vine", "--k", "9", "--vines-where", "silent"], 1),
    "grpo-resample": (["--estimator", "grpo", "--resample-silent", "6"], 1),
    "critic-separate": (["--estimator", "critic", "--critic", "separate"], 2),
    "critic-head": (["--estimator", "critic", "--critic", "head"], 1),
    "grpo": (["--estimator", "grpo"], 1),
    "grpo-matched": (["--estimator", "grpo", "--samples-per-prompt", "8", "--minibatch-size", "16"], 1),
    "rloo": (["--estimator", "rloo"], 1),
    "vine-resumed": (["--estimator", "vine", "--k", "3"], 2),  # 1 iteration, then --resume for a second
}
TIMING = ("seconds", "mem_gb", "tokens_per_s", "train_seconds", "comm_bytes")  # prefixes of what a clock measures


def machine_kind() -> str:
    import torch
    from research.grid import this_machine
    m = this_machine()
    return f"{m['cpu']} | bf16 units: {'+'.join(m['bf16_units']) or 'none'} | torch {torch.__version__}"


def weights(folder: Path) -> dict[str, str]:
    """sha256 of every safetensors file under folder (a checkpoint: the policy, a critic), by relative path."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*.safetensors"))}


def record(out: Path) -> dict:
    """Train the scratch SFT model and every arm under out; the record of every non-timing metric and weight."""
    import sft
    import train
    from config import parse_config
    sft.main(sft.parse_sft_config([*SFT, "--out-dir", str(out / "sft")]))
    result = {"sft": weights(out / "sft")}
    for name, (flags, iterations) in ARMS.items():
        run = out / name
        argv = [*RUN, "--model", str(out / "sft"), *flags, "--out-dir", str(run)]
        if name == "vine-resumed":
            train.main(parse_config(argv))
            argv += ["--resume"]
        train.main(parse_config([*argv, "--iterations", str(iterations)]))
        lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        checkpoint = run / (run / "latest").read_text().split()[0]
        result[name] = {"metrics": [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in lines],
                        "weights": weights(checkpoint)}
    return result


def main():
    out, keep = Path(sys.argv[1]), "--keep" in sys.argv
    out.mkdir(parents=True, exist_ok=True)
    result = record(out)
    (out / "record.json").write_text(json.dumps(result, indent=1))
    if keep:
        path = REPO / "tests" / "golden.json"
        kept = json.loads(path.read_text()) if path.exists() else {}
        kept[machine_kind()] = result
        path.write_text(json.dumps(kept, indent=1) + "\n")
        print(f"kept under {machine_kind()!r} in {path}")


if __name__ == "__main__":
    main()
