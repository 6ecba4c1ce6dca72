"""The package's shape, checked from its source (issue 32): no import cycles, imports only downward through
the layers docs/architecture.md lists, no module over 400 lines without a reason written there, and
every module and function that document names still exists.

Imports are read with ``ast`` from every module of ``radixserve`` (``kernels/`` and ``frontend/`` through
their symlinks), wherever they stand: at the top, inside functions, and under ``TYPE_CHECKING``.
TYPE_CHECKING-only imports count: a module that names another's types depends on it as surely as one
that calls it (a cycle through types is still a cycle a reader must hold in their head, and it becomes a
runtime one the day the annotation is needed at run time). ``importlib.import_module("radixserve.x")``
with a literal name counts too. What this does not see: a module started as a process
(``python -m radixserve.runtime.engine_process``), which is a boundary, not an import.
"""

from __future__ import annotations

import ast
import functools
import os
import re
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "radixserve"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
MAX_LINES = 400

# Cycles still present whose fix another branch of issue 32 owns; each is matched exactly (the set of
# modules or packages in one strongly connected component), and an entry that no longer occurs fails
# the test so that it is removed.
KNOWN_MODULE_CYCLES: dict[frozenset[str], str] = {}
KNOWN_PACKAGE_CYCLES: dict[frozenset[str], str] = {}
# Imports that go up a layer, each with the reason it is allowed (none today).
KNOWN_UPWARD: dict[tuple[str, str], str] = {}


@dataclass(frozen=True)
class Import:
    source: str
    target: str
    line: int
    kind: str  # "top", "function" or "type-checking"


@functools.cache
def modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its ``__init__``), symlinked folders
    followed."""
    found: dict[str, Path] = {}
    for folder, dirs, files in os.walk(PACKAGE, followlinks=True):
        dirs[:] = [d for d in dirs if not d.startswith((".", "__pycache__"))]
        for name in files:
            if not name.endswith(".py"):
                continue
            path = Path(folder) / name
            parts = ["radixserve", *path.relative_to(PACKAGE).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    """The module ``name`` imports: itself, or its longest prefix that is a module (``a.b.Name``)."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


