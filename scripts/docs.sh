#!/usr/bin/env bash
# Keeps docs/architecture.md's dependency diagram true to the build: the diagram between its
# GENERATED markers is rendered from `cmake --graphviz` (scripts/lib/architecture_graph.py).
#
#   scripts/docs.sh check    exit 1, with a diff, when the diagram differs from the build's
#   scripts/docs.sh update   rewrite the diagram from the build
#
# Configures a scratch build (no CUDA, no tests: the product's targets only) in a temporary
# directory; needs cmake and /usr/bin/python3, builds nothing.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
doc="$root/docs/architecture.md"
begin='<!-- BEGIN GENERATED: scripts/docs.sh update (cmake --graphviz) -->'
end='<!-- END GENERATED -->'
mode="${1:-}"
case "$mode" in
  check | update) ;;
  *) echo "usage: scripts/docs.sh check|update" >&2; exit 2 ;;
esac
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
if ! cmake -S "$root" -B "$scratch" -DKVSTASH_WITH_CUDA=OFF -DKVSTASH_BUILD_TESTS=OFF \
    -DKVSTASH_BUILD_BENCHMARKS=OFF --graphviz="$scratch/deps.dot" >"$scratch/cmake.log" 2>&1; then
  cat "$scratch/cmake.log" >&2
  exit 1
fi
/usr/bin/python3 "$root/scripts/lib/architecture_graph.py" "$scratch/deps.dot" >"$scratch/graph.md"
# The document with the block between the markers replaced by the rendered graph.
awk -v begin="$begin" -v end="$end" -v graph="$scratch/graph.md" '
  $0 == begin { print; while ((getline line < graph) > 0) print line; skip = 1; next }
  $0 == end { skip = 0 }
  !skip { print }' "$doc" >"$scratch/architecture.md"
grep -qxF "$begin" "$doc" || { echo "error: $doc has no line '$begin'" >&2; exit 1; }
if [ "$mode" = update ]; then
  cp "$scratch/architecture.md" "$doc"
  echo "docs/architecture.md: diagram updated"
elif ! diff -u "$doc" "$scratch/architecture.md"; then
  echo "error: docs/architecture.md's diagram differs from the build's (scripts/docs.sh update)" >&2
  exit 1
fi
