#!/usr/bin/env bash
# POST /v1/score throughput measured by wrk (an outside C load generator) against a real `latentlm serve`
# with its default settings (default logging included), on a 256-state HMM with V = 10,000 and 50-token
# inputs (token ids), one input per request, 64 connections, 20 s.
#
#   bash bench/service_wrk.sh [REPO_DIR] [PORT]     # REPO_DIR: a checkout to serve (default: this one)
#   STORE=DIR MODEL=NAME bash bench/service_wrk.sh  # instead: model NAME of store DIR (a trained one; its
#                                                   # vocabulary must have at least 10,000 words)
#
# Prints wrk's summary; the README quotes its Requests/sec x 50 as tokens/s. Needs `wrk` (Debian package).
set -euo pipefail
HERE="$(cd "$(dirname "$0")/.." && pwd)"
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
cat > "$WORK/post.lua" <<'LUAEOF'
math.randomseed(1)
local ids = {}
for i = 1, 50 do ids[i] = tostring(math.random(0, 9999)) end
wrk.method = "POST"
wrk.body = '{"model":"MODEL_NAME","input":[[' .. table.concat(ids, ",") .. ']]}'
wrk.headers["Content-Type"] = "application/json"
function response(status, headers, body)
  if status ~= 200 then io.stderr:write("status " .. status .. ": " .. body .. "\n") end
end
LUAEOF
sed -i "s/MODEL_NAME/$MODEL/" "$WORK/post.lua"
cd "$REPO"
serve_store "$PY" "$STORE" "$PORT" "$WORK/server.log"
echo "== $(lscpu | grep 'Model name' | sed 's/ \+/ /g'), $(nproc) cores; repo $(git -C "$REPO" rev-parse --short HEAD); model $MODEL"
wrk -t1 -c64 -d5s -s "$WORK/post.lua" "http://127.0.0.1:$PORT/v1/score" >/dev/null  # warm-up
wrk -t1 -c64 -d20s --latency -s "$WORK/post.lua" "http://127.0.0.1:$PORT/v1/score"
