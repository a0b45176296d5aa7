#!/usr/bin/env bash
# Installs what is missing, builds, and runs every test (unit, integration, fault) through ctest.
# Extra arguments go to ctest, e.g. `scripts/test.sh -L unit` or `scripts/test.sh -R Arc`.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib/setup.sh"

kvstash_install_deps
kvstash_build -DKVSTASH_BUILD_TESTS=ON -DKVSTASH_BUILD_BENCHMARKS=ON
kvstash_log "test"
cd "$KVSTASH_BUILD_DIR"
ctest --output-on-failure --timeout 600 -j "$(nproc)" "$@"
