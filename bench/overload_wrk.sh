#!/usr/bin/env bash
# Overload: wrk at 256 connections on POST /v1/score against a real `latentlm serve` (CPU, no Redis, log level
# info as the README starts it) on a 256-state HMM (V = 10,000, 50-token inputs as ids), once with the default
# settings and once with LATENTLM_MAX_QUEUE=8. Every answer is counted by status; a 429/503 without Retry-After,
# a socket error or a request still unanswered after 10 s (wrk's --timeout) is a failure of the server's promise.
#
#   bash bench/overload_wrk.sh              # this checkout
#   BEFORE=1 bash bench/overload_wrk.sh     # the app served as `latentlm serve` did before service/server.py:
#                                           # plain uvicorn.run (uvloop accepting one connection per loop
#                                           # iteration, every refusal access-logged), in-flight limit lifted
#   DURATION=20 CONNECTIONS=256 RUNS=2 ...  # (the defaults)
#
# Prints, per configuration and run: answers by status, answers without Retry-After, socket errors and timeouts,
# wrk's latency percentiles (every answer, refusals included), the server's own counts (latentlm_errors_total by
# type) and its peak of open connections / requests in flight (sampled every 0.5 s). Needs `wrk`. Answers per second
# differ between server processes on a shared machine (each calibrates its engines under that load); compare
# tails, unanswered requests and Retry-After, not throughput, across configurations.
set -euo pipefail
HERE="$(cd "$(dirname "$0")/.." && pwd)"
PY="$HERE/.venv/bin/python"
PORT="${PORT:-8791}"
DURATION="${DURATION:-20}"
CONNECTIONS="${CONNECTIONS:-256}"
RUNS="${RUNS:-2}"
WORK="$(mktemp -d)"
SERVER=""
trap '[ -n "$SERVER" ] && kill "$SERVER" 2>/dev/null; rm -rf "$WORK"' EXIT
. "$HERE/bench/serve_lib.sh"
hmm256_store "$PY" "$WORK/store"

cat > "$WORK/count.lua" <<'LUAEOF'
local threads = {}
function setup(thread) table.insert(threads, thread) end
function init(args)
  math.randomseed(1)
  local ids = {}
  for i = 1, 50 do ids[i] = tostring(math.random(0, 9999)) end
  wrk.method = "POST"
  wrk.body = '{"model":"hmm256","input":[[' .. table.concat(ids, ",") .. ']]}'
  wrk.headers["Content-Type"] = "application/json"
  c200, c429, c503, cother, noretry = 0, 0, 0, 0, 0
end
function response(status, headers, body)
  if status == 200 then c200 = c200 + 1
  elseif status == 429 then c429 = c429 + 1
  elseif status == 503 then c503 = c503 + 1
  else cother = cother + 1 end
  if status ~= 200 and headers["Retry-After"] == nil and headers["retry-after"] == nil then
    noretry = noretry + 1
  end
end
function done(summary, latency, requests)
  local t = {c200 = 0, c429 = 0, c503 = 0, cother = 0, noretry = 0}
  for _, th in ipairs(threads) do
    for k, _ in pairs(t) do t[k] = t[k] + th:get(k) end
  end
  local e = summary.errors
  io.write(string.format("answers: 200=%d 429=%d 503=%d other=%d; without Retry-After: %d; socket errors: " ..
    "connect %d, read %d, write %d; unanswered after 10 s: %d; %.0f answers/s\n", t.c200, t.c429, t.c503, t.cother,
    t.noretry, e.connect, e.read, e.write, e.timeout, summary.requests / (summary.duration / 1e6)))
  io.write(string.format("latency (every answer): p50 %.0f ms, p90 %.0f ms, p99 %.0f ms, max %.0f ms\n",
    latency:percentile(50) / 1000, latency:percentile(90) / 1000, latency:percentile(99) / 1000,
    latency.max / 1000))
end
LUAEOF

