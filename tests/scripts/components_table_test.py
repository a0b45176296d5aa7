#!/usr/bin/python3
"""Tests of scripts/lib/components_table.py: every kind of disagreement between a components
table and a build fails the check (exit 1) with an error naming it, so the check of the real
table (ctest ArchitectureDoc.ComponentsTableMatchesBuild) cannot pass by saying nothing.

Each case writes a small source tree and document into a temporary folder, or changes a copy of
the real docs/architecture.md, and runs the script as ctest does.
"""
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import unittest

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
SCRIPT = os.path.join(ROOT, "scripts", "lib", "components_table.py")

# A tree with a library and a daemon (alpha/), a library whose tool, object library and
# copy step live in a subfolder (beta/, beta/sub/), a backend whose sources are in a subfolder
# of the folder that defines it (beta/ucx/), tests, and a folder outside the build (scripts/).
TREE = {
    "CMakeLists.txt": """
        project(demo)
        add_library(demo_flags INTERFACE)  # flags, not a product
        add_subdirectory(alpha)
        add_subdirectory(beta)
        if(WITH_TESTS)
          add_subdirectory(tests)
        endif()
    """,
    "alpha/CMakeLists.txt": """
        add_library(kvstash_alpha src/a.cc src/b.cc)
        add_library(kvstash::alpha ALIAS kvstash_alpha)
        add_executable(alphad daemon/main.cc)
    """,
    "beta/CMakeLists.txt": """
        add_library(kvstash_beta
          src/beta.cc  # a comment with a ) in it
        )
        add_library(kvstash::beta ALIAS kvstash_beta)
        add_library(kvstash_beta_ucx ucx/src/one.cc ucx/src/two.cc)
        add_library(kvstash::beta_ucx ALIAS kvstash_beta_ucx)
        add_subdirectory(sub)
    """,
    "beta/sub/CMakeLists.txt": """
        add_executable(beta_tool tool.cc)
        add_library(beta_parts OBJECT parts.cu)
        add_custom_target(beta_files ALL DEPENDS "${out}")
        add_dependencies(beta_tool beta_files)
    """,
    "tests/CMakeLists.txt": """
        add_executable(alpha_test alpha_test.cc)
        add_executable(${name} ${sources})
    """,
    "beta/ucx/src/one.cc": "",
    "scripts/run.sh": "",
}

DOC = """
    # demo

    ## Components

    | folder | target | owns |
    |---|---|---|
    | `alpha/` | `kvstash::alpha`, `alphad` | the alpha library and its daemon |
    | `beta/` | `kvstash::beta`, `beta_tool` (with its files\\|parts) | beta |
    | `beta/ucx/` | `kvstash::beta_ucx` | beta over UCX |
    | `tests/` | | the tests |
    | `scripts/` | | scripts |

    ## Next
"""


def run(root, doc):
    result = subprocess.run([sys.executable, SCRIPT, "--root", root, "--doc", doc],
                            capture_output=True, text=True, timeout=60)
    return result.returncode, result.stderr


class SyntheticTreeTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()
        self.root = self.dir.name
        for path, text in TREE.items():
            self.write(path, text)
        self.doc = os.path.join(self.root, "doc.md")
        self.write("doc.md", DOC)

    def tearDown(self):
        self.dir.cleanup()

    def write(self, path, text):
        full = os.path.join(self.root, path)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "w", encoding="utf-8") as f:
            f.write(textwrap.dedent(text))

    def edit_doc(self, old, new):
        with open(self.doc, encoding="utf-8") as f:
            text = f.read()
        self.assertIn(old, text)
        with open(self.doc, "w", encoding="utf-8") as f:
            f.write(text.replace(old, new))

    def fails_with(self, *patterns):
        code, errors = run(self.root, self.doc)
        self.assertEqual(code, 1, f"expected exit 1, got {code}: {errors}")
        for pattern in patterns:
            self.assertRegex(errors, pattern)
        return errors

    def test_the_table_that_matches_passes(self):
        code, errors = run(self.root, self.doc)
        self.assertEqual((code, errors), (0, ""))

    def test_a_build_folder_without_a_row_fails(self):
        self.edit_doc(
            "| `alpha/` | `kvstash::alpha`, `alphad` | the alpha library and its daemon |\n", "")
        self.fails_with(r"`kvstash_alpha` / `kvstash::alpha` \(alpha/CMakeLists.txt:2\) is in no "
                        r"row's area: add a row for `alpha/`",
                        r"`alphad` \(alpha/CMakeLists.txt:4\) is in no row's area")

    def test_a_renamed_target_fails_both_ways(self):
        self.edit_doc("`kvstash::alpha`, `alphad`", "`kvstash::alfa`, `alphad`")
        self.fails_with(r"row `alpha/` names `kvstash::alfa`, which the build does not define",
                        r"row `alpha/` does not name `kvstash_alpha` / `kvstash::alpha`")

    def test_a_target_left_out_of_its_row_fails(self):
        self.edit_doc("`kvstash::alpha`, `alphad`", "`kvstash::alpha`")
        self.fails_with(r"row `alpha/` does not name `alphad` \(alpha/CMakeLists.txt:4\)")

    def test_a_target_of_a_subfolder_without_a_row_counts_for_its_parent(self):
        self.edit_doc("`kvstash::beta`, `beta_tool` (with its files\\|parts)", "`kvstash::beta`")
        self.fails_with(r"row `beta/` does not name `beta_tool` \(beta/sub/CMakeLists.txt:2\)")

    def test_a_folder_that_does_not_exist_fails(self):
        self.edit_doc("| `scripts/` | | scripts |",
                      "| `scripts/` | | scripts |\n| `gamma/` | | gone |")
        self.fails_with(r"row `gamma/`: no such folder")

    def test_a_target_named_in_another_rows_area_fails(self):
        self.edit_doc("`kvstash::beta_ucx`", "`kvstash::beta_ucx`, `kvstash::beta`")
        self.fails_with(r"row `beta/ucx/` names `kvstash::beta`, but `kvstash_beta` / "
                        r"`kvstash::beta` \(beta/CMakeLists.txt:2\) is in row `beta/`'s area")

    def test_a_backend_row_removed_gives_its_target_back_to_the_parent(self):
        self.edit_doc("| `beta/ucx/` | `kvstash::beta_ucx` | beta over UCX |\n", "")
        self.fails_with(r"row `beta/` does not name `kvstash_beta_ucx` / `kvstash::beta_ucx`")

    def test_a_row_without_targets_for_a_folder_that_defines_some_fails(self):
        self.edit_doc("| `alpha/` | `kvstash::alpha`, `alphad` |", "| `alpha/` | |")
        self.fails_with(r"row `alpha/` names no target, but its area defines `kvstash_alpha`")

    def test_a_row_with_targets_outside_the_build_fails(self):
        self.edit_doc("| `scripts/` | | scripts |", "| `scripts/` | `run` | scripts |")
        self.fails_with(r"row `scripts/` names targets, but the build reaches no CMakeLists.txt",
                        r"row `scripts/` names `run`, which the build does not define")

    def test_a_new_build_folder_fails_until_the_table_has_it(self):
        self.write("CMakeLists.txt", TREE["CMakeLists.txt"] + "add_subdirectory(delta)\n")
        self.write("delta/CMakeLists.txt", "add_library(kvstash_delta delta.cc)\n")
        self.fails_with(r"`kvstash_delta` \(delta/CMakeLists.txt:1\) is in no row's area")

    def test_a_custom_target_that_is_a_product_must_be_named(self):
        self.write("beta/sub/CMakeLists.txt",
                   TREE["beta/sub/CMakeLists.txt"].replace("add_dependencies(beta_tool beta_files)",
                                                           ""))
        self.fails_with(r"row `beta/` does not name `beta_files`")

    def test_a_row_twice_fails(self):
        self.edit_doc("| `scripts/` | | scripts |",
                      "| `scripts/` | | scripts |\n| `scripts/` | | again |")
        self.fails_with(r"row `scripts/` again")

    def test_an_unreadable_target_cell_fails(self):
        self.edit_doc("`kvstash::alpha`, `alphad`", "`kvstash::alpha` and `alphad`")
        self.fails_with(r"the target cell has .*list targets as `name`, comma-separated")

    def test_a_document_without_the_table_fails(self):
        self.edit_doc("| folder | target | owns |", "| folder | targets | owns |")
        self.fails_with(r"no '\| folder \| target \| owns \|' table under '## Components'")


class RealTableTest(unittest.TestCase):
    """The real document with one row removed, or one target renamed, fails."""

    def setUp(self):
        with open(os.path.join(ROOT, "docs", "architecture.md"), encoding="utf-8") as f:
            self.text = f.read()
        # The first row that names a target, and its first target.
        self.row = re.search(r"^\| `([^`]+)/` \| `([^`]+)`[^\n]*\n", self.text, re.M)
        self.assertIsNotNone(self.row, "docs/architecture.md has no row naming a target")
        self.dir = tempfile.TemporaryDirectory()
        self.doc = os.path.join(self.dir.name, "architecture.md")

    def tearDown(self):
        self.dir.cleanup()

    def check(self, text):
        with open(self.doc, "w", encoding="utf-8") as f:
            f.write(text)
        return run(ROOT, self.doc)

    def test_a_row_removed_fails_naming_its_target(self):
        code, errors = self.check(self.text.replace(self.row.group(0), ""))
        self.assertEqual(code, 1, errors)
        self.assertRegex(errors, re.escape(f"`{self.row.group(2)}`") + r".* is in no row's area")

    def test_a_target_renamed_fails_naming_both(self):
        name = self.row.group(2)
        code, errors = self.check(self.text.replace(self.row.group(0),
                                                    self.row.group(0).replace(
                                                        f"`{name}`", f"`{name}_renamed`", 1)))
        self.assertEqual(code, 1, errors)
        self.assertIn(f"names `{name}_renamed`, which the build does not define", errors)
        self.assertRegex(errors, f"row `{re.escape(self.row.group(1))}/` does not name .*`"
                         + re.escape(name) + "`")


if __name__ == "__main__":
    unittest.main(verbosity=2)
