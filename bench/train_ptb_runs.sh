#!/usr/bin/env bash
# PTB results runs for results/ptb_results.md (2-core CPU, shared): one thread, nice, one run at a time.
# Usage: bench/train_ptb_runs.sh STORE   (then: python bench/train_ptb_table.py STORE)
set -u
STORE=${1:-/tmp/ptb-results}
mkdir -p "$STORE/logs"
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
run() {  # name, args...
  local name=$1; shift
  echo "== $name $(date -u +%FT%TZ)" >> "$STORE/logs/runs.txt"
  /usr/bin/time -f "%e s wall %U s user" -o "$STORE/logs/$name.time" \
    nice -n 10 latentlm train --name "$name" --store "$STORE" --data ptb --no-progress "$@" \
    > "$STORE/logs/$name.log" 2>&1
  for split in valid test; do
    nice -n 10 latentlm eval --model "$name" --data "ptb:$split" --store "$STORE" >> "$STORE/logs/$name.eval" 2>&1
  done
}
run ptb-blocked-1k --family blocked_hmm --states 1024 --clusters 128 --hidden 128 --epochs 3 --batch 64 \
    --lr 0.01 --eval-every 300
run ptb-rank-1k --family rank_hmm --states 1024 --rank 256 --hidden 128 --epochs 3 --batch 64 --lr 0.01 \
    --eval-every 300
run ptb-densehmm-128 --family densehmm --fit em --states 128 --hidden 64 --epochs 6 --batch 512 --lr 0.05
run ptb-hmm-256 --family hmm --states 256 --epochs 15 --batch 512 --init-noise 3
echo "== done $(date -u +%FT%TZ)" >> "$STORE/logs/runs.txt"