cat > "$WORK/before.py" <<'PYEOF'
# the previous `latentlm serve`: plain uvicorn.run on the same app (uvloop, one accept per loop iteration)
import sys
import latentlm
latentlm.huge_pages()  # as `latentlm serve` does, before torch is imported
import uvicorn
from latentlm.service.app import create_app
from latentlm.service.settings import Settings
from latentlm.service.transport import CoalescingHttpToolsProtocol
settings = Settings.from_env(store=sys.argv[1], device="cpu")
sys.setswitchinterval(settings.gil_switch_interval_ms / 1000)
uvicorn.run(create_app(settings), host="127.0.0.1", port=int(sys.argv[2]), log_level="info",
            timeout_graceful_shutdown=int(settings.shutdown_grace_s) + 10, http=CoalescingHttpToolsProtocol,
            access_log=True, server_header=False)
PYEOF

gauge() {  # gauge NAME: its value in /metrics now
  curl -s "http://127.0.0.1:$PORT/metrics" | awk -v n="$1" '$1 == n {print $2}'
}

run_config() {  # run_config LABEL [VAR=VALUE ...]
  local label="$1"; shift
  if [ -n "${BEFORE:-}" ]; then
    env -u REDIS_URL "$@" LATENTLM_MAX_INFLIGHT=1000000 "$PY" "$WORK/before.py" "$WORK/store" "$PORT" \
      >"$WORK/server.log" 2>&1 &
  else
    env -u REDIS_URL "$@" "$PY" -m latentlm.cli serve --store "$WORK/store" --port "$PORT" --device cpu \
      >"$WORK/server.log" 2>&1 &
  fi
  SERVER=$!
  for _ in $(seq 900); do curl -sf "http://127.0.0.1:$PORT/ready" >/dev/null 2>&1 && break; sleep 0.2; done
  curl -sf "http://127.0.0.1:$PORT/ready" >/dev/null || { cat "$WORK/server.log"; exit 1; }
  echo "== $label${BEFORE:+ (before)}: ${*:-default settings}; load average $(cut -d' ' -f1-3 /proc/loadavg)"
  wrk -t2 -c64 -d3s -s "$WORK/count.lua" "http://127.0.0.1:$PORT/v1/score" >/dev/null  # warm-up
  for run in $(seq "$RUNS"); do
    local peak_c=0 peak_i=0
    ( while sleep 0.5; do echo "$(gauge latentlm_open_connections) $(gauge latentlm_inflight_requests)"; done ) \
      >"$WORK/gauges" 2>/dev/null &
    local sampler=$!
    wrk -t2 -c"$CONNECTIONS" -d"${DURATION}s" --timeout 10s -s "$WORK/count.lua" \
      "http://127.0.0.1:$PORT/v1/score" | grep -E "^(answers|latency)"
    kill "$sampler" 2>/dev/null || true
    wait "$sampler" 2>/dev/null || true
    read -r peak_c peak_i < <(awk '$1 != "" {if ($1 > c) c = $1; if ($2 > i) i = $2} END {print c + 0, i + 0}' \
      "$WORK/gauges")
    echo "server (since start): $(curl -s "http://127.0.0.1:$PORT/metrics" | awk '/^latentlm_errors_total/ {printf "%s ", $0}')"
    echo "server peaks (0.5 s samples): open connections $peak_c, requests in flight $peak_i"
  done
  kill "$SERVER"; wait "$SERVER" 2>/dev/null || true; SERVER=""
  echo "tracebacks in the server log: $(grep -c "Traceback" "$WORK/server.log" || true)"
}

echo "== $(lscpu | grep 'Model name' | sed 's/ \+/ /g'), $(nproc) cores; repo $(git -C "$HERE" rev-parse --short HEAD); wrk -t2 -c$CONNECTIONS -d${DURATION}s --timeout 10s"
run_config "defaults"
run_config "small queue" LATENTLM_MAX_QUEUE=8
