# Shared by the bench/train_ptb_runs*.sh scripts (source it after setting STORE): one thread, nice, logs.
mkdir -p "$STORE/logs"
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
run() {  # name, train args...: train NAME into $STORE, then evaluate it on PTB valid and test
  local name=$1; shift
  echo "== $name $(date -u +%FT%TZ)" >> "$STORE/logs/runs.txt"
  /usr/bin/time -f "%e s wall %U s user" -o "$STORE/logs/$name.time" \
    nice -n 10 latentlm train --name "$name" --store "$STORE" --data ptb --no-progress "$@" \
    > "$STORE/logs/$name.log" 2>&1
  for split in valid test; do
    nice -n 10 latentlm eval --model "$name" --data "ptb:$split" --store "$STORE" >> "$STORE/logs/$name.eval" 2>&1
  done
}
