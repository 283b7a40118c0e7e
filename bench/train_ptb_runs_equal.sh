#!/usr/bin/env bash
# Same-state-count PTB runs for results/ptb_results.md: a scalar HMM at 1,024 states (Baum-Welch) next to
# ptb-blocked-1k / ptb-rank-1k, and a blocked and a rank-space HMM at 256 states next to ptb-hmm-256*.
# One thread, nice, one run at a time, like bench/train_ptb_runs.sh.
# Usage: bench/train_ptb_runs_equal.sh STORE [1|2|3]   (stage; all by default; then: python
#        bench/train_ptb_table.py STORE). Stage 2 continues ptb-hmm-1k from its checkpoint with --resume.
# Timing that fixed the schedule (2-core CPU sandbox, 2026-11-26): one EM iteration at 1,024 states on
# 5,000 training sentences took 12.6 s on 1 thread and 20.5 s on 2 (the second core was busy), so a full
# iteration is ~110 s on 1 thread: 12 iterations ~ 22-25 min.
set -u
STORE=${1:-/tmp/ptb-results}
STAGE=${2:-all}
source "$(dirname "$0")/train_ptb_lib.sh"
if [ "$STAGE" = all ] || [ "$STAGE" = 1 ]; then
run ptb-hmm-1k --family hmm --states 1024 --epochs 12 --batch 512 --init-noise 3
# 32 clusters x 8 states: state dropout 0.5 keeps 4 states per cluster (128 x 2 would keep 1, i.e. train a
# class-bigram model), and every word can still be emitted by 8 states.
run ptb-blocked-256 --family blocked_hmm --states 256 --clusters 32 --hidden 128 --epochs 3 --batch 64 \
    --lr 0.01 --eval-every 300
# rank 64 = states / 4, the ratio of ptb-rank-1k / -4k (256 / 1,024) and of Yang et al. (4,096 / 16,384).
run ptb-rank-256 --family rank_hmm --states 256 --rank 64 --hidden 128 --epochs 3 --batch 64 --lr 0.01 \
    --eval-every 300
echo "== done equal $(date -u +%FT%TZ)" >> "$STORE/logs/runs.txt"
fi
if [ "$STAGE" = all ] || [ "$STAGE" = 2 ]; then
# 256 states, longer: 10 epochs ~ the time of ptb-hmm-256-em25 (323 s); and 128 clusters x 2 states without
# state dropout (with k = 2, lambda = 0.5 would keep one state per cluster, a class-bigram model).
run ptb-blocked-256-m128 --family blocked_hmm --states 256 --clusters 128 --hidden 128 --epochs 3 --batch 64 \
    --lr 0.01 --eval-every 300 --state-dropout 0
run ptb-blocked-256-e10 --family blocked_hmm --states 256 --clusters 32 --hidden 128 --epochs 10 --batch 64 \
    --lr 0.01 --eval-every 300
run ptb-rank-256-e10 --family rank_hmm --states 256 --rank 64 --hidden 128 --epochs 10 --batch 64 --lr 0.01 \
    --eval-every 300
# ptb-hmm-1k continued from its iteration-12 checkpoint to 20 EM iterations (a copy, so ptb-hmm-1k stays).
rm -rf "$STORE/.train/ptb-hmm-1k-em20"
cp -r "$STORE/.train/ptb-hmm-1k" "$STORE/.train/ptb-hmm-1k-em20"
run ptb-hmm-1k-em20 --family hmm --states 1024 --epochs 20 --batch 512 --init-noise 3 --resume
echo "== done equal stage 2 $(date -u +%FT%TZ)" >> "$STORE/logs/runs.txt"
fi
if [ "$STAGE" = all ] || [ "$STAGE" = 3 ]; then
# Which constraint costs at 256 states: 32 x 8 without state dropout, and the rank-space HMM at full rank.
run ptb-blocked-256-nodrop --family blocked_hmm --states 256 --clusters 32 --hidden 128 --epochs 3 --batch 64 \
    --lr 0.01 --eval-every 300 --state-dropout 0
run ptb-rank-256-r256 --family rank_hmm --states 256 --rank 256 --hidden 128 --epochs 3 --batch 64 --lr 0.01 \
    --eval-every 300
echo "== done equal stage 3 $(date -u +%FT%TZ)" >> "$STORE/logs/runs.txt"
fi
