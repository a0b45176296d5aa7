#!/usr/bin/python3
"""Fails when an #include arrow goes up: when a library includes a program's code, or a header
of a component it does not depend on in the build.

    scripts/lib/include_arrows.py [--root DIR]

Configures a scratch build of the tree at DIR (default: this checkout; no CUDA, no tests, no
benchmarks, no Python module: the product's libraries and programs only; finding pybind11 alone
took as long as the rest of the configure, and the module sits on top, where nothing includes
it) and reads from that build, not from a list kept here:
  - the link graph, from `cmake --graphviz`: a component may include what it links, directly or
    through what that links, and nothing else;
  - each target's sources, from CMake's file API: a library's folder is where its sources'
    `src/` is (transport/src/ucx/x.cc: transport/; transport/ucx/src/x.cc: transport/ucx/), so a
    folder may hold nested component folders; a program's folder is the one its sources share.
Library code is every file under <folder>/include/ and <folder>/src/ of a library folder (the
deepest that holds it), whichever target builds it: a program's sources there are the library's
code, and may include only what the library may. Program code is every other file of a
program's folder (tools/kvstash/, node/daemon/, tools/kvstash-engine/).

An include is checked when it names a file of the tree: "kvstash/<name>/..." is looked up in
every library folder's include/ (a header built into the build tree, kvstash/proto/wire.pb.h,
by its folder), any other quoted name beside the including file, then in its library folder's
src/ and include/. What the tree does not hold (the standard library, CLI11, fmt) is not
checked. Prints one line per offending #include, FILE:LINE: what is wrong, and exits 1; exits 0
when every arrow points down, 2 when the tree cannot be configured. Builds nothing.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

SOURCE_SUFFIXES = (".h", ".hpp", ".hh", ".inc", ".cc", ".cpp", ".cxx", ".cu", ".cuh")
LIBRARY_TYPES = {"STATIC_LIBRARY", "SHARED_LIBRARY", "MODULE_LIBRARY", "OBJECT_LIBRARY",
                 "INTERFACE_LIBRARY"}
INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]')
DOT_NODE = re.compile(r'^\s*"(node\d+)" \[ label = "([^"]*)"')
DOT_EDGE = re.compile(r'^\s*"(node\d+)" -> "(node\d+)"')


def configure(root, scratch):
    """Configures `root` in `scratch` with the file API's code model asked for; returns the
    graphviz file and the code model's reply directory."""
    query = os.path.join(scratch, ".cmake", "api", "v1", "query")
    os.makedirs(query)
    open(os.path.join(query, "codemodel-v2"), "w").close()
    dot = os.path.join(scratch, "deps.dot")
    run = subprocess.run(
        ["cmake", "-S", root, "-B", scratch, "-DKVSTASH_WITH_CUDA=OFF", "-DKVSTASH_BUILD_TESTS=OFF",
         "-DKVSTASH_BUILD_BENCHMARKS=OFF", "-DKVSTASH_BUILD_PYTHON=OFF", "--graphviz=" + dot],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if run.returncode != 0:
        sys.stderr.write(run.stdout)
        print(f"error: cmake could not configure {root} (output above)", file=sys.stderr)
        sys.exit(2)
    return dot, os.path.join(scratch, ".cmake", "api", "v1", "reply")


def link_graph(dot):
    """{target: set of targets it links} from the graphviz file, and {target: shown name}."""
    names, shown, edges = {}, {}, {}
    with open(dot, encoding="utf-8") as f:
        for line in f:
            node = DOT_NODE.match(line)
            if node:
                label = node.group(2).split("\\n")
                names[node.group(1)] = label[0]
                shown[label[0]] = label[1].strip("()") if len(label) > 1 else label[0]
                continue
            edge = DOT_EDGE.match(line)
            if edge and edge.group(1) in names and edge.group(2) in names:
                edges.setdefault(names[edge.group(1)], set()).add(names[edge.group(2)])
    return edges, shown


def below(target, edges):
    """Every target `target` links, directly or not."""
    seen, stack = set(), [target]
    while stack:
        for dep in edges.get(stack.pop(), ()):
            if dep not in seen:
                seen.add(dep)
                stack.append(dep)
    return seen


def code_model(reply, root):
    """[(name, type, [source paths relative to root])] for every target of the build."""
    index = [f for f in os.listdir(reply) if f.startswith("codemodel-v2-")]
    with open(os.path.join(reply, index[0]), encoding="utf-8") as f:
        model = json.load(f)
    targets = []
    for ref in model["configurations"][0]["targets"]:
        with open(os.path.join(reply, ref["jsonFile"]), encoding="utf-8") as f:
            target = json.load(f)
        sources = []
        for source in target.get("sources", []):
            path = source["path"]
            if os.path.isabs(path):  # generated in the build tree, or outside the tree
                path = os.path.relpath(path, root)
                if path.startswith(".."):
                    continue
            sources.append(os.path.normpath(path))
        targets.append((target["name"], target["type"], target.get("paths", {}).get("source", "."),
                        sources))
    return targets


def library_folder(sources, cmake_dir):
    # The folder above the first src/ of its sources; a library without one (header-only) is
    # its CMakeLists.txt's folder.
    for path in sources:
        parts = path.split(os.sep)
        if "src" in parts[1:]:
            return os.sep.join(parts[:parts.index("src", 1)])
    return os.path.normpath(cmake_dir)


def within(path, folder):
    return folder == "." or path == folder or path.startswith(folder + os.sep)


def deepest(path, folders):
    found = [f for f in folders if within(path, f)]
    return max(found, key=len) if found else None


class Tree:
    """Who owns each file of the tree: library targets (by folder) or a program."""

    def __init__(self, root, targets, edges, shown):
        self.root, self.edges, self.shown = root, edges, shown
        self.libraries = {}  # folder -> [library targets]
        self.programs = {}  # folder -> [executables]
        self.source_of = {}  # library source -> its target
        for name, kind, cmake_dir, sources in targets:
            if kind in LIBRARY_TYPES:
                if kind != "INTERFACE_LIBRARY" or os.path.isdir(
                        os.path.join(root, cmake_dir, "include")):
                    folder = library_folder(sources, cmake_dir)
                    self.libraries.setdefault(folder, []).append(name)
                    for s in sources:
                        self.source_of[s] = name
            elif kind == "EXECUTABLE" and sources:
                folder = os.path.commonpath([os.path.dirname(s) for s in sources]) or "."
                self.programs.setdefault(folder, []).append(name)
        # A program whose sources span a library's folder would make that library's code its own.
        self.layout_problems = []
        for folder, names in list(self.programs.items()):
            spanned = sorted(f for f in self.libraries if within(f, folder))
            if spanned:
                del self.programs[folder]
                self.layout_problems.append(
                    f"{folder}/: the sources of program {', '.join(names)} span library folder(s) "
                    f"{', '.join(f + '/' for f in spanned)}: give the program a folder of its own")

    def library_of(self, path):
        """(folder, [targets]) of the library whose code `path` is, or None."""
        folder = deepest(path, self.libraries)
        if folder is None:
            return None
        if not (within(path, os.path.join(folder, "include")) or
                within(path, os.path.join(folder, "src"))):
            return None
        if path in self.source_of:
            return folder, [self.source_of[path]]
        return folder, self.libraries[folder]

    def program_of(self, path):
        folder = deepest(path, self.programs)
        return (folder, self.programs[folder]) if folder is not None else None

    def owner(self, path):
        """('library'|'program', folder, [targets]) of a file, or None for the rest (tests...)."""
        library = self.library_of(path)
        if library:
            return ("library",) + library
        program = self.program_of(path)
        return ("program",) + program if program else None

    def resolve(self, includer, name, quoted, includer_folder):
        """The file of the tree an include names (relative to the root), or a library folder
        for a header the tree does not hold under a library's include/kvstash/<dir>/; None for
        what is not the tree's."""
        exists = lambda p: os.path.isfile(os.path.join(self.root, p))
        if name.startswith("kvstash/"):
            for folder in self.libraries:
                candidate = os.path.normpath(os.path.join(folder, "include", name))
                if exists(candidate):
                    return candidate
            # Generated (kvstash/proto/wire.pb.h): the folder with the deepest include dir that
            # holds it, at least include/kvstash/<name>/.
            best, depth = None, 1
            parts = os.path.dirname(name).split("/")
            for folder in self.libraries:
                for n in range(len(parts), 1, -1):
                    if n > depth and os.path.isdir(
                            os.path.join(self.root, folder, "include", *parts[:n])):
                        best, depth = folder, n
                        break
            return ("folder", best) if best else None
        if not quoted:
            return None
        candidates = [os.path.join(os.path.dirname(includer), name)]
        if includer_folder is not None:
            candidates += [os.path.join(includer_folder, "src", name),
                           os.path.join(includer_folder, "include", name)]
        for candidate in candidates:
            candidate = os.path.normpath(candidate)
            if exists(candidate):
                return candidate
        return None

    def names(self, targets):
        return ", ".join(self.shown.get(t, t) for t in sorted(targets))

    def check(self, path):
        """The offending includes of one file, as lines."""
        owner = self.owner(path)
        if owner is None:
            return []
        kind, folder, targets = owner
        allowed = set(targets)
        for t in targets:
            allowed |= below(t, self.edges)
        problems = []
        with open(os.path.join(self.root, path), encoding="utf-8", errors="replace") as f:
            lines = f.readlines()
        for number, line in enumerate(lines, 1):
            match = INCLUDE.match(line)
            if not match:
                continue
            quoted, name = match.group(1) == '"', match.group(2)
            resolved = self.resolve(path, name, quoted, folder if kind == "library" else None)
            if resolved is None:
                continue
            spelt = f'"{name}"' if quoted else f"<{name}>"
            where = f"{path}:{number}: #include {spelt}: {self.names(targets)} ({folder}/)"
            if isinstance(resolved, tuple):  # a header the build generates
                included_folder = resolved[1]
                included = self.libraries[included_folder]
            else:
                program = self.program_of(resolved)
                if program and not (kind == "program" and program[0] == folder):
                    problems.append(f"{where} includes the code of program "
                                    f"{', '.join(program[1])} ({program[0]}/): programs sit on "
                                    f"top, and nothing includes them")
                    continue
                library = self.library_of(resolved)
                if library is None:
                    continue
                included_folder, included = library
            if not allowed & set(included):
                problems.append(f"{where} does not depend on {self.names(included)} "
                                f"({included_folder}/) in the build: an include arrow going up")
        return problems

    def files(self):
        """Every source and header of a library's include/ and src/ or of a program's folder."""
        tops = {os.path.join(f, d) for f in self.libraries for d in ("include", "src")}
        tops |= set(self.programs)
        seen = set()
        for top in sorted(tops):
            for dirpath, dirnames, filenames in os.walk(os.path.join(self.root, top)):
                dirnames.sort()
                for name in sorted(filenames):
                    if name.endswith(SOURCE_SUFFIXES):
                        path = os.path.relpath(os.path.join(dirpath, name), self.root)
                        if path not in seen:
                            seen.add(path)
                            yield path


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", default=os.path.join(os.path.dirname(__file__), "..", ".."),
                        help="the source tree to check (default: this checkout)")
    args = parser.parse_args()
    root = os.path.realpath(args.root)
    with tempfile.TemporaryDirectory(prefix="include-arrows-") as scratch:
        dot, reply = configure(root, scratch)
        edges, shown = link_graph(dot)
        tree = Tree(root, code_model(reply, root), edges, shown)
    problems = tree.layout_problems + [p for path in tree.files() for p in tree.check(path)]
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    if problems:
        print(f"{len(problems)} include(s) going up or into a program "
              f"(scripts/lib/include_arrows.py)", file=sys.stderr)
        return 1
    count = sum(1 for _ in tree.files())
    print(f"include arrows: {count} files of {len(tree.libraries)} library folders and "
          f"{len(tree.programs)} programs, every include points down")
    return 0


if __name__ == "__main__":
    sys.exit(main())
