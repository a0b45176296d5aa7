#!/usr/bin/env bash
# Installs what is missing, builds, and runs every test (unit, integration, fault) through ctest.
# Between the build and the tests, clang's thread-safety analysis checks the lock annotations.
#
# First the sanitizer pass (skip with KVSTASH_SANITIZE_PASS=0): clang builds the unit tests and the
# libFuzzer targets (tests/fuzz) under AddressSanitizer + UndefinedBehaviorSanitizer in build-asan/
# (only those binaries, at -O1 with line tables only, which compiles about a third faster than
# -O2 -g; clang builds both in less CPU time than GCC took for the unit tests alone), runs the
# unit tests, then runs every fuzz target for KVSTASH_FUZZ_SECONDS (60) from its seeds in
# tests/fuzz/corpus (which no run writes to), as many at a time as there are cores. Then the
# normal build runs everything and ctest's summary closes the output. Extra arguments go to that
# last ctest: `scripts/test.sh -L unit`.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib/setup.sh"

kvstash_install_deps

if [ "${KVSTASH_SANITIZE_PASS:-1}" != 0 ]; then
  asan_dir="$KVSTASH_ROOT/build-asan"
  # A tree configured by GCC before (this pass used it) cannot switch compilers in place.
  if [ -f "$asan_dir/CMakeCache.txt" ] &&
    ! grep -q '^CMAKE_CXX_COMPILER:[A-Z]*=.*clang++' "$asan_dir/CMakeCache.txt"; then
    rm -rf "$asan_dir"
  fi
  kvstash_log "unit tests and fuzz targets under AddressSanitizer + UndefinedBehaviorSanitizer"
  kvstash_build "$asan_dir" -DCMAKE_CXX_COMPILER=clang++ -DKVSTASH_SANITIZE=address \
    -DKVSTASH_FUZZ=ON -DKVSTASH_FUZZ_SECONDS="${KVSTASH_FUZZ_SECONDS:-60}" \
    -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1 -DNDEBUG" \
    -DKVSTASH_BUILD_TESTS=ON -DKVSTASH_BUILD_BENCHMARKS=OFF -- kvstash_unit_tests kvstash_fuzz_targets
  (cd "$asan_dir" && ctest --output-on-failure --timeout 600 -j "$(nproc)" -L unit)
  kvstash_log "fuzz targets, ${KVSTASH_FUZZ_SECONDS:-60} s each"
  (cd "$asan_dir" && ctest --output-on-failure -j "$(nproc)" -L fuzz)
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
