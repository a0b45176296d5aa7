#!/usr/bin/python3
"""Checks kvstash's lock annotations with clang's thread-safety analysis.

GCC ignores GUARDED_BY and friends, so the annotations are only checked by clang: this runs
`clang++ -fsyntax-only -Wthread-safety -Werror=thread-safety` (no code generation) over every
kvstash source whose compile command is in BUILD/compile_commands.json and that uses the
annotated lock (kvstash::Mutex) or its annotations, or includes a header that does, in parallel, with the build's own include
paths and definitions. Prints each failing file's diagnostics; exits 1 if any.

  thread_safety.py BUILD_DIR [JOBS]
"""
import json
import os
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

ANNOTATED = re.compile(rb"GUARDED_BY|REQUIRES|ACQUIRE|RELEASE|EXCLUDES|MutexLock|kvstash/common/mutex\.h")
# GCC-only flags clang does not take.
DROP = {"-fno-semantic-interposition"}


def clang_command(entry):
    args = entry.get("arguments") or shlex.split(entry["command"])
    out = ["clang++"]
    skip = False
    for a in args[1:]:
        if skip:
            skip = False
            continue
        if a in ("-o", "-MF", "-MT", "-MQ"):
            skip = True
            continue
        if a in ("-c", "-MD", "-MMD") or a in DROP or a.startswith("-fsanitize"):
            continue
        out.append(a)
    return out + ["-fsyntax-only", "-Wno-unknown-warning-option", "-Wthread-safety",
                  "-Werror=thread-safety"]


def main(build, jobs):
    with open(os.path.join(build, "compile_commands.json"), encoding="utf-8") as f:
        entries = json.load(f)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    root = os.path.dirname(root)
    # Headers that declare annotated members or locks: a source including one is checked too.
    annotated_headers = set()
    for folder, _, files in os.walk(root):
        if "/build" in folder[len(root):] or "/." in folder[len(root):]:
            continue
        for name in files:
            if name.endswith(".h"):
                with open(os.path.join(folder, name), "rb") as header:
                    if ANNOTATED.search(header.read()):
                        annotated_headers.add(name.encode())
    include = re.compile(rb'#include "(?:[^"]*/)?([^"/]+\.h)"')
    chosen = []
    for e in entries:
        path = e["file"]
        if not path.startswith(root) or "/build" in path[len(root):] or not path.endswith(".cc"):
            continue
        with open(path, "rb") as src:
            text = src.read()
        if ANNOTATED.search(text) or any(h in annotated_headers for h in include.findall(text)):
            chosen.append(e)

    def check(e):
        r = subprocess.run(clang_command(e), cwd=e["directory"], capture_output=True, text=True)
        return e["file"], r.returncode, r.stderr

    failed = 0
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        for path, code, err in pool.map(check, chosen):
            if code != 0:
                failed += 1
                print(f"== {os.path.relpath(path, root)}\n{err}", end="")
    print(f"thread-safety analysis (clang): {len(chosen)} files, {failed} failing")
    return 1 if failed else 0


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        sys.exit("usage: thread_safety.py BUILD_DIR [JOBS]")
    sys.exit(main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) == 3 else os.cpu_count() or 1))
