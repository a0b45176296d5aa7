#!/usr/bin/env bash
# Installs what is missing, builds, and runs every test (unit, integration, fault) through ctest.
# Between the build and the tests, clang's thread-safety analysis checks the lock annotations.
#
# First the unit tests run under AddressSanitizer + UndefinedBehaviorSanitizer (build-asan/, where
# only the unit-test binaries are built, at -O1 with line tables only, which compiles about a third
# faster than -O2 -g; skip with KVSTASH_SANITIZE_PASS=0), then the normal build
# runs everything and ctest's summary closes the output. Extra arguments go to that last ctest:
# `scripts/test.sh -L unit`.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib/setup.sh"

kvstash_install_deps

if [ "${KVSTASH_SANITIZE_PASS:-1}" != 0 ]; then
  kvstash_log "unit tests under AddressSanitizer + UndefinedBehaviorSanitizer"
  kvstash_build "$KVSTASH_ROOT/build-asan" -DKVSTASH_SANITIZE=address \
    -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1 -DNDEBUG" \
    -DKVSTASH_BUILD_TESTS=ON -DKVSTASH_BUILD_BENCHMARKS=OFF -- kvstash_unit_tests
  (cd "$KVSTASH_ROOT/build-asan" && ctest --output-on-failure --timeout 600 -j "$(nproc)" -L unit)
fi

# The flags of scripts/demo.sh's build (kvstash_build's): after the demo only the tests and
# benchmarks are compiled here.
kvstash_build "$KVSTASH_BUILD_DIR" -DKVSTASH_BUILD_TESTS=ON -DKVSTASH_BUILD_BENCHMARKS=ON
# GCC ignores the lock annotations (GUARDED_BY, REQUIRES): clang checks them, on every source
# that uses the annotated Mutex, without generating code.
kvstash_log "thread-safety analysis (clang -Wthread-safety -Werror)"
/usr/bin/python3 "$KVSTASH_ROOT/scripts/lib/thread_safety.py" "$KVSTASH_BUILD_DIR"
kvstash_log "test"
cd "$KVSTASH_BUILD_DIR"
ctest --output-on-failure --timeout 600 -j "$(nproc)" "$@"
