#!/usr/bin/env bash
# PTB results runs for results/ptb_results.md (2-core CPU, shared): one thread, nice, one run at a time.
# Usage: bench/train_ptb_runs.sh STORE   (then: python bench/train_ptb_table.py STORE)
set -u
STORE=${1:-/tmp/ptb-results}
source "$(dirname "$0")/train_ptb_lib.sh"
run ptb-blocked-1k --family blocked_hmm --states 1024 --clusters 128 --hidden 128 --epochs 3 --batch 64 \
    --lr 0.01 --eval-every 300
run ptb-rank-1k --family rank_hmm --states 1024 --rank 256 --hidden 128 --epochs 3 --batch 64 --lr 0.01 \
    --eval-every 300
run ptb-densehmm-128 --family densehmm --fit em --states 128 --hidden 64 --epochs 6 --batch 512 --lr 0.05
run ptb-hmm-256 --family hmm --states 256 --epochs 15 --batch 512 --init-noise 3
echo "== done $(date -u +%FT%TZ)" >> "$STORE/logs/runs.txt"
