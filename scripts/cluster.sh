#!/usr/bin/env bash
# Starts a local kvstash cluster on loopback for experiments: N kvstashd offload nodes and
# P prefill + D decode workers (`kvstash-engine serve`), every worker over all the nodes.
# Installs what is missing and builds first, like scripts/demo.sh.
#
#   scripts/cluster.sh [-n NODES] [-p PREFILL] [-d DECODE] [-m MODEL] [--block-bytes B]
#                      [--cpu-bytes B] [--etcd] [--replicas R] [--worker-args "ARGS"]
#                      [--node-args "ARGS"] [--router] [--router-args "ARGS"] [-- COMMAND...]
#
# With --router every node and worker publishes its KV events, and a kvstash-router in front of
# them follows those events and places each completion (KVSTASH_ROUTER: its HOST:PORT; e.g.
# --router-args "--policy round-robin").
# With --etcd it also starts an etcd; the nodes register in it (cluster "local", 5 s leases)
# and the workers follow its live members instead of a node list, keeping --replicas copies.
# Prints every address and writes them to $KVSTASH_CLUSTER_LOGS/cluster.env (KVSTASH_NODES,
# KVSTASH_PREFILL_WORKERS, KVSTASH_DECODE_WORKERS: comma-separated HOST:PORT lists;
# KVSTASH_NODE_PIDS; with --etcd, KVSTASH_ETCD and KVSTASH_CLUSTER; with --router,
# KVSTASH_ROUTER). With a COMMAND it runs that command with those variables exported, then
# stops the cluster and exits with the command's status; without one it runs until Ctrl-C.
# For example:
#
#   scripts/cluster.sh -n 3 -p 1 -d 1 -- sh -c 'build/tools/kvstash-engine/kvstash-engine chat \
#       --model builtin:tiny-hybrid \
#       --prefill-worker $KVSTASH_PREFILL_WORKERS --decode-worker $KVSTASH_DECODE_WORKERS'
#   scripts/cluster.sh -p 2 -d 2 --router -- sh -c 'build/tools/kvstash-engine/kvstash-engine \
#       chat --model builtin:tiny-hybrid --router $KVSTASH_ROUTER'
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib/setup.sh"
source "$(dirname "${BASH_SOURCE[0]}")/lib/cluster.sh"

usage() { sed -n '2,26p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }

num_nodes=2 num_prefill=1 num_decode=1 model="builtin:tiny-hybrid"
block_bytes=4152 cpu_bytes=256MiB worker_args="" node_args="" use_etcd=0 replicas=1
use_router=0 router_args=""
count() {
  if ! [[ "$2" =~ ^[0-9]+$ ]] || [ "$2" -gt 64 ]; then
    echo "error: $1 takes a count from 0 to 64, not '$2'" >&2
    exit 2
  fi
}
while [ "$#" -gt 0 ]; do
  case "$1" in
    -n | --nodes) count "$1" "${2-}"; num_nodes="$2"; shift 2 ;;
    -p | --prefill) count "$1" "${2-}"; num_prefill="$2"; shift 2 ;;
    -d | --decode) count "$1" "${2-}"; num_decode="$2"; shift 2 ;;
    -m | --model) model="${2:?--model needs a value}"; shift 2 ;;
    --block-bytes) block_bytes="${2:?--block-bytes needs a value}"; shift 2 ;;
    --cpu-bytes) cpu_bytes="${2:?--cpu-bytes needs a value}"; shift 2 ;;
    --worker-args) worker_args="${2?--worker-args needs a value}"; shift 2 ;;
    --node-args) node_args="${2?--node-args needs a value}"; shift 2 ;;
    --etcd) use_etcd=1; shift ;;
    --router) use_router=1; shift ;;
    --router-args) router_args="${2?--router-args needs a value}"; shift 2 ;;
    --replicas)
      if ! [[ "${2-}" =~ ^[1-8]$ ]]; then
        echo "error: --replicas takes a count from 1 to 8, not '${2-}'" >&2
        exit 2
      fi
      replicas="$2"; shift 2 ;;
    -h | --help) usage; exit 0 ;;
    --) shift; break ;;
    *) echo "error: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
  esac
done
if [ "$num_nodes" -eq 0 ] && [ "$num_prefill" -gt 0 ]; then
  echo "error: prefill workers need at least one node (-n)" >&2
  exit 2
fi

kvstash_install_deps
# A build directory configured already keeps its options (its tests stay on for test.sh); only
# the programs a cluster runs are brought up to date.
if [ -f "$KVSTASH_BUILD_DIR/CMakeCache.txt" ]; then
  kvstash_build "$KVSTASH_BUILD_DIR" -- kvstashd kvstash-engine kvstash kvstash-router
else
  kvstash_build "$KVSTASH_BUILD_DIR" -DKVSTASH_BUILD_TESTS=OFF -DKVSTASH_BUILD_BENCHMARKS=OFF
fi

