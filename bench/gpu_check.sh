#!/usr/bin/env bash
# One GPU check in at most ~8 minutes (section limits 100 + 240 + 100 + 30 s by default), writing one markdown results file:
#   (a) tests/models/test_triton.py (compiled Triton kernels on CUDA, CUDA graphs; interpreter on CPU)
#   (b) bench/gpu_bench.py: the kernels next to the shared yardstick, same process (+ matmul peak, copy bandwidth)
#   (c) `latentlm serve --device cuda` under a load generator (needs fastapi/uvicorn/msgpack: installed from .whl/ if
#       there), then one-sentence requests from 4 API workers through the engine process (c-engine; same limit)
#   (d) onnxruntime CUDAExecutionProvider parity (skipped unless that provider exists)
#
#   bash bench/gpu_check.sh [--small] [--yardstick PATH] [--out DIR]
#
# --small: tiny shapes; without a GPU the Triton kernels run in Triton's interpreter (CI on CPU, ~1-2 minutes).
# GPU_CHECK_LIMITS="A B C D": the four sections' limits in seconds (default "100 240 100 30", with --small
# "600 400 300 120"; the benchmark stops
# starting new variants 40 s before its limit).
# The repository need not be pip-installed: a temporary `latentlm` package of symlinks (latentlm/* plus
# models/, service/, training/ as latentlm.models, ...) is put first on PYTHONPATH.
# Yardstick: --yardstick PATH, else ../shared/bench/gpu_yardstick.py when it exists, else
# bench/.yardstick/gpu_yardstick.py (copy it there: ../shared does not travel to the GPU machine).
# Python: $PYTHON, else .venv/bin/python when it has torch, else python3.
set -u
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
SMALL=0
YARD=""
OUT="$ROOT/bench/results"
while [ $# -gt 0 ]; do
  case "$1" in
    --small) SMALL=1 ;;
    --yardstick) YARD="$2"; shift ;;
    --yardstick=*) YARD="${1#*=}" ;;
    --out) OUT="$2"; shift ;;
    --out=*) OUT="${1#*=}" ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
if [ -z "$YARD" ]; then
  if [ -f "$ROOT/../shared/bench/gpu_yardstick.py" ]; then YARD="$ROOT/../shared/bench/gpu_yardstick.py"
  else YARD="$ROOT/bench/.yardstick/gpu_yardstick.py"; fi
  # --small without the shared yardstick (CI): a stand-in with the same entry points, so section (b) runs
  if [ "$SMALL" = 1 ] && [ ! -f "$YARD" ]; then YARD="$ROOT/bench/small_yardstick.py"; fi
fi
YARD="$(cd "$(dirname "$YARD")" 2>/dev/null && pwd)/$(basename "$YARD")"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
T_START=$(date +%s)
# --small (CI on a CPU): the limits guard no device time there, and a cold start (numba compiling the CPU kernels,
# the Triton interpreter) on a slow 2-core machine took over 100 s for section (a) alone, so they are wide
DEFAULT_LIMITS="100 240 100 30"
if [ "$SMALL" = 1 ]; then DEFAULT_LIMITS="600 400 300 120"; fi
read -r LIM_A LIM_B LIM_C LIM_D <<< "${GPU_CHECK_LIMITS:-$DEFAULT_LIMITS}"
# shellcheck source=bench/gpu_env.sh
. "$ROOT/bench/gpu_env.sh"  # $PYTHON, $WORK, an importable `latentlm` without installing the repository

# the service's packages the GPU machine lacks, from wheels in .whl/, for the service section (c) only
private_wheels "import fastapi, uvicorn, pydantic, starlette, msgpack"

