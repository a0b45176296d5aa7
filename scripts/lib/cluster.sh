# Starting and stopping a local kvstash cluster (kvstashd nodes, kvstash-engine serve workers, a
# kvstash-router) on loopback, for scripts/demo.sh and scripts/cluster.sh. Source it after setup.sh; it defines
# functions and changes nothing by itself. Every process it starts is stopped by
# kvstash_cluster_stop (workers first, so their last pushes land, then the nodes), which the
# callers run on exit.

KVSTASH_CLUSTER_PIDS_ROUTER=()
KVSTASH_CLUSTER_PIDS_WORKERS=()
KVSTASH_CLUSTER_PIDS_NODES=()
KVSTASH_CLUSTER_PIDS_ETCD=()
KVSTASH_CLUSTER_LOGS=""
KVSTASH_ADDRESS=""
KVSTASH_EVENTS=""
KVSTASH_EVENTS_REPLAY=""

# kvstash_cluster_init: a fresh directory for the processes' logs (KVSTASH_CLUSTER_LOGS).
kvstash_cluster_init() {
  KVSTASH_CLUSTER_LOGS="$(mktemp -d "${TMPDIR:-/tmp}/kvstash-cluster.XXXXXX")"
}

# _kvstash_wait_line LOG PID PATTERN: waits (30 s at most) for a line matching PATTERN in LOG and
# sets KVSTASH_ADDRESS to its last word (the address); fails if the process exits first.
_kvstash_wait_line() {
  local log="$1" pid="$2" pattern="$3" i line
  for ((i = 0; i < 300; i++)); do
    line="$(grep -m1 -E "$pattern" "$log" 2>/dev/null || true)"
    if [ -n "$line" ]; then
      KVSTASH_ADDRESS="${line##* }"
      return 0
    fi
    if ! kill -0 "$pid" 2>/dev/null; then
      echo "error: process $pid exited before it was ready; its log ($log):" >&2
      tail -n 20 "$log" "${log%.out}.err" >&2 2>/dev/null || true
      return 1
    fi
    sleep 0.1
  done
  echo "error: process $pid not ready after 30 s (log: $log)" >&2
  return 1
}

# _kvstash_wait_events LOG PID: when the process was started with --kv-events, waits for its
# "... KV events on EP[, replay on EP2]" line and sets KVSTASH_EVENTS and KVSTASH_EVENTS_REPLAY
# (empty without one); both empty for a process without events.
_kvstash_wait_events() {
  local log="$1" pid="$2" line
  KVSTASH_EVENTS="" KVSTASH_EVENTS_REPLAY=""
  local address="$KVSTASH_ADDRESS"
  _kvstash_wait_line "$log" "$pid" ' KV events on ' || return 1
  line="$(grep -m1 -E ' KV events on ' "$log")"
  line="${line#* KV events on }"
  KVSTASH_EVENTS="${line%%,*}"
  [[ "$line" == *", replay on "* ]] && KVSTASH_EVENTS_REPLAY="${line##* }"
  KVSTASH_ADDRESS="$address"
}

# _kvstash_has_events ARGS...: whether the flags hold --kv-events.
_kvstash_has_events() {
  local a
  for a in "$@"; do [ "$a" = "--kv-events" ] && return 0; done
  return 1
}

# _kvstash_start GROUP NAME PATTERN PROGRAM [ARGS...]: starts PROGRAM with ARGS in the
# background (output in NAME.out, errors in NAME.err), keeps its pid in
# KVSTASH_CLUSTER_PIDS_GROUP, waits for its line matching PATTERN (KVSTASH_ADDRESS: its last
# word) and, when ARGS hold --kv-events, for its events line (KVSTASH_EVENTS,
# KVSTASH_EVENTS_REPLAY; both empty otherwise).
_kvstash_start() {
  local group="$1" name="$2" pattern="$3"
  shift 3
  local -n pids="KVSTASH_CLUSTER_PIDS_$group"
  local out="$KVSTASH_CLUSTER_LOGS/$name.out"
  "$@" >"$out" 2>"$KVSTASH_CLUSTER_LOGS/$name.err" &
  local pid=$!
  pids+=("$pid")
  _kvstash_wait_line "$out" "$pid" "$pattern" || return 1
  KVSTASH_EVENTS="" KVSTASH_EVENTS_REPLAY=""
  if _kvstash_has_events "$@"; then _kvstash_wait_events "$out" "$pid"; fi
}

