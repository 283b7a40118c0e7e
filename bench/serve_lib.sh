# Shared by bench/service_wrk.sh and bench/soak.sh (source it): the benchmark model and a served store.

# hmm256_store PY DIR: a 256-state random HMM (V = 10,000, token ids as words) saved as "hmm256" in store DIR.
hmm256_store() {
  "$1" - "$2" <<'PYEOF'
import sys
from latentlm.models.registry import save_artifact
from latentlm.models.synthetic import random_hmm
from latentlm.models.vocab import Preprocessing, Vocabulary
tensors, config = random_hmm(256, 10000, seed=0)
V = Vocabulary([f"w{i}" for i in range(10000)], Preprocessing(lowercase=False, unk=None, eos=None, add_eos=False))
save_artifact(sys.argv[1], "hmm256", "hmm", tensors, V, config=config)
PYEOF
}

# serve_store PY STORE PORT LOG: `latentlm serve` (default settings, CPU, no Redis) in the background, from the
# current directory's checkout; sets SERVER to its pid and returns once /ready answers (exits 1 with the log if
# it never does).
serve_store() {
  env -u REDIS_URL "$1" -m latentlm.cli serve --store "$2" --port "$3" --device cpu >"$4" 2>&1 &
  SERVER=$!
  for _ in $(seq 900); do
    curl -sf "http://127.0.0.1:$3/ready" >/dev/null 2>&1 && return 0
    sleep 0.2
  done
  cat "$4"
  exit 1
}
