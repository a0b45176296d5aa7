#!/usr/bin/env bash
# Installs what is missing, builds, and runs the main job: a local cluster on loopback (two
# kvstashd offload nodes, a prefill worker and a decode worker, both `kvstash-engine serve` on
# tiny-hybrid) and a multi-turn chat through it. Per turn the prefill worker computes the prompt
# and pushes its blocks to the nodes, the decode worker pulls them and generates; the chat prints
# the prompt tokens that came from the nodes and from each worker's own prefix cache, the decode
# worker's time to first token next to the same prompt computed here without any cache, the bytes
# moved, and whether the tokens are the same as without the cache (the demo fails if not).
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
nodes=()
for i in 1 2; do
  kvstash_start_node "node$i" --block-bytes "$BLOCK_BYTES" --cpu-bytes 256MiB
  nodes+=("$KVSTASH_ADDRESS")
  echo "kvstashd node$i        $KVSTASH_ADDRESS"
done
node_list="$(IFS=,; echo "${nodes[*]}")"
kvstash_start_worker prefill --model "$MODEL" --role prefill --nodes "$node_list"
prefill="$KVSTASH_ADDRESS"
echo "prefill worker       $prefill"
kvstash_start_worker decode --model "$MODEL" --role decode --nodes "$node_list"
decode="$KVSTASH_ADDRESS"
echo "decode worker        $decode"

kvstash_log "multi-turn chat on $MODEL: prefill worker, then decode worker, per turn"
"$KVSTASH_BUILD_DIR/tools/kvstash-engine/kvstash-engine" chat --model "$MODEL" \
  --prefill-worker "$prefill" --decode-worker "$decode" \
  --turns 6 --user-tokens 480 --max-new-tokens 32 "$@"
kvstash_log "stopping the cluster"
