#!/usr/bin/python3
"""Tests of scripts/lib/class_sizes.py: a class is measured whole (its body where declared plus
every member defined outside it, in any file, nested classes under their outer name), and one
over the limit fails the check (exit 1) naming it, so ctest ArchitectureDoc.NoClassOver500Lines
cannot pass by measuring nothing.
"""
import json
import os
import subprocess
import sys
import tempfile
import unittest

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
SCRIPT = os.path.join(ROOT, "scripts", "lib", "class_sizes.py")


def body(lines):
    return "".join(f"  int f{i}() {{ return {i}; }}\n" for i in range(lines))


def method(owner, name, lines):
    inner = "".join(f"  x += {i};\n" for i in range(lines))
    return f"int {owner}::{name}(int x) {{\n{inner}  return x;\n}}\n\n"


class ClassSizesTest(unittest.TestCase):
    def run_script(self, files, *args):
        with tempfile.TemporaryDirectory() as folder:
            for path, text in files.items():
                os.makedirs(os.path.dirname(os.path.join(folder, path)), exist_ok=True)
                with open(os.path.join(folder, path), "w", encoding="utf-8") as f:
                    f.write(text)
            r = subprocess.run([sys.executable, SCRIPT, "--json", *args, folder],
                               capture_output=True, text=True)
            return r.returncode, json.loads(r.stdout)

    def test_a_class_split_over_files_is_measured_whole(self):
        files = {
            "include/widget.h": "#pragma once\nclass Widget {\n public:\n  class Impl;\n"
                                + body(100) + "};\n"
                                + "class Widget::Impl {\n public:\n" + body(200) + "};\n",
            "src/a.cc": method("Widget::Impl", "A", 150) + method("Widget", "B", 10),
            "src/b.cc": "// comments { with braces } do not count as code\n"
                        + method("kvstash::Widget::Impl", "C", 160),
        }
        code, report = self.run_script(files, "--limit", "500", "--top", "5")
        self.assertEqual(code, 1)
        over = {entry["class"]: entry for entry in report["over"]}
        self.assertIn("Widget::Impl", over)
        # 203 lines of body, 153 and 163 of out-of-line members.
        self.assertGreaterEqual(over["Widget::Impl"]["lines"], 500)
        self.assertEqual(len(over["Widget::Impl"]["files"]), 3)
        self.assertNotIn("Widget", over)

    def test_classes_within_the_limit_pass(self):
        files = {"a.h": "class Small {\n" + body(50) + "};\n",
                 "a.cc": method("Small", "Run", 40)}
        code, report = self.run_script(files, "--limit", "500", "--top", "1")
        self.assertEqual(code, 0)
        self.assertEqual(report["over"], [])
        self.assertEqual(report["largest"][0]["class"], "Small")
        self.assertGreater(report["largest"][0]["lines"], 90)


if __name__ == "__main__":
    unittest.main()
