#!/usr/bin/python3
"""Checks docs/architecture.md's components table against the build, each way.

The table is the `| folder | target | owns |` table under `## Components`. The build is what
CMake reaches from the top CMakeLists.txt through add_subdirectory, read as text (every branch of
every if(), so optional parts such as python/ or the CUDA kernels count too); nothing is
configured or built.

Rules, each disagreement one line on standard error and exit 1:
  - every folder the table names exists; a row that names targets covers a folder the build
    reaches;
  - every target a row names (an alias `kvstash::x` or a plain target name) is defined in that
    row's area, and every product target defined in a row's area is named in that row;
  - every product target outside tests/ lies in some row's area;
  - a row that names no target (tests/, scripts/, docs/) covers a folder that defines none.

A row's area is its folder and the folders under it, less those that have rows of their own. A
target lies in the area of the deepest row above the folder holding all of its listed sources
(the folder of the CMakeLists.txt that defines it when it lists none), so a backend whose
sources live in a subfolder with a row of its own (transport/ucx/) belongs to that row even when
its parent's CMakeLists.txt defines it. Product targets are those of add_library (not ALIAS,
IMPORTED, OBJECT or INTERFACE: those are parts and flags of other targets), add_executable,
pybind11_add_module, and add_custom_target unless another target depends on it
(add_dependencies: a step of that target). Targets under tests/ are never products.

  scripts/lib/components_table.py [--root DIR] [--doc FILE]

Needs /usr/bin/python3 only; reads text, so it takes well under a second.
"""
import argparse
import os
import re
import sys

# Folders whose targets are tests, never products.
TEST_ROOTS = ("tests",)
# Words of add_library/add_executable/pybind11_add_module that are not sources.
KEYWORDS = {
    "STATIC", "SHARED", "MODULE", "OBJECT", "INTERFACE", "IMPORTED", "ALIAS", "GLOBAL",
    "EXCLUDE_FROM_ALL", "WIN32", "MACOSX_BUNDLE", "NO_EXTRAS", "SYSTEM", "THIN_LTO", "OPT_SIZE",
    "WITHOUT_SOABI", "UNKNOWN", "PUBLIC", "PRIVATE",
}


class Target:
    def __init__(self, name, kind, where, folder, sources):
        self.name = name
        self.kind = kind  # "library", "object", "interface", "executable", "module", "custom"
        self.where = where  # "engine/CMakeLists.txt:25"
        self.folder = folder  # the folder of the CMakeLists.txt that defines it
        self.sources = sources  # literal sources, relative to the root
        self.aliases = []
        self.is_step = False  # a custom target another target depends on

    def home(self):
        """The deepest folder holding all of its literal sources inside its CMakeLists' folder."""
        dirs = [os.path.dirname(s) for s in self.sources]
        inside = [d for d in dirs if is_under(d, self.folder)]
        if not inside or len(inside) != len(dirs):
            return self.folder
        return os.path.commonpath(inside) if len(inside) > 1 else inside[0]

    def product(self):
        if is_under(self.folder, *TEST_ROOTS):
            return False
        if self.kind in ("object", "interface"):
            return False
        return not (self.kind == "custom" and self.is_step)

    def label(self, row_of):
        """Its names and where it is defined; where its sources are too when they decide its row."""
        shown = " / ".join(f"`{n}`" for n in [self.name] + self.aliases)
        home = self.home()
        if row_of(home) is row_of(self.folder):
            return f"{shown} ({self.where})"
        return f"{shown} ({self.where}, sources in {home}/)"


def is_under(path, *roots):
    """Whether `path` (relative to the root, "" for the root itself) is one of `roots` or below."""
    for root in roots:
        if root == "" or path == root or path.startswith(root + "/"):
            return True
    return False


def strip_comments(text):
    text = re.sub(r"#\[(=*)\[.*?\]\1\]", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)
    out = []
    for line in text.split("\n"):
        quoted = False
        for i, c in enumerate(line):
            if c == '"' and (i == 0 or line[i - 1] != "\\"):
                quoted = not quoted
            elif c == "#" and not quoted:
                line = line[:i]
                break
        out.append(line)
    return "\n".join(out)


COMMAND = re.compile(r"\b([A-Za-z_][A-Za-z0-9_]*)\s*\(")


def commands(text):
    """(name in lower case, arguments, line) of each command invocation of a CMake file."""
    text = strip_comments(text)
    pos = 0
    while True:
        match = COMMAND.search(text, pos)
        if not match:
            return
        line = text.count("\n", 0, match.start()) + 1
        i = match.end()
        depth, args, word, quoted = 1, [], "", False
        while i < len(text) and depth > 0:
            c = text[i]
            if quoted:
                if c == "\\" and i + 1 < len(text):
                    word += text[i : i + 2]
                    i += 2
                    continue
                if c == '"':
                    quoted = False
                else:
                    word += c
            elif c == '"':
                quoted = True
            elif c == "(":
                depth += 1
                word += c
            elif c == ")":
                depth -= 1
                if depth > 0:
                    word += c
            elif c.isspace():
                if word:
                    args.append(word)
                word = ""
            else:
                word += c
            i += 1
        if word:
            args.append(word)
        yield match.group(1).lower(), args, line
        pos = i


