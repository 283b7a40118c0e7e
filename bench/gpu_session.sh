#!/usr/bin/env bash
# Everything a short GPU loan is for, in one command within a wall-clock budget, into one folder that holds at
# most 8 files (what such a machine can bring back):
#   (1) bench/gpu_check.sh with shortened section limits (tests, kernels next to the yardstick, service, onnx);
#   (2) bench/gpu_train.sh with the time that is left (the paper-scale rank-space HMM by default), its best
#       parameters in float16 shards of at most 15 MiB;
#   (3) OUT/gpu_check.md, OUT/gpu_train.md, OUT/files.tgz (every other report, log, JSON and the checkpoint's
#       index and state) and OUT/checkpoint/checkpoint-*.safetensors.
# Rebuild the trained artifact here: tar xzf OUT/files.tgz -C OUT, then bench/gpu_params.py unpack OUT/checkpoint
# STORE gpu-train, then `latentlm train --config CONFIG --name gpu-train --store STORE --resume --export-only`.
#
#   bash bench/gpu_session.sh [--budget-s 570] [--check-limits "80 170 80 20"] [--small] [--no-check]
#        [--config FILE] [--evals "valid test valid-running"] [--reserve-s 180] OUT
#
# --small: both scripts' --small modes on the CPU (checks this script end to end; CI runs it); budget 1800 s.
# --no-check: instead of (1), only the yardsticks in bench/.yardstick/ (gpu_yardstick.py, and gpu_vlhmm_train.py
#   or gpu_rank_train.py when there), each under 90 s, bench/gpu_train_step.py --profile (latentlm's VL-HMM
#   step at gpu_vlhmm_train.py's shapes, and where its device time goes) and bench/distributed.py --device cuda (one
#   GPU rank under torchrun against one process, under 240 s), into OUT/yardstick.txt: the rest of the budget goes
#   to training.
# --config, --evals: passed to bench/gpu_train.sh (which model, which evaluations).
# --reserve-s: seconds of the budget kept for export, evaluations and packing after training (default 180).
# Exit status: 0 when every stage ran and succeeded, 1 otherwise (the files of the stages that ran are kept).
set -u
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUDGET=""
LIMITS=""
SMALL=()
OUT=""
CHECK=1
TRAIN_ARGS=()
RESERVE=180
while [ $# -gt 0 ]; do
  case "$1" in
    --budget-s) BUDGET="$2"; shift ;;
    --check-limits) LIMITS="$2"; shift ;;
    --small) SMALL=(--small) ;;
    --no-check) CHECK=0 ;;
    --reserve-s) RESERVE="$2"; shift ;;
    --config|--evals) TRAIN_ARGS+=("$1" "$2"); shift ;;
    -h|--help) sed -n '2,23p' "$0"; exit 0 ;;
    -*) echo "gpu_session.sh: unknown option $1" >&2; exit 2 ;;
    *) OUT="$1" ;;
  esac
  shift
