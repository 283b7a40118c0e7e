#!/usr/bin/env bash
# Second batch of PTB runs (larger state counts, longer schedules) after bench/train_ptb_runs.sh.
set -u
STORE=${1:-/tmp/ptb-results}
source "$(dirname "$0")/train_ptb_lib.sh"
run ptb-rank-4k --family rank_hmm --states 4096 --rank 256 --hidden 128 --epochs 8 --batch 64 --lr 0.01 \
    --eval-every 330
run ptb-blocked-4k --family blocked_hmm --states 4096 --clusters 128 --hidden 128 --epochs 6 --batch 128 \
    --lr 0.01 --eval-every 165
run ptb-densehmm-128-em40 --family densehmm --fit em --states 128 --hidden 64 --epochs 40 --batch 512 --lr 0.05
run ptb-densehmm-128-cooc --family densehmm --fit cooc --states 128 --hidden 64 --epochs 30 --batch 512 --lr 0.02
echo "== done large $(date -u +%FT%TZ)" >> "$STORE/logs/runs.txt"
