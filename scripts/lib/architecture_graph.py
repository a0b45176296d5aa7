#!/usr/bin/python3
"""Renders the kvstash targets of a `cmake --graphviz` file as a Mermaid diagram.

Reads the .dot file CMake writes, keeps the project's own targets (libraries kvstash_*, the
executables kvstash, kvstashd, kvstash-engine), drops the compile-flags target every target
links, and prints one `graph BT` block: an arrow from a target to each target it links, solid
for a public link, dotted for a private one. The output is sorted, so the same build gives the
same text.
"""
import re
import sys

EXECUTABLES = {"kvstash", "kvstashd", "kvstash-engine"}
IGNORED = {"kvstash_build_flags"}

NODE = re.compile(r'^\s*"(node\d+)" \[ label = "([^"]*)"')
EDGE = re.compile(r'^\s*"(node\d+)" -> "(node\d+)"(.*)$')


def display(label):
    # "kvstash_store\n(kvstash::store)" -> "kvstash::store"; executables keep their name.
    name = label.split("\\n")[0]
    alias = re.search(r"\((kvstash::[a-z_]+)\)", label)
    return name, (alias.group(1) if alias else name)


def main(path):
    names, shown = {}, {}
    edges = set()
    with open(path, encoding="utf-8") as dot:
        for line in dot:
            node = NODE.match(line)
            if node:
                name, label = display(node.group(2))
                names[node.group(1)] = name
                shown[name] = label
                continue
            edge = EDGE.match(line)
            if edge:
                private = "dotted" in edge.group(3)
                edges.add((edge.group(1), edge.group(2), private))
    ours = lambda n: (n.startswith("kvstash_") or n in EXECUTABLES) and n not in IGNORED
    # Mermaid node ids: executables apart, as kvstash-engine and kvstash_engine differ.
    ident = lambda n: ("bin_" + n.replace("-", "_")) if n in EXECUTABLES else n
    lines = set()
    for a, b, private in edges:
        na, nb = names.get(a), names.get(b)
        if na and nb and ours(na) and ours(nb):
            arrow = "-.->" if private else "-->"
            lines.add(f'  {ident(na)}["{shown[na]}"] {arrow} {ident(nb)}["{shown[nb]}"]')
    print("```mermaid")
    print("graph BT")
    for line in sorted(lines):
        print(line)
    print("```")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: architecture_graph.py DEPS.dot")
    main(sys.argv[1])