class _Imports(ast.NodeVisitor):
    def __init__(self, module: str, is_package: bool, known: dict[str, Path]) -> None:
        self.module, self.known = module, known
        self.package = module if is_package else module.rpartition(".")[0]
        self.found: list[Import] = []
        self._function = 0
        self._type_checking = 0

    def _add(self, name: str, line: int) -> None:
        target = _resolve(name, self.known)
        if target is not None and target != self.module:
            kind = "type-checking" if self._type_checking else "function" if self._function else "top"
            self.found.append(Import(self.module, target, line, kind))

    def visit_If(self, node: ast.If) -> None:
        if "TYPE_CHECKING" in ast.unparse(node.test):
            self._type_checking += 1
            for child in node.body:
                self.visit(child)
            self._type_checking -= 1
            for child in node.orelse:
                self.visit(child)
        else:
            self.generic_visit(node)

    def _visit_function(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> None:
        self._function += 1
        self.generic_visit(node)
        self._function -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _visit_function

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name.split(".")[0] == "radixserve":
                self._add(alias.name, node.lineno)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            base = self.package.split(".")[: len(self.package.split(".")) - node.level + 1]
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module or ""
        if source.split(".")[0] != "radixserve":
            return
        for alias in node.names:
            submodule = f"{source}.{alias.name}"
            self._add(submodule if submodule in self.known else source, node.lineno)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        if name == "import_module" and node.args and isinstance(node.args[0], ast.Constant):
            value = node.args[0].value
            if isinstance(value, str) and value.startswith("radixserve"):
                self._add(value, node.lineno)
        self.generic_visit(node)


@functools.cache
def imports() -> list[Import]:
    known = modules()
    found: list[Import] = []
    for name, path in known.items():
        visitor = _Imports(name, path.name == "__init__.py", known)
        visitor.visit(ast.parse(path.read_text(), str(path)))
        found += visitor.found
    return found


def unit(module: str) -> str:
    """The package a module belongs to for the package graph: ``radixserve.<sub>`` (a subpackage, or a
    top-level module such as ``config``), or ``radixserve`` for the package's own ``__init__``."""
    return ".".join(module.split(".")[:2])


def cycles(edges: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    nodes = set(edges) | {t for ts in edges.values() for t in ts}
    for start in sorted(nodes):
        if start in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(start, iter(sorted(edges.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(frozenset(component))
    return found


def _describe(component: frozenset[str], found: list[Import], key: Callable[[str], str]) -> str:
    """The imports that make a cycle: those between two members of ``component``."""
    lines = {
        f"  {i.source} -> {i.target} (line {i.line}, {i.kind})"
        for i in found
        if key(i.source) in component and key(i.target) in component and key(i.source) != key(i.target)
    }
    return "\n".join(sorted(lines))


def _check(
    components: list[frozenset[str]],
    known: dict[frozenset[str], str],
    found: list[Import],
    key: Callable[[str], str],
) -> None:
    new = [c for c in components if c not in known]
    assert not new, "import cycles:\n" + "\n".join(f"{sorted(c)}\n{_describe(c, found, key)}" for c in new)
    gone = [known[c] for c in known if c not in components]
    assert not gone, f"known cycles no longer present, remove them from this test: {gone}"


def test_no_import_cycle_between_modules() -> None:
    found = imports()
    edges: dict[str, set[str]] = defaultdict(set)
    for i in found:
        edges[i.source].add(i.target)
    _check(cycles(edges), KNOWN_MODULE_CYCLES, found, lambda m: m)


def test_no_import_cycle_between_packages() -> None:
    found = imports()
    edges: dict[str, set[str]] = defaultdict(set)
    for i in found:
        if unit(i.source) != unit(i.target):
            edges[unit(i.source)].add(unit(i.target))
    _check(cycles(edges), KNOWN_PACKAGE_CYCLES, found, unit)


def test_the_cycle_finder_finds_a_cycle_through_a_function_and_a_type_only_import(tmp_path: Path) -> None:
    # The finder itself, on a made-up graph: a -> b at the top, b -> c in a function, c -> a for types.
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(edges) == [frozenset({"a", "b", "c"})]
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    import radixserve.x\n"
        "def f():\n    from radixserve import y\n"
    )
    known = {"radixserve.z": tmp_path, "radixserve.x": tmp_path, "radixserve.y": tmp_path}
    visitor = _Imports("radixserve.z", False, known)
    visitor.visit(ast.parse(source))
    assert [(i.target, i.kind) for i in visitor.found] == [
        ("radixserve.x", "type-checking"),
        ("radixserve.y", "function"),
    ]


# -- docs/architecture.md ----------------------------------------------------------------------------------
def _section(title: str) -> list[str]:
    """The lines of the section of docs/architecture.md whose heading starts with ``title``."""
    lines = ARCHITECTURE.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("## ") and line[3:].startswith(title))
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    return lines[start + 1 : end]


def _list(title: str, item: str) -> Iterator[tuple[re.Match[str], list[str]]]:
    """Each line of a section's list that matches ``item``, with the backticked names in its group
    ``names``."""
    for line in _section(title):
        m = re.match(item, line)
        if m:
            yield m, re.findall(r"`([\w./]+)`", m.group("names"))


def layers() -> dict[str, int]:
    """docs/architecture.md's "Layers" list, bottom first: ``N. `name`, `name`: why`` -> unit: N."""
    return {
        name if name == "radixserve" else f"radixserve.{name}": int(m.group("rank"))
        for m, names in _list("Layers", r"(?P<rank>\d+)\. (?P<names>.*?):")
        for name in names
    }


def test_imports_go_down_the_documented_layers() -> None:
    rank = layers()
    units = {unit(m) for m in modules()}
    assert units <= set(rank), f"packages with no layer in docs/architecture.md: {sorted(units - set(rank))}"
    upward: dict[tuple[str, str], list[str]] = defaultdict(list)
    for i in imports():
        a, b = unit(i.source), unit(i.target)
        if rank[b] > rank[a]:
            upward[(a, b)].append(f"{i.source} -> {i.target} (line {i.line}, {i.kind})")
    new = {k: v for k, v in upward.items() if k not in KNOWN_UPWARD}
    assert not new, f"imports up the layers: {new}"
    gone = [KNOWN_UPWARD[k] for k in KNOWN_UPWARD if k not in upward]
    assert not gone, f"known upward imports no longer present, remove them from this test: {gone}"


# The packages that build on the engine link and on the server: they reach the server only through its
# face (``radixserve/server/__init__.py``), and the engine process only through ``radixserve.runtime``.
ABOVE_THE_SERVER = (
    "radixserve.scale",
    "radixserve.disagg",
    "radixserve.frontend",
    "radixserve.topology",
    "radixserve.cli",
)


def test_nothing_above_the_server_imports_its_internals() -> None:
    inside = [
        f"{i.source} -> {i.target} (line {i.line}, {i.kind})"
        for i in imports()
        if unit(i.source) in ABOVE_THE_SERVER and i.target.startswith("radixserve.server.")
    ]
    assert not inside, "imports of server/ internals (import from radixserve.server instead):\n" + "\n".join(
        inside
    )
    # The scan sees the face itself, so the test above can fail: topology serves through it.
    assert any(i.source == "radixserve.topology" and i.target == "radixserve.server" for i in imports())


def test_the_runtime_sits_between_the_engine_and_the_server() -> None:
    rank = layers()
    assert rank["radixserve.engine"] < rank["radixserve.runtime"] < rank["radixserve.server"]
    assert not [
        i
        for i in imports()
        if unit(i.source) == "radixserve.runtime" and unit(i.target) == "radixserve.server"
    ]


def _repo_path(name: str) -> Path:
    """A path as the document writes it: under radixserve/ unless it starts at the repository root."""
    top = name.split("/")[0]
    return ROOT / name if top in {"benchmarks", "tests", "docs", "examples"} else PACKAGE / name


def oversize_reasons() -> dict[Path, str]:
    """docs/architecture.md's "Modules over ~400 lines" list: ``- `path`, `path` (~N): reason``."""
    return {
        _repo_path(name).resolve(): m.group("reason")
        for m, names in _list("Modules over ~400 lines", r"- (?P<names>.*?) \(~?[\d-]+\): (?P<reason>.+)")
        for name in names
    }


def _line_count(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_no_module_over_400_lines_without_a_written_reason() -> None:
    files = {p.resolve() for p in modules().values()} | {
        p.resolve()
        for p in (ROOT / "benchmarks").glob("**/*.py")
        if not any(part.startswith(".") for part in p.relative_to(ROOT / "benchmarks").parts)  # .peers/
    }
    over = {p: _line_count(p) for p in files if _line_count(p) > MAX_LINES}
    reasons = oversize_reasons()
    unexplained = sorted(str(p.relative_to(ROOT)) + f" ({n})" for p, n in over.items() if p not in reasons)
    assert not unexplained, (
        f"modules over {MAX_LINES} lines with no reason in docs/architecture.md: {unexplained}"
    )
    stale = sorted(str(p) for p in reasons if p not in over)
    assert not stale, (
        f"listed as over {MAX_LINES} lines in docs/architecture.md but not (remove them): {stale}"
    )


# The references the document makes: `path.py` and `path.py::Name.attr`.
_REFERENCE = re.compile(r"`((?:[\w]+/)*\w+\.py)(?:::([\w.]+))?`")


def _defines(path: Path, qualname: str) -> bool:
    """Whether the module at ``path`` defines ``qualname`` (a function, a class, a method, or a
    module/class-level assignment)."""
    scope: list[ast.stmt] = ast.parse(path.read_text()).body
    for part in qualname.split("."):
        match: ast.stmt | None = None
        for node in scope:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == part:
                match = node
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == part for t in targets):
                    match = node
        if match is None:
            return False
        scope = match.body if isinstance(match, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) else []
    return True


def _references(lines: list[str]) -> list[tuple[str, str | None]]:
    return [(m.group(1), m.group(2)) for line in lines for m in _REFERENCE.finditer(line)]


def _current_lines() -> list[str]:
    """The document without its history ("What moved where" tables name the old modules on purpose)."""
    out: list[str] = []
    keep = True
    for line in ARCHITECTURE.read_text().splitlines():
        if line.startswith("## "):
            keep = not line.startswith("## What moved where")
        if keep:
            out.append(line)
    return out


def _basenames() -> set[str]:
    """File names of the package's modules and of the tests and benchmarks, for references written as
    a bare name (`api.py` in a list of `server/` modules)."""
    names = {p.name for p in modules().values()}
    names |= {p.name for top in ("tests", "benchmarks") for p in (ROOT / top).rglob("*.py")}
    return names


def test_every_module_and_function_the_architecture_names_exists() -> None:
    bare = _basenames()
    missing = []
    for name, qualname in _references(_current_lines()):
        path = _repo_path(name)
        if "/" not in name and qualname is None:
            if name not in bare:
                missing.append(name)
        elif not path.is_file():
            missing.append(name)
        elif qualname is not None and not _defines(path, qualname):
            missing.append(f"{name}::{qualname}")
    assert not missing, f"docs/architecture.md names what does not exist: {sorted(set(missing))}"


def test_the_walk_of_a_streamed_chat_request_is_at_most_12_hops_each_naming_a_function() -> None:
    rows = [
        line for line in _section("The walk of one streamed chat request") if re.match(r"\| \d+ \|", line)
    ]
    assert 1 <= len(rows) <= 12, f"{len(rows)} hops"
    for n, row in enumerate(rows, 1):
        assert row.startswith(f"| {n} |"), f"hop {n} is numbered {row[:8]!r}"
        functions = [(p, q) for p, q in _references([row]) if q is not None]
        assert functions, f"hop {n} names no function (`module.py::name`): {row}"
        for name, qualname in functions:
            assert _defines(_repo_path(name), qualname), f"hop {n}: {name}::{qualname} does not exist"
