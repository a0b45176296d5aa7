#!/usr/bin/python3
"""The house rules a compiler does not enforce, checked on the whole tree (scripts/lint.sh).

1. clang-format: every tracked C++ file is formatted as .clang-format says.
2. clang-tidy with the checks of .clang-tidy, every finding an error, on every .cc file the
   build compiles (BUILD/compile_commands.json: product, tests, benchmarks, fuzz targets),
   with clang's thread-safety analysis (-Wthread-safety) as an error in the same parse: GCC
   ignores the lock annotations (GUARDED_BY, REQUIRES), so this is where they are checked.
   A file clang cannot check is listed in scripts/lib/clang_exceptions.txt with its reason;
   nothing else is skipped.

  rules.py BUILD_DIR [--changed BASE] [--jobs N] [--json]

--changed BASE checks only the C++ files changed since BASE (a commit), and untracked ones.
Prints each failing file's findings, then one summary line (or a JSON object with --json);
exits 1 on any finding.
"""
import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXCEPTIONS = os.path.join(ROOT, "scripts", "lib", "clang_exceptions.txt")


def exceptions():
    """{path: reason} from clang_exceptions.txt (`path: reason`; # comments)."""
    listed = {}
    if not os.path.exists(EXCEPTIONS):
        return listed
    with open(EXCEPTIONS, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            path, sep, reason = line.partition(":")
            if not sep or not reason.strip():
                sys.exit(f"{EXCEPTIONS}:{number}: expected `path: reason`, got {line!r}")
            listed[path.strip()] = reason.strip()
    return listed


def tracked_cpp(changed_since):
    if changed_since:
        out = subprocess.run(["git", "diff", "--name-only", "--diff-filter=ACMR", changed_since,
                              "--", "*.cc", "*.h"], cwd=ROOT, check=True, capture_output=True,
                             text=True).stdout.split()
        out += subprocess.run(["git", "ls-files", "--others", "--exclude-standard", "--", "*.cc",
                               "*.h"], cwd=ROOT, check=True, capture_output=True,
                              text=True).stdout.split()
        return sorted(set(out))
    return subprocess.run(["git", "ls-files", "--", "*.cc", "*.h"], cwd=ROOT, check=True,
                          capture_output=True, text=True).stdout.split()


def format_findings(files):
    """clang-format's complaints, per file."""
    failing = {}
    for start in range(0, len(files), 50):
        batch = files[start:start + 50]
        r = subprocess.run(["clang-format", "--dry-run", "--Werror", *batch], cwd=ROOT,
                           capture_output=True, text=True)
        if r.returncode != 0:
            for line in r.stderr.splitlines():
                if ": error:" in line or ": warning:" in line:
                    path = os.path.relpath(os.path.join(ROOT, line.split(":", 1)[0]), ROOT)
                    failing.setdefault(path, []).append(line)
            if not failing:
                failing["clang-format"] = [r.stderr.strip() or f"exit {r.returncode}"]
    return failing


def tidy_one(build, path):
    command = ["clang-tidy", "-p", build, "--quiet",
               "--extra-arg=-Wthread-safety", "--extra-arg=-Werror=thread-safety",
               "--extra-arg=-Wno-unknown-warning-option"]
    r = subprocess.run(command + [path], cwd=ROOT, capture_output=True, text=True)
    # clang-tidy prints "N warnings generated." for the headers it filtered out: not findings.
    lines = [line for line in (r.stdout + r.stderr).splitlines()
             if line and not line.endswith(" generated.") and not line.startswith("Suppressed ")
             and "Use -header-filter" not in line and "display errors from all" not in line]
    return path, r.returncode, lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("build")
    parser.add_argument("--changed", metavar="BASE")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    build = os.path.abspath(args.build)
    commands = os.path.join(build, "compile_commands.json")
    if not os.path.exists(commands):
        sys.exit(f"error: no {commands}: build first (scripts/test.sh or scripts/demo.sh)")
    started = time.monotonic()
    skipped = exceptions()
    files = tracked_cpp(args.changed)

    formatting = format_findings(files)

    with open(commands, encoding="utf-8") as f:
        entries = json.load(f)
    compiled = sorted({os.path.relpath(e["file"], ROOT) for e in entries
                       if e["file"].endswith(".cc") and e["file"].startswith(ROOT + "/")})
    compiled = [p for p in compiled if not p.startswith("build")]
    # Sources the compile commands name but the tree no longer has (moved since the build was
    # configured): said, not checked; configuring the build again names the new ones.
    gone = [p for p in compiled if not os.path.exists(os.path.join(ROOT, p))]
    compiled = [p for p in compiled if p not in gone]
    for path in gone:
        print(f"note: {path} is in {commands} but not in the tree: configure the build again")
    stale = sorted(p for p in skipped if p not in compiled)
    chosen = [p for p in compiled if p not in skipped and (not args.changed or p in files)]
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        results = list(pool.map(lambda p: tidy_one(build, p), chosen))
    tidy_failing = {path: lines for path, code, lines in results if code != 0 or lines}

    for path, lines in sorted(formatting.items()):
        print(f"== clang-format: {path}\n" + "\n".join(lines[:20]))
    for path, lines in sorted(tidy_failing.items()):
        print(f"== clang-tidy: {path}\n" + "\n".join(lines))
    for path in stale:
        print(f"== {os.path.relpath(EXCEPTIONS, ROOT)}: {path} is listed but not built; remove it")
    summary = {
        "format_files": len(files), "format_failing": len(formatting),
        "tidy_files": len(chosen), "tidy_failing": len(tidy_failing),
        "exceptions": skipped, "stale_exceptions": stale,
        "seconds": round(time.monotonic() - started, 1),
    }
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"rules: clang-format {len(files)} files, {len(formatting)} failing; clang-tidy "
              f"and thread-safety {len(chosen)} files, {len(tidy_failing)} failing, "
              f"{len(skipped)} excepted; {summary['seconds']} s")
    return 1 if formatting or tidy_failing or stale else 0


if __name__ == "__main__":
    sys.exit(main())