class Build:
    """The folders CMake reaches from the root and the targets they define."""

    def __init__(self, root):
        self.root = root
        self.folders = []  # relative to the root; "" is the root
        self.targets = {}  # by name
        self.aliases = {}  # alias -> target name
        self.errors = []
        depends = set()
        self._read("", depends)
        for name in depends:
            if name in self.targets and self.targets[name].kind == "custom":
                self.targets[name].is_step = True
        for alias, name in self.aliases.items():
            if name in self.targets:
                self.targets[name].aliases.append(alias)

    def _read(self, folder, depends):
        if folder in self.folders:
            return
        self.folders.append(folder)
        path = os.path.join(self.root, folder, "CMakeLists.txt")
        rel = os.path.join(folder, "CMakeLists.txt")
        with open(path, encoding="utf-8") as f:
            text = f.read()
        for name, args, line in commands(text):
            where = f"{rel}:{line}"
            if name == "add_subdirectory" and args:
                sub = args[0]
                if "$" in sub:
                    self.errors.append(f"error: {where}: add_subdirectory({sub}) names a variable; "
                                       "this check reads CMake files as text and cannot follow it")
                    continue
                child = os.path.normpath(os.path.join(folder, sub))
                if not os.path.isfile(os.path.join(self.root, child, "CMakeLists.txt")):
                    self.errors.append(f"error: {where}: add_subdirectory({sub}): no "
                                       f"{child}/CMakeLists.txt")
                    continue
                self._read(child, depends)
            elif name in ("add_library", "add_executable", "pybind11_add_module",
                          "add_custom_target") and args:
                self._define(name, args, folder, where)
            elif name == "add_dependencies" and len(args) > 1:
                depends.update(args[1:])
            elif name == "target_sources" and args and args[0] in self.targets:
                self.targets[args[0]].sources += self._sources(args[1:], folder)

    def _sources(self, args, folder):
        out = []
        for arg in args:
            if arg in KEYWORDS or "$" in arg or "<" in arg:
                continue
            path = arg if os.path.isabs(arg) else os.path.join(self.root, folder, arg)
            rel = os.path.relpath(os.path.normpath(path), self.root)
            if not rel.startswith(".."):
                out.append(rel)
        return out

    def _define(self, command, args, folder, where):
        name, rest = args[0], args[1:]
        if "$" in name:
            if not is_under(folder, *TEST_ROOTS):
                self.errors.append(f"error: {where}: {command}({name} ...) names a variable; "
                                   "this check reads CMake files as text and cannot follow it")
            return
        if "IMPORTED" in rest:
            return
        if rest[:1] == ["ALIAS"] and len(rest) > 1:
            self.aliases[name] = rest[1]
            return
        if command == "add_custom_target":
            kind, sources = "custom", []
        else:
            kind = {"add_library": "library", "add_executable": "executable",
                    "pybind11_add_module": "module"}[command]
            if command == "add_library" and rest[:1] == ["OBJECT"]:
                kind = "object"
            elif command == "add_library" and rest[:1] == ["INTERFACE"]:
                kind = "interface"
            sources = self._sources(rest, folder)
        if name in self.targets:
            self.errors.append(f"error: {where}: target `{name}` is defined again (first at "
                               f"{self.targets[name].where})")
            return
        self.targets[name] = Target(name, kind, where, folder, sources)


class Row:
    def __init__(self, line, folder, names):
        self.line = line
        self.folder = folder  # without its trailing "/"
        self.names = names  # as written: aliases or target names


def split_cells(line):
    cells, cell, i = [], "", 0
    line = line.strip()
    if line.startswith("|"):
        line = line[1:]
    if line.endswith("|") and not line.endswith("\\|"):
        line = line[:-1]
    while i < len(line):
        if line[i] == "\\" and i + 1 < len(line) and line[i + 1] == "|":
            cell += "|"
            i += 2
            continue
        if line[i] == "|":
            cells.append(cell.strip())
            cell = ""
        else:
            cell += line[i]
        i += 1
    cells.append(cell.strip())
    return cells


def without_parentheses(text):
    out, depth = "", 0
    for c in text:
        if c == "(":
            depth += 1
        elif c == ")" and depth > 0:
            depth -= 1
        elif depth == 0:
            out += c
    return out


