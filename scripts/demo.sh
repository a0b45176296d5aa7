#!/usr/bin/env bash
# Installs what is missing, builds, and runs the main job at this stage: replays the reference
# policy trace through the block manager with `kvstash trace` and prints the transcript.
# Give another trace file as the first argument to replay that instead.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib/setup.sh"

kvstash_install_deps
kvstash_build "$KVSTASH_BUILD_DIR" -DKVSTASH_BUILD_TESTS=OFF -DKVSTASH_BUILD_BENCHMARKS=OFF

trace="${1:-$KVSTASH_ROOT/tests/data/policy/example.trace}"
expected="${trace%.trace}.expected"
kvstash_log "kvstash trace $trace"
transcript="$("$KVSTASH_BUILD_DIR/connector/kvstash" trace "$trace")"
printf '%s\n' "$transcript"
if [ -f "$expected" ]; then
  if diff -u "$expected" <(printf '%s\n' "$transcript") >/dev/null; then
    kvstash_log "transcript matches $expected byte for byte"
  else
    kvstash_log "transcript DIFFERS from $expected:"
    diff -u "$expected" <(printf '%s\n' "$transcript") || true
    exit 1
  fi
fi
