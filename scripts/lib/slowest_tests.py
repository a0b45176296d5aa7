#!/usr/bin/python3
"""Prints the slowest tests of one or more ctest runs (their --output-junit files), slowest first.

  slowest_tests.py [--top N] [--json] RUN.xml...

Each test is named with the file's build folder (build-asan: the sanitizer pass; build: the
rest), so a test run in both passes shows twice. A file that does not exist is skipped (a pass
that did not run).
"""
import argparse
import json
import os
import sys
import xml.etree.ElementTree as ElementTree


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("runs", nargs="+")
    args = parser.parse_args()
    tests = []
    for path in args.runs:
        if not os.path.exists(path):
            continue
        where = os.path.basename(os.path.dirname(os.path.abspath(path)))
        for case in ElementTree.parse(path).getroot().iter("testcase"):
            status = case.get("status", "run")
            if case.find("failure") is not None:
                status = "failed"
            elif case.find("skipped") is not None:
                status = "skipped"
            tests.append({"test": case.get("name", "?"), "build": where,
                          "seconds": float(case.get("time", "0") or 0), "status": status})
    tests.sort(key=lambda t: -t["seconds"])
    top = tests[:args.top]
    if args.json:
        print(json.dumps({"slowest": top, "tests": len(tests),
                          "seconds": round(sum(t["seconds"] for t in tests), 1)}))
        return 0
    print(f"slowest {len(top)} of {len(tests)} tests "
          f"({sum(t['seconds'] for t in tests):.0f} s of test time in all):")
    for t in top:
        note = "" if t["status"] in ("run", "passed") else f"  ({t['status']})"
        print(f"  {t['seconds']:7.1f} s  {t['test']}  [{t['build']}]{note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
