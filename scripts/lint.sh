#!/usr/bin/env bash
# The house rules a compiler does not enforce (scripts/lib/rules.py): clang-format on every
# tracked C++ file, and clang-tidy (the checks of .clang-tidy) with clang's thread-safety
# analysis as errors on every .cc file of the build, but for the exceptions listed, each with
# its reason, in scripts/lib/clang_exceptions.txt. Uses the build's compile commands
# (build/compile_commands.json: scripts/demo.sh or scripts/test.sh makes it). CI runs
# `scripts/lint.sh --all` after scripts/test.sh (.ci/run).
#
#   scripts/lint.sh            the C++ files changed in the working tree (against HEAD)
#   scripts/lint.sh BASE       the C++ files changed since BASE (a commit: main, HEAD~3, ...)
#   scripts/lint.sh --all      every file
#   ... --json                 one JSON summary line at the end instead of the text one
#
# Exits 1 on any finding. On 2 cores the whole tree takes about 6 minutes.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${KVSTASH_BUILD_DIR:-$root/build}"
args=()
scope=(--changed HEAD)
for arg in "$@"; do
  case "$arg" in
    --all) scope=() ;;
    --json) args+=(--json) ;;
    -h | --help) sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "error: unknown option $arg (scripts/lint.sh --help)" >&2; exit 2 ;;
    *) scope=(--changed "$arg") ;;
  esac
done
exec /usr/bin/python3 "$root/scripts/lib/rules.py" "$build" "${scope[@]}" "${args[@]}"
