#!/usr/bin/env bash
# Runs one libFuzzer target for a bounded time, as ctest's label `fuzz` does:
#   run_fuzzer.sh FUZZER SECONDS SEEDS [libFuzzer flags...]
# SEEDS (tests/fuzz/corpus/<target>/) is only read: what the run finds goes to a temporary
# directory, removed after. A crash, a sanitizer report or a failed check ends the run with the
# input that caused it saved next to FUZZER (artifacts/<target>-crash-..., printed), for
# `FUZZER FILE` to reproduce; the run then fails.
set -euo pipefail

if [ "$#" -lt 3 ]; then
  echo "usage: $0 FUZZER SECONDS SEEDS [libFuzzer flags...]" >&2
  exit 2
fi
fuzzer="$1"
seconds="$2"
seeds="$3"
shift 3

work="$(mktemp -d "${TMPDIR:-/tmp}/kvstash-fuzz.XXXXXX")"
trap 'rm -rf "$work"' EXIT
artifacts="$(dirname "$fuzzer")/artifacts"
mkdir -p "$artifacts"

# -timeout: one input running this long is a hang (a node call that never ends, say).
# -rss_limit_mb: libFuzzer's default, said so that a machine with less memory can lower it.
status=0
"$fuzzer" -max_total_time="$seconds" -timeout=30 -rss_limit_mb=2048 -print_final_stats=1 \
  -artifact_prefix="$artifacts/$(basename "$fuzzer")-" "$@" "$work" "$seeds" || status=$?
echo "$(basename "$fuzzer"): $(find "$work" -type f | wc -l) new inputs this run (discarded)"
exit "$status"
