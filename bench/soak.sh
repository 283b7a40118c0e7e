#!/usr/bin/env bash
# Soak: a real `latentlm serve` (default settings, no Redis) under wrk at concurrency 64 for DURATION seconds
# with a mix of operations (score, posterior top_k 3, Viterbi decode, a short sample; 50-token inputs on a
# 256-state HMM, V = 10,000), sampling the server's resident memory, open file descriptors and threads every
# 30 s. Errors are 5xx answers and socket errors; 429 (load shed) is counted apart.
#
#   bash bench/soak.sh [DURATION_S] [OUT.md] [PORT]     # default 1800 s, bench/results/soak.md
#
# Needs `wrk` (Debian package).
set -euo pipefail
HERE="$(cd "$(dirname "$0")/.." && pwd)"
DURATION="${1:-1800}"
OUT="${2:-$HERE/bench/results/soak.md}"
PORT="${3:-8766}"
PY="$HERE/.venv/bin/python"
WORK="$(mktemp -d)"
trap 'kill $SERVER 2>/dev/null || true; rm -rf "$WORK"' EXIT

. "$HERE/bench/serve_lib.sh"
hmm256_store "$PY" "$WORK/store"
cat > "$WORK/mix.lua" <<'LUAEOF'
math.randomseed(7)
local function ids()
  local t = {}
  for i = 1, 50 do t[i] = tostring(math.random(0, 9999)) end
  return "[[" .. table.concat(t, ",") .. "]]"
end
local calls = {
  {"/v1/score", function() return '{"model":"hmm256","input":' .. ids() .. '}' end},
  {"/v1/posterior", function() return '{"model":"hmm256","input":' .. ids() .. ',"top_k":3}' end},
  {"/v1/decode", function() return '{"model":"hmm256","method":"viterbi","input":' .. ids() .. '}' end},
  {"/v1/sample", function() return '{"model":"hmm256","n":2,"max_tokens":20,"seed":' .. math.random(0, 1000000) .. '}' end},
}
local n = 0
request = function()
  n = n + 1
  local c = calls[(n % #calls) + 1]
  return wrk.format("POST", c[1], {["Content-Type"] = "application/json"}, c[2]())
end
response = function(status, headers, body)
  if status ~= 200 then io.stderr:write("status " .. status .. "\n") end
end
LUAEOF
serve_store "$PY" "$WORK/store" "$PORT" "$WORK/server.log"
PID=$SERVER
sample() {  # elapsed_s rss_mib fds threads
  local rss fds thr
  rss=$(awk '/^VmRSS:/{printf "%.0f", $2/1024}' "/proc/$PID/status")
  fds=$(ls "/proc/$PID/fd" | wc -l)
  thr=$(awk '/^Threads:/{print $2}' "/proc/$PID/status")
  echo "$1 $rss $fds $thr"
}
wrk -t1 -c64 -d5s -s "$WORK/mix.lua" "http://127.0.0.1:$PORT" >/dev/null 2>&1  # warm-up
sample 0 >"$WORK/samples"
START=$(date +%s)
wrk -t1 -c64 -d"${DURATION}s" --timeout 30s --latency -s "$WORK/mix.lua" "http://127.0.0.1:$PORT" \
  >"$WORK/wrk.out" 2>"$WORK/wrk.err" &
WRK=$!
while kill -0 $WRK 2>/dev/null; do
  sleep 30
  kill -0 "$PID" 2>/dev/null || { echo "server died"; cat "$WORK/server.log"; exit 1; }
  sample $(( $(date +%s) - START )) >>"$WORK/samples"
done
wait $WRK || true
sleep 5
sample "$(( $(date +%s) - START )) (idle)" >>"$WORK/samples"
non200=$(grep -c '^status' "$WORK/wrk.err" || true)
shed=$(grep -c '^status 429' "$WORK/wrk.err" || true)
server5xx=$(grep -c '^status 5' "$WORK/wrk.err" || true)
other=$(( non200 - shed - server5xx ))
tracebacks=$(grep -c 'Traceback' "$WORK/server.log" || true)
{
  echo "# Soak: \`latentlm serve\` under wrk, concurrency 64, ${DURATION} s"
  echo
  echo "$(date -u +%F), $(lscpu | grep 'Model name' | sed 's/ \+/ /g; s/Model name: //'), $(nproc) cores; commit $(git -C "$HERE" rev-parse --short HEAD)."
  echo "Command: \`bash bench/soak.sh ${DURATION}\`. Default settings, no Redis, a 256-state HMM (V = 10,000); requests"
  echo "cycle through score, posterior (top_k 3), Viterbi decode (50 tokens each) and a 2 x 20-token sample."
  echo
  echo "| requests | 5xx | 429 (shed) | other non-200 | socket errors | tracebacks in the server log |"
  echo "|---|---|---|---|---|---|"
  echo "| $(grep -oE '[0-9]+ requests in' "$WORK/wrk.out" | awk '{print $1}') | $server5xx | $shed | $other | $(grep -oE 'Socket errors:.*' "$WORK/wrk.out" || echo none) | $tracebacks |"
  echo
  echo "wrk's summary:"
  echo
  echo '```'
  cat "$WORK/wrk.out"
  echo '```'
  echo
  echo "Server process every 30 s (elapsed s, resident MiB, open file descriptors, threads):"
  echo
  echo "| elapsed s | RSS MiB | fds | threads |"
  echo "|---|---|---|---|"
  awk '{printf "| %s | %s | %s | %s |\n", ($5 == "" ? $1 : $1 " " $2), ($5 == "" ? $2 : $3), ($5 == "" ? $3 : $4), ($5 == "" ? $4 : $5)}' "$WORK/samples"
} >"$OUT"
cat "$OUT" | head -12
echo "wrote $OUT"
