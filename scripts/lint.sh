#!/usr/bin/env bash
# Runs clang-tidy (the checks of .clang-tidy) on the C++ sources a change touches, with the
# compile commands of the build (build/compile_commands.json; scripts/test.sh makes it).
#
#   scripts/lint.sh            the .cc files changed in the working tree (against HEAD)
#   scripts/lint.sh BASE       the .cc files changed since BASE (a commit: main, HEAD~3, ...)
#   scripts/lint.sh --all      every .cc file of the build
#
# Headers are checked through the sources that include them. Exits 1 on any finding.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${KVSTASH_BUILD_DIR:-$root/build}"
cd "$root"
if [ ! -f "$build/compile_commands.json" ]; then
  echo "error: no $build/compile_commands.json: build first (scripts/test.sh)" >&2
  exit 2
fi
if [ "${1:-}" = "--all" ]; then
  mapfile -t files < <(/usr/bin/python3 -c '
import json, sys
root = sys.argv[1]
for e in json.load(open(sys.argv[2])):
    f = e["file"]
    if f.startswith(root + "/") and f.endswith(".cc") and not f.startswith(root + "/build"):
        print(f[len(root) + 1:])' "$root" "$build/compile_commands.json" | sort -u)
else
  base="${1:-HEAD}"
  mapfile -t files < <({ git diff --name-only --diff-filter=ACMR "$base" -- '*.cc'
                         git ls-files --others --exclude-standard -- '*.cc'; } | sort -u)
fi
if [ "${#files[@]}" -eq 0 ]; then
  echo "lint: no C++ sources changed"
  exit 0
fi
echo "lint: clang-tidy on ${#files[@]} file(s)"
printf '%s\n' "${files[@]}" |
  xargs -P "$(nproc)" -n 4 clang-tidy -p "$build" --quiet 2>/dev/null
