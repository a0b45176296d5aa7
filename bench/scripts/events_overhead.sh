#!/usr/bin/env bash
# What KV events cost a node (docs/semantics.md §19): `kvstash bench node` against two fresh
# kvstashd of the same settings, one publishing its events (with a subscriber reading every
# batch, so that sending them is paid for) and one not, in paired rounds: each round starts both
# nodes afresh and loads them one after the other, alternating which is started and loaded
# first, so that neither the machine's drift nor a node's place weighs on one side. Prints each round's GB/s and blocks/s and their ratio (events on / off), and the
# medians; --json for one JSON object. Small blocks make the most events per byte.
#
#   bench/scripts/events_overhead.sh [--rounds N] [--seconds S] [--block-bytes B]
#       [--cpu-bytes B] [--clients N] [--batch N] [--build DIR] [--json]
set -euo pipefail

rounds=5 seconds=5 block=4KiB cpu=256MiB clients=4 batch=8 json=0
build="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)/build"
while [ $# -gt 0 ]; do
  case "$1" in
    --rounds) rounds="$2"; shift 2 ;;
    --seconds) seconds="$2"; shift 2 ;;
    --block-bytes) block="$2"; shift 2 ;;
    --cpu-bytes) cpu="$2"; shift 2 ;;
    --clients) clients="$2"; shift 2 ;;
    --batch) batch="$2"; shift 2 ;;
    --build) build="$2"; shift 2 ;;
    --json) json=1; shift ;;
    -h|--help) sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "events_overhead.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
kvstashd="$build/node/kvstashd"
kvstash="$build/tools/kvstash/kvstash"
for bin in "$kvstashd" "$kvstash"; do
  [ -x "$bin" ] || { echo "events_overhead.sh: $bin is not built" >&2; exit 2; }
done

work="$(mktemp -d /tmp/kvstash-events-overhead.XXXXXX)"
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT INT TERM

# Starts a node (not in a subshell: its pid joins pids); its address goes to $work/$name.addr,
# and with "events" its events endpoint to $work/$name.ev.
start_node() {
  local name="$1" events="$2" args=()
  [ "$events" = events ] && args=(--kv-events 'tcp://127.0.0.1:*')
  rm -f "$work/$name.out" "$work/$name.ev"
  "$kvstashd" --listen 127.0.0.1 --port 0 --metrics-address off --block-bytes "$block" \
    --cpu-bytes "$cpu" "${args[@]}" >"$work/$name.out" 2>"$work/$name.err" &
  pids+=($!)
  for _ in $(seq 1 500); do
    if grep -q "listening on" "$work/$name.out"; then break; fi
    sleep 0.02
  done
  grep -q "listening on" "$work/$name.out" || { cat "$work/$name.err" >&2; exit 1; }
  if [ "$events" = events ]; then
    for _ in $(seq 1 500); do grep -q "KV events on" "$work/$name.out" && break; sleep 0.02; done
    sed -n 's/^kvstashd KV events on \([^,]*\).*/\1/p' "$work/$name.out" >"$work/$name.ev"
  fi
  sed -n 's/^kvstashd listening on \(.*\)$/\1/p' "$work/$name.out" >"$work/$name.addr"
}

# A subscriber that reads (and counts) every batch until killed.
subscribe() {
  /usr/bin/python3 - "$1" "$2" <<'PY' &
import sys, zmq
ctx = zmq.Context()
sub = ctx.socket(zmq.SUB)
sub.setsockopt(zmq.SUBSCRIBE, b"")
sub.connect(sys.argv[1])
n = 0
try:
    while True:
        sub.recv_multipart()
        n += 1
        if n % 100 == 0:
            open(sys.argv[2], "w").write(str(n))
except KeyboardInterrupt:
    pass
PY
  pids+=($!)
}

run_bench() {  # address -> "gbps ops_per_s"
  "$kvstash" bench node --node "$1" --clients "$clients" --batch "$batch" --seconds "$seconds" \
    --json --quiet | /usr/bin/python3 -c '
import json, sys
d = json.load(sys.stdin)
assert d["errors"] == 0 and d["mismatches"] == 0, d
print(d["gbps"], d["ops_per_s"])'
}

stop_nodes() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  pids=()
}

results=()
for r in $(seq 1 "$rounds"); do
  if [ $((r % 2)) -eq 1 ]; then
    start_node off none; start_node on "${KVSTASH_EVENTS_MODE:-events}"
  else
    start_node on "${KVSTASH_EVENTS_MODE:-events}"; start_node off none
  fi
  [ "${KVSTASH_EVENTS_MODE:-events}" != events ] || [ "${KVSTASH_NO_SUBSCRIBER:-0}" = 1 ] || subscribe "$(cat "$work/on.ev")" "$work/batches.$r"
  off=$(cat "$work/off.addr") on=$(cat "$work/on.addr")
  if [ $((r % 2)) -eq 1 ]; then
    a=$(run_bench "$off"); b=$(run_bench "$on")
  else
    b=$(run_bench "$on"); a=$(run_bench "$off")
  fi
  stop_nodes
  results+=("$r $a $b")
  [ "$json" = 1 ] || echo "round $r: off $a, on $b" >&2
done
for f in "$work"/batches.*; do [ -f "$f" ] && cat "$f"; echo; done | awk "{s += \$1} END {print s + 0}" >"$work/batches"
printf '%s\n' "${results[@]}" | /usr/bin/python3 -c '
import json, statistics, sys
json_out = sys.argv[1] == "1"
batches = open(sys.argv[2]).read().strip() if __import__("os").path.exists(sys.argv[2]) else "0"
rows = [list(map(float, l.split())) for l in sys.stdin if l.strip()]
g = [r[3] / r[1] for r in rows]
o = [r[4] / r[2] for r in rows]
out = {"bench": "events_overhead", "rounds": len(rows),
       "off_gbps": statistics.median(r[1] for r in rows),
       "on_gbps": statistics.median(r[3] for r in rows),
       "off_ops_per_s": statistics.median(r[2] for r in rows),
       "on_ops_per_s": statistics.median(r[4] for r in rows),
       "gbps_ratio": statistics.median(g), "ops_ratio": statistics.median(o),
       "per_round_gbps_ratio": g, "batches_received": int(batches)}
if json_out:
    print(json.dumps(out))
else:
    o = out
    print("events off: %.3f GB/s, %.0f blocks/s" % (o["off_gbps"], o["off_ops_per_s"]))
    print("events on:  %.3f GB/s, %.0f blocks/s (%d batches read by the subscriber)"
          % (o["on_gbps"], o["on_ops_per_s"], o["batches_received"]))
    print("ratio on/off (median of rounds): GB/s %.3f, blocks/s %.3f; per round %s"
          % (o["gbps_ratio"], o["ops_ratio"], [round(x, 3) for x in g]))
' "$json" "$work/batches"
