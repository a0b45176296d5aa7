#!/usr/bin/env bash
# Installs what is missing, builds, and runs every test through ctest, then prints the ten
# slowest tests and how long each stage took. The rules no compiler enforces (clang-format,
# clang-tidy, clang's thread-safety analysis) are scripts/lint.sh; CI runs both (.ci/run).
#
# 1. The sanitizer pass (skip with KVSTASH_SANITIZE_PASS=0): clang builds the unit tests and the
#    libFuzzer targets (tests/fuzz) under AddressSanitizer + UndefinedBehaviorSanitizer in
#    build-asan/, only those binaries, at -O0 with line tables (a test file compiles in less than
#    half the CPU time of -O1) and in unity batches of 8 files (each header parsed once per
#    batch: 267 s against 435 s on two cores; a batch is one translation unit, so two files of
#    one target may not define one name in their anonymous namespaces), runs the unit tests
#    (the transport's contract suite among them), then every fuzz target for
#    KVSTASH_FUZZ_SECONDS (20) from its seeds in tests/fuzz/corpus (which no run writes to), as
#    many at a time as there are cores.
# 2. The normal build (scripts/demo.sh's flags: after the demo only the tests and benchmarks are
#    compiled here) and every other test through ctest, the chaos suite alone and last. The unit
#    tests the sanitizer pass ran are neither compiled nor run again
#    (KVSTASH_UNIT_TESTS_SANITIZED_ONLY); with KVSTASH_SANITIZE_PASS=0 they are, here.
#
# Extra arguments go to that last ctest: `scripts/test.sh -L integration`, `-R Chaos`.
# Labels: unit and contract (build-asan/ after this script), integration, fault, adversarial,
# chaos, python, gpu, bench (build/), fuzz (build-asan/); one suite alone: `cd build && ctest -L
# chaos`, `cd build-asan && ctest -L contract`.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib/setup.sh"

stages=()
stage_start=$SECONDS
# Ends the stage under way: its name and seconds go to the summary printed at the end.
stage_done() {
  stages+=("$(printf '%6d s  %s' "$((SECONDS - stage_start))" "$1")")
  stage_start=$SECONDS
}

kvstash_install_deps
stage_done "dependencies"

asan_dir="$KVSTASH_ROOT/build-asan"
runs=()
if [ "${KVSTASH_SANITIZE_PASS:-1}" != 0 ]; then
  # A tree configured by GCC before (this pass used it) cannot switch compilers in place.
  if [ -f "$asan_dir/CMakeCache.txt" ] &&
    ! grep -q '^CMAKE_CXX_COMPILER:[A-Z]*=.*clang++' "$asan_dir/CMakeCache.txt"; then
    rm -rf "$asan_dir"
  fi
  kvstash_log "unit tests and fuzz targets under AddressSanitizer + UndefinedBehaviorSanitizer"
  kvstash_build "$asan_dir" -DCMAKE_CXX_COMPILER=clang++ -DKVSTASH_SANITIZE=address \
    -DKVSTASH_FUZZ=ON -DKVSTASH_FUZZ_SECONDS="${KVSTASH_FUZZ_SECONDS:-20}" \
    -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O0 -g1 -DNDEBUG" \
    -DCMAKE_UNITY_BUILD=ON -DCMAKE_UNITY_BUILD_BATCH_SIZE=8 \
    -DKVSTASH_BUILD_TESTS=ON -DKVSTASH_BUILD_BENCHMARKS=OFF -- kvstash_unit_tests kvstash_fuzz_targets
  stage_done "sanitizer build (clang, ASan + UBSan)"
  (cd "$asan_dir" && ctest --output-on-failure --timeout 600 -j "$(nproc)" -L unit \
    --output-junit "$asan_dir/ctest-unit.xml")
  stage_done "unit tests under the sanitizers"
  kvstash_log "fuzz targets, ${KVSTASH_FUZZ_SECONDS:-20} s each"
  (cd "$asan_dir" && ctest --output-on-failure -j "$(nproc)" -L fuzz \
    --output-junit "$asan_dir/ctest-fuzz.xml")
  stage_done "fuzz targets"
  runs+=("$asan_dir/ctest-unit.xml" "$asan_dir/ctest-fuzz.xml")
fi

# The unit tests the sanitizer pass ran are not compiled or run again here.
sanitized_only=OFF
[ "${KVSTASH_SANITIZE_PASS:-1}" != 0 ] && sanitized_only=ON
kvstash_build "$KVSTASH_BUILD_DIR" -DKVSTASH_BUILD_TESTS=ON -DKVSTASH_BUILD_BENCHMARKS=ON \
  -DKVSTASH_UNIT_TESTS_SANITIZED_ONLY="$sanitized_only"
stage_done "build of the tests and benchmarks"
kvstash_log "test"
status=0
(cd "$KVSTASH_BUILD_DIR" && ctest --output-on-failure --timeout 600 -j "$(nproc)" \
  --output-junit "$KVSTASH_BUILD_DIR/ctest-results.xml" "$@") || status=$?
stage_done "ctest"
runs+=("$KVSTASH_BUILD_DIR/ctest-results.xml")

/usr/bin/python3 "$KVSTASH_ROOT/scripts/lib/slowest_tests.py" "${runs[@]}" || true
echo "stages:"
printf '%s\n' "${stages[@]}"
printf '%6d s  in all\n' "$SECONDS"
exit "$status"
