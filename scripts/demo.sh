#!/usr/bin/env bash
# Installs what is missing, builds, and runs the main job: a local cluster on loopback (two
# kvstashd offload nodes, two prefill and two decode workers, all `kvstash-engine serve` on
# tiny-hybrid, with kvstash-router in front) and a multi-turn chat through the router. Nodes and
# workers publish KV events; the router follows them and sends each turn's prefill to the worker
# whose own cache holds the conversation so far, and its decode to a decode worker that pulls
# the blocks from the nodes. Per turn the chat prints where the router sent it, the prompt tokens
# the cluster computed and those that came from the nodes and the decode worker's own cache, the
# time to first token next to the same prompt computed here without any cache, and whether the
# tokens are the same as without the cache (the demo fails if not).
#
# Extra arguments go to `kvstash-engine chat`, e.g. `scripts/demo.sh --turns 4 --user-tokens 64`.
# The processes' logs stay in the directory printed at the start.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib/setup.sh"
source "$(dirname "${BASH_SOURCE[0]}")/lib/cluster.sh"

MODEL="builtin:tiny-hybrid"
# A node's block is the engine's page (4096 B for the built-in models) plus a 56-byte trailer.
BLOCK_BYTES=4152

kvstash_install_deps
kvstash_build "$KVSTASH_BUILD_DIR" -DKVSTASH_BUILD_TESTS=OFF -DKVSTASH_BUILD_BENCHMARKS=OFF

kvstash_cluster_init
trap kvstash_cluster_stop EXIT
kvstash_log "local cluster on 127.0.0.1 (logs in $KVSTASH_CLUSTER_LOGS)"
nodes=() router_flags=()
events=(--kv-events 'tcp://127.0.0.1:*' --kv-events-replay 'tcp://127.0.0.1:*')
for i in 1 2; do
  kvstash_start_node "node$i" --block-bytes "$BLOCK_BYTES" --cpu-bytes 256MiB "${events[@]}"
  nodes+=("$KVSTASH_ADDRESS")
  router_flags+=(--node-events "$KVSTASH_EVENTS" --node-events-replay "$KVSTASH_EVENTS_REPLAY")
  echo "kvstashd node$i        $KVSTASH_ADDRESS (KV events on $KVSTASH_EVENTS)"
done
node_list="$(IFS=,; echo "${nodes[*]}")"
for role in prefill decode; do
  for i in 1 2; do
    kvstash_start_worker "$role$i" --model "$MODEL" --role "$role" --nodes "$node_list" "${events[@]}"
    router_flags+=("--$role-worker" "$KVSTASH_ADDRESS")
    echo "$role worker $i     $KVSTASH_ADDRESS"
  done
done
kvstash_start_router router "${router_flags[@]}"
router="$KVSTASH_ADDRESS"
echo "kvstash-router       $router"

kvstash_log "multi-turn chat on $MODEL through the router"
"$KVSTASH_BUILD_DIR/tools/kvstash-engine/kvstash-engine" chat --model "$MODEL" \
  --router "$router" --turns 6 --user-tokens 480 --max-new-tokens 32 "$@"
kvstash_log "stopping the cluster"