SUFFIX=""; SMALLARG=""
if [ "$SMALL" = 1 ]; then SUFFIX="_small"; SMALLARG="--small"; fi
PROBE=$("$PYTHON" -c "
import sys, torch
try:
    import triton; tv = triton.__version__
except Exception:
    tv = 'not importable'
cuda = torch.cuda.is_available()
print(int(cuda))
print(torch.cuda.get_device_name() if cuda else 'cpu (no CUDA)')
print(f'python {sys.version.split()[0]}, torch {torch.__version__}, triton {tv}')" 2>&1)
HAS_CUDA=$(echo "$PROBE" | sed -n 1p)
DEVICE=$(echo "$PROBE" | sed -n 2p)
VERSIONS=$(echo "$PROBE" | sed -n 3p)
if [ "$HAS_CUDA" != 1 ]; then export TRITON_INTERPRET=1; fi
REPORT="$OUT/gpu_check$SUFFIX.md"

section() {  # section NAME TIMEOUT_S CMD...: run, keep status, time and output tail
  local name="$1" limit="$2"; shift 2
  local t0=$(date +%s) rc
  # cwd outside the repository: `python -m` puts the cwd first on sys.path, and the repository's own latentlm/
  # (without models/ etc.) would shadow the assembled package
  (cd "$WORK/run" && timeout --kill-after=10 "$limit" "$@") > "$WORK/$name.log" 2>&1
  rc=$?
  local dt=$(( $(date +%s) - t0 ))
  local status="ok"
  [ $rc -ne 0 ] && status="FAILED (exit $rc)" && ANY_FAILED=1
  [ $rc -eq 124 ] && status="TIMED OUT after ${limit} s"
  echo "== $name: $status, ${dt} s" >&2
  {
    echo ""
    echo "## $name: $status (${dt} s)"
    echo ""
    echo '```'
    tail -n "${TAIL_LINES:-40}" "$WORK/$name.log"
    echo '```'
  } >> "$WORK/sections.md"
  return 0
}

: > "$WORK/sections.md"
ANY_FAILED=0  # every section runs; the script's exit status says whether one failed
mkdir -p "$WORK/run"
# (a) tests: on CUDA the compiled kernels (and the `cuda` tests); on CPU the interpreter
PYTHONPATH="$SVC_PATH" section "a-tests" "$LIM_A" "$PYTHON" -m pytest "$ROOT/tests/models/test_triton.py" "$ROOT/tests/models/test_backend_cuda.py" --rootdir "$ROOT" -q -rs \
  -p no:cacheprovider --import-mode=importlib
# (b) kernels next to the yardstick
if [ -f "$YARD" ]; then
  TAIL_LINES=70 section "b-bench" "$LIM_B" "$PYTHON" "$ROOT/bench/gpu_bench.py" $SMALLARG --yardstick "$YARD" --deadline-s $((LIM_B - 40)) \
    --out "$OUT/gpu_bench$SUFFIX.md" --json "$OUT/gpu_bench$SUFFIX.jsonl"
else
  printf '\n## b-bench: skipped: no yardstick at %s (pass --yardstick PATH)\n' "$YARD" >> "$WORK/sections.md"
fi
# (c) the service under load
if PYTHONPATH="$SVC_PATH" "$PYTHON" -c "import fastapi, uvicorn, pydantic, httpx" 2>"$WORK/fastapi.err"; then
  PYTHONPATH="$SVC_PATH" section "c-service" "$LIM_C" "$PYTHON" "$ROOT/bench/gpu_bench.py" $SMALLARG --mode service \
    --json "$OUT/gpu_service$SUFFIX.jsonl"
  # one sentence per request from 4 API workers, batched on the device by the engine process (service/engine.py)
  PYTHONPATH="$SVC_PATH" section "c-engine" "$LIM_C" "$PYTHON" "$ROOT/bench/gpu_bench.py" $SMALLARG --mode service \
    --engine process --workers 4 --seqs-per-request 1 --no-job --json "$OUT/gpu_engine$SUFFIX.jsonl"
else
  printf '\n## c-service: skipped: no fastapi (%s)\n' "$(tail -1 "$WORK/fastapi.err")" >> "$WORK/sections.md"
fi
# (d) onnxruntime CUDA provider parity
section "d-onnx" "$LIM_D" "$PYTHON" "$ROOT/bench/gpu_bench.py" $SMALLARG --mode onnx

T_END=$(date +%s)
{
  echo "# GPU check ($DEVICE)"
  echo ""
  echo "date $(date -u +%Y-%m-%dT%H:%MZ), $VERSIONS; \`bash bench/gpu_check.sh${SMALLARG:+ $SMALLARG}\`, total $((T_END - T_START)) s."
  echo "Yardstick: \`$YARD\`. Service wheels: $WHEELS. TRITON_INTERPRET=${TRITON_INTERPRET:-0}."
  if [ -f "$OUT/gpu_bench$SUFFIX.md" ] && [ "$(find "$OUT/gpu_bench$SUFFIX.md" -newermt "@$T_START" 2>/dev/null)" ]; then
    echo ""
    echo "Kernel benchmark table: \`gpu_bench$SUFFIX.md\` (below)."
    echo ""
    sed -n '3,$p' "$OUT/gpu_bench$SUFFIX.md"
  fi
  cat "$WORK/sections.md"
} > "$REPORT"
echo "wrote $REPORT" >&2
rm -rf "$WORK"
exit $ANY_FAILED
