#!/usr/bin/env bash
# One prepared GPU check: the CUDA path of this project measured on a real GPU (docs/cuda.md).
#
#   bash scripts/prepare_gpu_check.sh              # first, here: fills .gpu_check/ (ignored by git, ~13 MB)
#   bash scripts/gpu_check.sh                      # on the GPU machine, from the checkout
#   GPU_CHECK_DEVICE=cpu bash scripts/gpu_check.sh # the dry run on a CPU: the tiny shape, a small bench
#
# Needs beside the tracked files: .gpu_check/ (carry it): the SmolLM2 tokenizer and config (no weights) and pure-Python
# fallbacks for pytest and math-verify. torch and transformers must be installed; nothing is installed, nothing is
# downloaded (HF_HUB_OFFLINE=1), no model weights are needed (random weights of the real shapes: bench/shapes.py).
# Parts, each under its own timeout so that one hang cannot eat the budget (550 s in all; expected well under 8 min
# on an H200, not yet measured):
#   0. environment: GPU, versions, the imports train.py needs (what is missing is reported, and taken from
#      .gpu_check/site/ where a fallback is there)                                       60 s
#   1. tests/test_cuda.py: sampler vs generate, sampler vs trainer log-probs, train.py + checkpoint + --resume,
#      torchrun --nproc_per_node=1 (NCCL) with DDP and with --fsdp                    330 s
#   2. bench/sampler.py --device cuda on the 135m and the ~1.1B (1b) random-weight shapes: ours vs generate at batch 64 and
#      256, the vine pattern, tokens/s and peak memory                                 80 s each
# Writes under $OUT (default ./gpu_check_out), 6 files: gpu_check.log (everything below), pytest.log,
# cuda_check.json (the tests' measurements), bench_<shape>.json (2), speed_table.md. Exit status: the number of parts
# that failed.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false TQDM_DISABLE=1  # no progress bars in logs
PY=${PYTHON:-python}
DEVICE=${GPU_CHECK_DEVICE:-cuda}
OUT=${OUT:-$PWD/gpu_check_out}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd) && export OUT
TOKENIZER=$PWD/.gpu_check/tokenizer
if [ "$DEVICE" = cuda ]; then SHAPES="135m 1b"; BENCH="--batches 64,256 --agree-prompts 8"; SCALE=1
else SHAPES="tiny"; BENCH="--batches 8 --agree-prompts 2 --vine-k 1 --threads 1"; SCALE=${GPU_CHECK_TIMEOUT_SCALE:-4}
fi  # CPUs are slower

part() {  # part NAME SECONDS COMMAND...: run it under a timeout, report how it ended
  local name=$1 limit=$(($2 * SCALE)); shift 2
  echo "=== $name (timeout ${limit}s): $*"
  local start=$SECONDS
  timeout -k 10 "$limit" "$@"
  local rc=$?
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then echo "=== $name: TIMED OUT after ${limit}s"
  else echo "=== $name: exit $rc after $((SECONDS - start))s"; fi
  return $rc
}

environment() {
  date -u
  if command -v nvidia-smi >/dev/null; then timeout 20 nvidia-smi --query-gpu=name,memory.total,driver_version \
    --format=csv; else echo "nvidia-smi: not found"; fi
  [ -f "$TOKENIZER/tokenizer.json" ] || { echo "error: $TOKENIZER missing: run scripts/prepare_gpu_check.sh here \
first and carry .gpu_check"; return 1; }
  "$PY" -c "import sys, torch, transformers; print('python', sys.version.split()[0], '| torch', torch.__version__, \
'cuda', torch.version.cuda, '| transformers', transformers.__version__); print('cuda available:', \
torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')" || {
    echo "error: torch and transformers must import"; return 1; }
  if [ "$DEVICE" = cuda ] && ! "$PY" -c "import torch; assert torch.cuda.is_available()" 2>/dev/null; then
    echo "error: torch sees no CUDA device"; return 1; fi
  local folder missing
  for folder in .gpu_check/site/*/; do  # a fallback goes on the path only where its package does not import
    missing=$(for m in $(ls "$folder" | grep -v '\.dist-info$' | sed 's/\.py$//'); do
      "$PY" -c "import $m" 2>/dev/null || echo "$m"; done)
    if [ -n "$missing" ]; then
      echo "missing: $(basename "$folder") (no $(echo $missing | tr ' ' ',')): using .gpu_check/site/$(basename "$folder")"
      export PYTHONPATH="$PWD/$folder${PYTHONPATH:+:$PYTHONPATH}"
    fi
  done
  for m in safetensors tqdm accelerate gguf datasets tensorboard; do
    "$PY" -c "import $m" 2>/dev/null || echo "not installed: $m (not needed by this check)"; done
  "$PY" -c "import train, bench, shapes; print('imports: train, bench, shapes ok')" || {
    echo "error: the project does not import (above: what is missing)"; return 1; }
}

main() {
  local failed=0
  echo "gpu_check: device $DEVICE, shapes $SHAPES, outputs in $OUT"
  if ! environment; then echo "=== environment: FAILED; nothing else can run"; return 1; fi
  VINEPPO_TEST_DEVICE=$DEVICE VINEPPO_TOKENIZER=$TOKENIZER part "tests/test_cuda.py" 330 \
    "$PY" -m pytest -q -s -rA -p no:cacheprovider tests/test_cuda.py 2>&1 | tee "$OUT/pytest.log" || failed=$((failed + 1))
  local shape
  for shape in $SHAPES; do
    rm -f "$OUT/bench_$shape.json"
    part "bench/sampler.py $shape" 80 "$PY" -m bench.sampler --device "$DEVICE" --shape "$shape" --tokenizer "$TOKENIZER" \
      --dataset arith $BENCH --json "$OUT/bench_$shape.json" || failed=$((failed + 1))
  done
  "$PY" -c "import glob, json, sys, bench; files = sorted(glob.glob(sys.argv[1] + '/bench_*.json')); \
open(sys.argv[1] + '/speed_table.md', 'w').write(bench.speed_table([json.load(open(f)) for f in files])) \
if files else print('no bench results: no speed table')" "$OUT" && cat "$OUT/speed_table.md" 2>/dev/null
  echo "gpu_check: $failed part(s) failed; files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
  return $failed
}

main 2>&1 | tee "$OUT/gpu_check.log"