kvstash_cluster_init
trap kvstash_cluster_stop EXIT
kvstash_log "cluster on 127.0.0.1: $num_nodes nodes, $num_prefill prefill + $num_decode decode workers (logs in $KVSTASH_CLUSTER_LOGS)"
read -r -a extra_node <<<"$node_args"
read -r -a extra_worker <<<"$worker_args"
read -r -a extra_router <<<"$router_args"
nodes=() prefills=() decodes=() etcd_node=() etcd_url="" events=() router_flags=() router=""
# Events on free ports, as bound (quoted: the * is ZMQ's, not the shell's).
[ "$use_router" -eq 1 ] && events=(--kv-events 'tcp://127.0.0.1:*' --kv-events-replay 'tcp://127.0.0.1:*')
if [ "$use_etcd" -eq 1 ]; then
  kvstash_start_etcd
  etcd_url="$KVSTASH_ADDRESS"
  echo "etcd      $etcd_url"
  etcd_node=(--etcd "$etcd_url" --cluster local --etcd-ttl-s 5)
fi
for ((i = 1; i <= num_nodes; i++)); do
  kvstash_start_node "node$i" --block-bytes "$block_bytes" --cpu-bytes "$cpu_bytes" "${etcd_node[@]}" "${events[@]}" "${extra_node[@]}"
  nodes+=("$KVSTASH_ADDRESS")
  [ -n "$KVSTASH_EVENTS" ] && router_flags+=(--node-events "$KVSTASH_EVENTS" --node-events-replay "$KVSTASH_EVENTS_REPLAY")
  echo "node$i     $KVSTASH_ADDRESS"
done
node_list="$(IFS=,; echo "${nodes[*]}")"
node_flag=()
[ -n "$node_list" ] && node_flag=(--nodes "$node_list" --replicas "$replicas")
[ -n "$node_list" ] && [ -n "$etcd_url" ] && node_flag=(--etcd "$etcd_url" --cluster local --replicas "$replicas")
# Without nodes a decode worker computes everything: it runs as `both`.
decode_role=decode
[ -z "$node_list" ] && decode_role=both
for ((i = 1; i <= num_prefill; i++)); do
  kvstash_start_worker "prefill$i" --model "$model" --role prefill "${node_flag[@]}" "${events[@]}" "${extra_worker[@]}"
  prefills+=("$KVSTASH_ADDRESS")
  router_flags+=(--prefill-worker "$KVSTASH_ADDRESS")
  echo "prefill$i  $KVSTASH_ADDRESS"
done
for ((i = 1; i <= num_decode; i++)); do
  kvstash_start_worker "decode$i" --model "$model" --role "$decode_role" "${node_flag[@]}" "${events[@]}" "${extra_worker[@]}"
  decodes+=("$KVSTASH_ADDRESS")
  router_flags+=(--decode-worker "$KVSTASH_ADDRESS")
  echo "decode$i   $KVSTASH_ADDRESS"
done
if [ "$use_router" -eq 1 ]; then
  if [ "$num_decode" -eq 0 ]; then
    echo "error: --router needs at least one decode worker (-d)" >&2
    exit 2
  fi
  kvstash_start_router router "${router_flags[@]}" "${extra_router[@]}"
  router="$KVSTASH_ADDRESS"
  echo "router    $router"
fi

export KVSTASH_NODES="$node_list"
export KVSTASH_NODE_PIDS="$(IFS=,; echo "${KVSTASH_CLUSTER_PIDS_NODES[*]}")"
export KVSTASH_ETCD="$etcd_url"
export KVSTASH_CLUSTER="${etcd_url:+local}"
export KVSTASH_PREFILL_WORKERS="$(IFS=,; echo "${prefills[*]}")"
export KVSTASH_DECODE_WORKERS="$(IFS=,; echo "${decodes[*]}")"
export KVSTASH_ROUTER="$router"
{
  echo "KVSTASH_NODES=$KVSTASH_NODES"
  echo "KVSTASH_NODE_PIDS=$KVSTASH_NODE_PIDS"
  echo "KVSTASH_ETCD=$KVSTASH_ETCD"
  echo "KVSTASH_CLUSTER=$KVSTASH_CLUSTER"
  echo "KVSTASH_PREFILL_WORKERS=$KVSTASH_PREFILL_WORKERS"
  echo "KVSTASH_DECODE_WORKERS=$KVSTASH_DECODE_WORKERS"
  echo "KVSTASH_ROUTER=$KVSTASH_ROUTER"
} >"$KVSTASH_CLUSTER_LOGS/cluster.env"
echo "addresses in $KVSTASH_CLUSTER_LOGS/cluster.env"

if [ "$#" -gt 0 ]; then
  kvstash_log "running: $*"
  set +e
  "$@"
  status=$?
  set -e
  kvstash_log "stopping the cluster"
  exit "$status"
fi
kvstash_log "running until Ctrl-C"
trap 'kvstash_log "stopping the cluster"; exit 0' INT TERM
while true; do sleep 3600 & wait $!; done
