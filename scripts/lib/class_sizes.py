#!/usr/bin/python3
"""Measures every C++ class of the given folders: its body where it is declared plus every member
function defined outside it (`Class::Method(...) {...}` in any file of those folders), in lines.

A class split over several files is still one class: the house rule (no class over 500 lines in
transport/ and connector/, ctest ArchitectureDoc.NoClassOver500Lines) caps the whole of it. Prints the classes over the limit, largest first; exits 1 if any.

  class_sizes.py [--limit N] [--top K] [--json] FOLDER...

Reads the sources as text (no compiler): a class is `class|struct NAME ... {` up to its matching
brace, nested classes are named Outer::Inner, and a definition is a line at the start of a
line naming `Qualified::Name::member(` whose body follows. Comments and string literals are
skipped when matching braces.
"""
import argparse
import json
import os
import re
import sys

CLASS_HEAD = re.compile(r"^\s*(?:template\s*<[^>]*>\s*)?(?:class|struct)\s+(?:\[\[[^\]]*\]\]\s*)?"
                        r"(?:alignas\([^)]*\)\s*)?((?:[A-Za-z_]\w*::)*[A-Za-z_]\w*)(?:\s+final)?\s*(?::[^;{]*)?\{?\s*$")
# A member defined outside its class: `Ret Ns::Class::Method(` at the start of a line (Google
# style puts namespace-scope definitions there), or a constructor/destructor.
DEFINITION = re.compile(r"^(?![ \t#/}])(?:[^(;=]*?[\s*&>])?((?:[A-Za-z_]\w*::)+)(~?[A-Za-z_]\w*|operator\W+)\s*\(")


def strip(text):
    """The text with comments and string/char literals blanked (newlines kept)."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append("".join(ch if ch == "\n" else " " for ch in text[i:j]))
            i = j
        elif text.startswith('R"', i):
            m = re.match(r'R"([^(]*)\(', text[i:])
            end = text.find(")" + m.group(1) + '"', i) if m else -1
            j = n if end < 0 else end + len(m.group(1)) + 2
            out.append("".join(ch if ch == "\n" else " " for ch in text[i:j]))
            i = j
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            j = min(j + 1, n)
            out.append(c + " " * (j - i - 2) + c if j - i >= 2 else text[i:j])
            i = j
        else:
            out.append(c)
            i += 1
    return "".join(out)


def match_brace(text, open_index):
    depth = 0
    for k in range(open_index, len(text)):
        if text[k] == "{":
            depth += 1
        elif text[k] == "}":
            depth -= 1
            if depth == 0:
                return k
    return len(text) - 1


def line_of(text, index):
    return text.count("\n", 0, index) + 1


def scan(path, sizes, where):
    with open(path, encoding="utf-8", errors="replace") as f:
        text = strip(f.read())
    lines = text.split("\n")
    offsets = [0]
    for line in lines:
        offsets.append(offsets[-1] + len(line) + 1)

    # Class bodies, with their nesting, by brace matching from each head.
    def classes_in(start, end, outer):
        i = line_of(text, start) - 1
        last = line_of(text, end) - 1
        while i <= last:
            m = CLASS_HEAD.match(lines[i])
            if m and offsets[i] >= start:
                brace = text.find("{", offsets[i])
                semicolon = text.find(";", offsets[i])
                if brace >= 0 and (semicolon < 0 or brace < semicolon) and brace <= end:
                    close = match_brace(text, brace)
                    name = outer + m.group(1)
                    n = line_of(text, close) - line_of(text, brace) + 1
                    sizes[name] = sizes.get(name, 0) + n
                    where.setdefault(name, set()).add(path)
                    classes_in(brace + 1, close - 1, name + "::")
                    i = line_of(text, close)
                    continue
            i += 1

    classes_in(0, len(text) - 1, "")
    # Out-of-line member definitions.
    for i, line in enumerate(lines):
        m = DEFINITION.match(line)
        if not m:
            continue
        start = offsets[i]
        brace = text.find("{", start)
        semicolon = text.find(";", start)
        if brace < 0 or (0 <= semicolon < brace):
            continue  # a declaration or a static member's definition
        close = match_brace(text, brace)
        owner = m.group(1)[:-2]
        # Namespaces qualify too (kvstash::transport::Foo::Bar): the class is the longest known
        # suffix, else the last name before the member.
        parts = owner.split("::")
        name = parts[-1]
        for k in range(len(parts)):
            candidate = "::".join(parts[k:])
            if candidate in sizes:
                name = candidate
                break
        sizes[name] = sizes.get(name, 0) + line_of(text, close) - i
        where.setdefault(name, set()).add(path)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit", type=int, default=500)
    parser.add_argument("--top", type=int, default=0, help="print the K largest classes too")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("folders", nargs="+")
    args = parser.parse_args()
    sizes, where = {}, {}
    paths = []
    for folder in args.folders:
        for root, _, files in os.walk(folder):
            paths += [os.path.join(root, f) for f in sorted(files) if f.endswith((".h", ".cc"))]
    # Headers first, so that definitions find their classes.
    for path in sorted(paths, key=lambda p: not p.endswith(".h")):
        scan(path, sizes, where)
    ranked = sorted(sizes.items(), key=lambda kv: -kv[1])
    over = [(name, n) for name, n in ranked if n > args.limit]
    if args.json:
        print(json.dumps({"limit": args.limit,
                          "over": [{"class": c, "lines": n, "files": sorted(where[c])} for c, n in over],
                          "largest": [{"class": c, "lines": n} for c, n in ranked[:args.top]]}))
    else:
        for name, n in ranked[:args.top]:
            print(f"{n:6d}  {name}")
        for name, n in over:
            print(f"error: class {name} is {n} lines (limit {args.limit}), in "
                  + ", ".join(sorted(where[name])))
        print(f"class sizes: {len(sizes)} classes in {' '.join(args.folders)}, "
              f"{len(over)} over {args.limit} lines")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
