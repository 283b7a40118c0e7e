#!/usr/bin/env bash
# POST /v1/score throughput measured by wrk (an outside C load generator) against a real `latentlm serve`
# with its default settings (default logging included), on a 256-state HMM with V = 10,000 and 50-token
# inputs (token ids), one input per request, 64 connections, 20 s.
#
#   bash bench/service_wrk.sh [REPO_DIR] [PORT]     # REPO_DIR: a checkout to serve (default: this one)
#   STORE=DIR MODEL=NAME bash bench/service_wrk.sh  # instead: model NAME of store DIR (a trained one; its
#                                                   # vocabulary must have at least 10,000 words)
#   BODIES=N bash bench/service_wrk.sh             # N different inputs, taken in turn (default 1: every
#                                                   # request the same 50 ids, so a model's parameters for
#                                                   # them stay in the CPU's caches)
#
#   bash bench/service_wrk.sh --workloads --store DIR [--model ptb-hmm] [--workers 1,2] [--duration 15]
#                                                   # the three workloads (one sentence per request at c=1 and
#                                                   # c=64, 64 sentences per request at c=4) against the same
#                                                   # inputs scored in process, per worker count, appended to
#                                                   # bench/results/service_wrk.md (bench/service_workloads.py)
#
# Prints wrk's summary; the README quotes its Requests/sec x 50 as tokens/s. Needs `wrk` (Debian package).
set -euo pipefail
HERE="$(cd "$(dirname "$0")/.." && pwd)"
if [ "${1:-}" = "--workloads" ]; then
  shift
  exec "$HERE/.venv/bin/python" "$HERE/bench/service_workloads.py" "$@"
fi
REPO="${1:-$HERE}"
PORT="${2:-8765}"
PY="$HERE/.venv/bin/python"
WORK="$(mktemp -d)"
trap 'kill $SERVER 2>/dev/null || true; rm -rf "$WORK"' EXIT

# the model, written by this checkout's code (the store format is shared by both layouts)
. "$HERE/bench/serve_lib.sh"
MODEL="${MODEL:-hmm256}"
if [ -z "${STORE:-}" ]; then
  STORE="$WORK/store"
  hmm256_store "$PY" "$STORE"
fi
BODIES="${BODIES:-1}"
cat > "$WORK/post.lua" <<'LUAEOF'
math.randomseed(1)
local bodies = {}
for b = 1, BODY_COUNT do
  local ids = {}
  for i = 1, 50 do ids[i] = tostring(math.random(0, 9999)) end
  bodies[b] = '{"model":"MODEL_NAME","input":[[' .. table.concat(ids, ",") .. ']]}'
end
wrk.method = "POST"
wrk.body = bodies[1]
wrk.headers["Content-Type"] = "application/json"
local next_body = 0
if BODY_COUNT > 1 then
  function request()
    next_body = next_body % BODY_COUNT + 1
    return wrk.format(nil, nil, nil, bodies[next_body])
  end
end
function response(status, headers, body)
  if status ~= 200 then io.stderr:write("status " .. status .. ": " .. body .. "\n") end
end
LUAEOF
sed -i "s/MODEL_NAME/$MODEL/; s/BODY_COUNT/$BODIES/g" "$WORK/post.lua"
cd "$REPO"
serve_store "$PY" "$STORE" "$PORT" "$WORK/server.log"
echo "== $(lscpu | grep 'Model name' | sed 's/ \+/ /g'), $(nproc) cores; repo $(git -C "$REPO" rev-parse --short HEAD); model $MODEL; $BODIES different input(s)"
wrk -t1 -c64 -d5s -s "$WORK/post.lua" "http://127.0.0.1:$PORT/v1/score" >/dev/null  # warm-up
wrk -t1 -c64 -d20s --latency -s "$WORK/post.lua" "http://127.0.0.1:$PORT/v1/score"
