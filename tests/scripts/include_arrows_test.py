#!/usr/bin/python3
"""scripts/lib/include_arrows.py cannot pass silently: on a scratch copy of the tree with
offending includes written in, it exits 1 and names each of them, and it lets a nested
component's downward includes be.

Written into the copy:
  - common/src/cli.cc includes kvstash/worker/server.h (common depends on no worker: up);
  - engine/src/engine.cc includes tools/kvstash-engine/cli_common.h (a program's code);
  - a library nested in common/ (common/nested_probe/, its own CMakeLists.txt, on kvstash::common)
    that common/src/cli.cc includes (up: common does not link it), and whose own source includes
    kvstash/common/ and its own header (down: not reported).
"""
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.realpath(os.path.join(os.path.dirname(__file__), "..", ".."))
CHECK = os.path.join(ROOT, "scripts", "lib", "include_arrows.py")


def copy_tree(dst):
    def skipped(directory, names):
        top = os.path.realpath(directory) == ROOT
        at_top = lambda n: n.startswith("build") or n in (".git", ".cache")
        return [n for n in names if n == "__pycache__" or (top and at_top(n))]
    shutil.copytree(ROOT, dst, ignore=skipped, symlinks=True)


def append(path, text):
    with open(path, "a", encoding="utf-8") as f:
        f.write(text)


def line_count(path):
    with open(path, encoding="utf-8") as f:
        return sum(1 for _ in f)


def write(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def main():
    failures = []
    with tempfile.TemporaryDirectory(prefix="include-arrows-test-") as scratch:
        tree = os.path.join(scratch, "tree")
        copy_tree(tree)
        cli = os.path.join(tree, "common", "src", "cli.cc")
        engine = os.path.join(tree, "engine", "src", "engine.cc")
        up_line = line_count(cli) + 1
        append(cli, '#include "kvstash/worker/server.h"\n')
        nested_line = line_count(cli) + 1
        append(cli, '#include "kvstash/nested_probe/probe.h"\n')
        program_line = line_count(engine) + 1
        append(engine, '#include "../../tools/kvstash-engine/cli_common.h"\n')
        probe = os.path.join(tree, "common", "nested_probe")
        write(os.path.join(probe, "CMakeLists.txt"),
              "add_library(kvstash_nested_probe src/probe.cc)\n"
              "target_include_directories(kvstash_nested_probe PUBLIC "
              "${CMAKE_CURRENT_SOURCE_DIR}/include)\n"
              "target_link_libraries(kvstash_nested_probe PUBLIC kvstash::common)\n")
        write(os.path.join(probe, "include", "kvstash", "nested_probe", "probe.h"),
              '#pragma once\n#include "kvstash/common/status.h"\n')
        write(os.path.join(probe, "src", "probe.cc"),
              '#include "kvstash/nested_probe/probe.h"\n#include "kvstash/common/cli.h"\n')
        append(os.path.join(tree, "common", "CMakeLists.txt"), "add_subdirectory(nested_probe)\n")

        run = subprocess.run([CHECK, "--root", tree], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
        errors = [l for l in run.stderr.splitlines() if l.startswith("error: ")]
        if run.returncode != 1:
            failures.append(f"exit status {run.returncode}, expected 1")
        expected = {
            f"common/src/cli.cc:{up_line}: ": "does not depend on kvstash::worker (worker/)",
            f"common/src/cli.cc:{nested_line}: ":
                "does not depend on kvstash_nested_probe (common/nested_probe/)",
            f"engine/src/engine.cc:{program_line}: ":
                "includes the code of program kvstash-engine (tools/kvstash-engine/)",
        }
        for where, what in expected.items():
            if not any(where in e and what in e for e in errors):
                failures.append(f"no error at {where}saying '{what}'")
        for e in errors:
            if "nested_probe/src/" in e or "nested_probe/include/" in e:
                failures.append(f"a downward include of the nested library reported: {e}")
    if failures:
        print("include_arrows.py on a tree with offending includes:", file=sys.stderr)
        for f in failures:
            print(f"  FAILED: {f}", file=sys.stderr)
        print("its output:\n" + run.stdout + run.stderr, file=sys.stderr)
        return 1
    print(f"include_arrows.py reported the {len(expected)} offending includes written in, "
          f"and no downward one")
    return 0


if __name__ == "__main__":
    sys.exit(main())