# kvstash_start_node NAME [kvstashd flags...]: starts a kvstashd on a free loopback port and sets
# KVSTASH_ADDRESS to its HOST:PORT (and, with --kv-events, KVSTASH_EVENTS and
# KVSTASH_EVENTS_REPLAY to its event endpoints). (Not in a $(...) subshell: the caller must keep
# its pid.)
kvstash_start_node() {
  local name="$1"
  shift
  _kvstash_start NODES "$name" '^kvstashd listening on ' "$KVSTASH_BUILD_DIR/node/kvstashd" \
    --listen 127.0.0.1 --port 0 --metrics-address off "$@"
}

# kvstash_start_worker NAME [kvstash-engine serve flags...]: starts a worker on a free loopback
# port and sets KVSTASH_ADDRESS to its HOST:PORT (and KVSTASH_EVENTS, as kvstash_start_node).
kvstash_start_worker() {
  local name="$1"
  shift
  _kvstash_start WORKERS "$name" '^kvstash-engine serving ' \
    "$KVSTASH_BUILD_DIR/tools/kvstash-engine/kvstash-engine" serve --listen 127.0.0.1 --port 0 "$@"
}

# kvstash_start_router NAME [kvstash-router flags...]: starts a kvstash-router on a free loopback
# port and sets KVSTASH_ADDRESS to its HOST:PORT. Stopped first by kvstash_cluster_stop.
kvstash_start_router() {
  local name="$1"
  shift
  _kvstash_start ROUTER "$name" '^kvstash-router serving on ' \
    "$KVSTASH_BUILD_DIR/tools/kvstash-router/kvstash-router" --listen 127.0.0.1 --port 0 "$@"
}

# _kvstash_free_port: a loopback TCP port nothing listens on now.
_kvstash_free_port() {
  /usr/bin/python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# kvstash_start_etcd: starts a single-member etcd (Debian etcd-server) on free loopback ports,
# its data under the cluster's logs, and sets KVSTASH_ADDRESS to its client URL once it is
# healthy. Stopped last by kvstash_cluster_stop, after the nodes have left it.
kvstash_start_etcd() {
  local client peer url i
  client="$(_kvstash_free_port)"
  peer="$(_kvstash_free_port)"
  url="http://127.0.0.1:$client"
  /usr/bin/etcd --name kvstash --data-dir "$KVSTASH_CLUSTER_LOGS/etcd.data" \
    --listen-client-urls "$url" --advertise-client-urls "$url" \
    --listen-peer-urls "http://127.0.0.1:$peer" --initial-advertise-peer-urls "http://127.0.0.1:$peer" \
    --initial-cluster "kvstash=http://127.0.0.1:$peer" \
    >"$KVSTASH_CLUSTER_LOGS/etcd.out" 2>&1 &
  local pid=$!
  KVSTASH_CLUSTER_PIDS_ETCD+=("$pid")
  for ((i = 0; i < 300; i++)); do
    if curl -sf -m 1 "$url/health" 2>/dev/null | grep -q '"health":"true"'; then
      KVSTASH_ADDRESS="$url"
      return 0
    fi
    if ! kill -0 "$pid" 2>/dev/null; then
      echo "error: etcd exited before it was ready; its log:" >&2
      tail -n 20 "$KVSTASH_CLUSTER_LOGS/etcd.out" >&2
      return 1
    fi
    sleep 0.1
  done
  echo "error: etcd not healthy after 30 s (log: $KVSTASH_CLUSTER_LOGS/etcd.out)" >&2
  return 1
}

# kvstash_cluster_stop: SIGTERM to the router, then to the workers, then to the nodes (which
# leave etcd), then to etcd; waits for each (10 s, then SIGKILL).
kvstash_cluster_stop() {
  local group pid i
  for group in ROUTER WORKERS NODES ETCD; do
    local -n pids="KVSTASH_CLUSTER_PIDS_$group"
    for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
    for pid in "${pids[@]}"; do
      for ((i = 0; i < 100; i++)); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
      done
      kill -KILL "$pid" 2>/dev/null || true
      wait "$pid" 2>/dev/null || true
    done
    pids=()
  done
}