done
[ -n "$OUT" ] || { echo "gpu_session.sh: give the output folder" >&2; exit 2; }
# --small (CI on a CPU) spends no device time: a wide budget, so a slow machine's cold start cannot skip training
if [ -z "$BUDGET" ]; then if [ ${#SMALL[@]} = 0 ]; then BUDGET=570; else BUDGET=1800; fi; fi
# on a GPU the check's sections are cut short to leave time for training; --small keeps gpu_check.sh's own limits
# (the Triton interpreter on a CPU is slow)
if [ -z "$LIMITS" ] && [ ${#SMALL[@]} = 0 ]; then LIMITS="80 170 80 20"; fi
if [ -n "$LIMITS" ]; then export GPU_CHECK_LIMITS="$LIMITS"; fi
T0=$(date +%s)
STAGE="$(mktemp -d /tmp/latentlm-session.XXXXXX)"
mkdir -p "$OUT" "$STAGE/check" "$STAGE/train"
elapsed() { echo $(( $(date +%s) - T0 )); }

# (1) the check; its report is copied out at once, so it comes back even if a later stage runs out of time
if [ "$CHECK" = 1 ]; then
  bash "$ROOT/bench/gpu_check.sh" "${SMALL[@]}" --out "$STAGE/check"
  RC=$?
  cp "$STAGE/check"/gpu_check*.md "$OUT/" 2>/dev/null
else  # the yardsticks alone: what the training figures are reported against, in the same call
  PY="${PYTHON:-python3}"
  { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
    "$PY" -c "import torch; print('torch', torch.__version__)" 2>/dev/null
    for y in gpu_yardstick.py gpu_vlhmm_train.py gpu_rank_train.py; do
      [ -f "$ROOT/bench/.yardstick/$y" ] || continue
      [ ${#SMALL[@]} = 0 ] || { echo "## $y: not run (--small: the yardsticks need a GPU)"; continue; }
      echo "## $y"
      timeout 90 "$PY" "$ROOT/bench/.yardstick/$y" 2>&1 | tail -n 20
    done
    # latentlm's own VL-HMM training step at the yardstick's shapes (tiny on the CPU with --small)
    echo "## bench/gpu_train_step.py"
    PROBE=(--profile)
    [ ${#SMALL[@]} = 0 ] || PROBE=(--states 1024 --batches 16 --steps 1 --device cpu)
    ( . "$ROOT/bench/gpu_env.sh"; timeout 120 "$PYTHON" "$ROOT/bench/gpu_train_step.py" "${PROBE[@]}" 2>&1 \
        | grep -v -i warn | tail -n 30; rm -rf "$WORK" )
    # data-parallel: one GPU rank under torchrun against the single-process run (40 steps each, issue's figure)
    echo "## bench/distributed.py --device cuda"
    if [ ${#SMALL[@]} = 0 ]; then
      ( . "$ROOT/bench/gpu_env.sh"; timeout 240 "$PYTHON" "$ROOT/bench/distributed.py" --device cuda --workloads vlhmm \
          --steps 40 --repeats 1 --out "$STAGE/check/distributed.md" 2>&1 | tail -n 4; rm -rf "$WORK" )
      cat "$STAGE/check/distributed.md" 2>/dev/null
    else
      echo "not run (--small: it compares GPU runs)"
    fi
    } > "$STAGE/check/yardstick.txt"
  RC=0
  cp "$STAGE/check/yardstick.txt" "$OUT/"
fi
FAILED=$(( RC != 0 ))
echo "gpu_session: check finished after $(elapsed) s (exit $RC)" | tee "$STAGE/session.log"
tar czf "$OUT/files.tgz" -C "$STAGE" check session.log

# (2) training in what is left (its time limit counts data preparation): RESERVE s stay for export, evaluations
# and packing
LEFT=$(( BUDGET - $(elapsed) - RESERVE ))
if [ "$LEFT" -lt 45 ]; then
  echo "gpu_session: only $LEFT s left for training; skipped" | tee -a "$STAGE/session.log"
  FAILED=1
else
  MIN=$(python3 -c "print(round($LEFT / 60, 2))")
  echo "gpu_session: training for $MIN minutes" | tee -a "$STAGE/session.log"
  bash "$ROOT/bench/gpu_train.sh" "${SMALL[@]}" "${TRAIN_ARGS[@]}" --minutes "$MIN" --out "$STAGE/train"
  RC=$?
  [ "$RC" = 0 ] || FAILED=1
  echo "gpu_session: training finished after $(elapsed) s (exit $RC)" | tee -a "$STAGE/session.log"
  cp "$STAGE/train/gpu_train.md" "$STAGE/train/curve.png" "$OUT/" 2>/dev/null
  if ls "$STAGE/train/checkpoint"/checkpoint-*.safetensors > /dev/null 2>&1; then
    mkdir -p "$OUT/checkpoint"
    mv "$STAGE/train/checkpoint"/checkpoint-*.safetensors "$OUT/checkpoint/"
  fi
fi
tar czf "$OUT/files.tgz" -C "$STAGE" check train session.log
ls -la "$OUT" "$OUT/checkpoint" 2>/dev/null
rm -rf "$STAGE"
exit "$FAILED"