def read_table(path, doc, errors):
    """The rows of the components table in `path` (named `doc` in errors), or None."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    try:
        start = next(i for i, l in enumerate(lines) if l.strip() == "## Components")
    except StopIteration:
        errors.append(f"error: {doc}: no '## Components' section")
        return None
    header = None
    for i in range(start + 1, len(lines)):
        if lines[i].startswith("## "):
            break
        if lines[i].lstrip().startswith("|") and [c.lower() for c in split_cells(lines[i])] == [
                "folder", "target", "owns"]:
            header = i
            break
    if header is None:
        errors.append(f"error: {doc}: no '| folder | target | owns |' table under '## Components'")
        return None
    rows = []
    for i in range(header + 2, len(lines)):
        if not lines[i].lstrip().startswith("|"):
            break
        cells = split_cells(lines[i])
        where = f"{doc}:{i + 1}"
        if len(cells) != 3:
            errors.append(f"error: {where}: a row of {len(cells)} cells, not 3")
            continue
        folder = re.fullmatch(r"`([^`]+)/`", cells[0])
        if not folder:
            errors.append(f"error: {where}: the folder cell is {cells[0]!r}, not one `folder/`")
            continue
        names = []
        for item in without_parentheses(cells[1]).split(","):
            item = item.strip()
            if not item:
                continue
            name = re.fullmatch(r"`([^`\s]+)`", item)
            if not name:
                errors.append(f"error: {where}: the target cell has {item!r}: list targets as "
                              "`name`, comma-separated, notes in parentheses")
                continue
            names.append(name.group(1))
        rows.append(Row(where, os.path.normpath(folder.group(1)), names))
    if not rows:
        errors.append(f"error: {doc}:{header + 1}: the components table has no rows")
    return rows


def check(root, path, doc):
    """The disagreements between the table in `path` (named `doc` in errors) and the build."""
    errors = []
    build = Build(root)
    errors += build.errors
    rows = read_table(path, doc, errors)
    if rows is None:
        return errors
    by_folder = {}
    for row in rows:
        if row.folder in by_folder:
            errors.append(f"error: {row.line}: row `{row.folder}/` again (first at "
                          f"{by_folder[row.folder].line})")
            continue
        by_folder[row.folder] = row

    def row_of(folder):
        """The row whose area holds `folder`: the deepest row at or above it."""
        best = None
        for row in by_folder.values():
            deeper = best is None or len(row.folder) > len(best.folder)
            if is_under(folder, row.folder) and deeper:
                best = row
        return best

    products = [t for t in build.targets.values() if t.product()]
    for row in by_folder.values():
        if not os.path.isdir(os.path.join(root, row.folder)):
            errors.append(f"error: {row.line}: row `{row.folder}/`: no such folder")
            continue
        in_area = [t for t in products if row_of(t.home()) is row]
        if not row.names:
            if in_area:
                errors.append(f"error: {row.line}: row `{row.folder}/` names no target, but its "
                              f"area defines {', '.join(t.label(row_of) for t in in_area)}")
            continue
        reached = any(is_under(f, row.folder) for f in build.folders) or any(
            is_under(t.home(), row.folder) for t in build.targets.values())
        if not reached:
            errors.append(f"error: {row.line}: row `{row.folder}/` names targets, but the build "
                          "reaches no CMakeLists.txt and no target's sources in it "
                          "(add_subdirectory from the top CMakeLists.txt)")
        named = set()
        for written in row.names:
            name = build.aliases.get(written, written)
            target = build.targets.get(name)
            if target is None:
                errors.append(f"error: {row.line}: row `{row.folder}/` names `{written}`, which "
                              "the build does not define (no target or alias of that name)")
                continue
            named.add(name)
            owner = row_of(target.home())
            if owner is not row:
                area = f"row `{owner.folder}/`'s area" if owner else "no row's area"
                errors.append(f"error: {row.line}: row `{row.folder}/` names `{written}`, but "
                              f"{target.label(row_of)} is in {area}")
        for target in in_area:
            if target.name not in named:
                errors.append(f"error: {row.line}: row `{row.folder}/` does not name "
                              f"{target.label(row_of)}, which its area defines")
    for target in products:
        if row_of(target.home()) is None:
            folder = target.folder or target.home()
            errors.append(f"error: {target.label(row_of)} is in no row's area: add a row for "
                          f"`{folder}/` (or a folder above it) to the components table")
    return errors


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", default=os.path.normpath(os.path.join(here, "..", "..")),
                        help="the source tree (default: this script's)")
    parser.add_argument("--doc", help="the document (default: ROOT/docs/architecture.md)")
    args = parser.parse_args()
    path = os.path.abspath(args.doc or os.path.join(args.root, "docs", "architecture.md"))
    root = os.path.abspath(args.root)
    doc = os.path.relpath(path, root) if path.startswith(root + "/") else path
    errors = check(root, path, doc)
    for error in errors:
        print(error, file=sys.stderr)
    if errors:
        print(f"{len(errors)} disagreement(s) between {doc}'s components table and the build",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
