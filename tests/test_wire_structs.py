"""The wire-struct rule: every array-like msgspec Struct is built by keyword, never by position.

Array-like structs travel as arrays, so their field order is the wire format: a field inserted in the
middle would shift every positional value after it, silently. Each such struct is ``kw_only`` (a
positional construction raises at run time), and a scan of the source finds any positional
construction, in code paths the tests never run too.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
from pathlib import Path

import msgspec
import pytest

import radixserve

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("radixserve", "benchmarks", "tests", "examples", "frontend", "kernels")


def _subclasses(cls: type[msgspec.Struct]) -> list[type[msgspec.Struct]]:
    out: list[type[msgspec.Struct]] = []
    for sub in cls.__subclasses__():
        out += [sub, *_subclasses(sub)]
    return out


def array_like_structs() -> dict[str, type[msgspec.Struct]]:
    """Every array-like Struct radixserve defines, found by importing all its modules."""
    for mod in pkgutil.walk_packages(radixserve.__path__, "radixserve."):
        importlib.import_module(mod.name)
    found = {
        cls.__name__: cls
        for cls in _subclasses(msgspec.Struct)
        if cls.__module__.startswith("radixserve.") and cls.__struct_config__.array_like
    }
    return {name: cls for name, cls in found.items() if cls.__struct_fields__}  # a bare base is no message


def positional_constructions(source: str, names: set[str]) -> list[tuple[int, str]]:
    """(line, class) of each call ``Name(...)`` or ``x.Name(...)`` with positional arguments."""
    hits = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and node.args:
            func = node.func
            name = (
                func.id
                if isinstance(func, ast.Name)
                else func.attr
                if isinstance(func, ast.Attribute)
                else None
            )
            if name in names:
                hits.append((node.lineno, name))
    return hits


def test_the_wire_structs_are_found() -> None:
    structs = array_like_structs()
    # The ones the issue names, at least: the scan below is only as good as this list.
    assert {
        "StepOutput",
        "EngineStats",
        "Ready",
        "StepReport",
        "AddRequest",
        "KVEvents",
        "CacheNode",
    } <= set(structs)


@pytest.mark.parametrize("name", sorted(array_like_structs()))
def test_every_array_like_struct_is_keyword_only(name: str) -> None:
    cls = array_like_structs()[name]
    params = inspect.signature(cls).parameters.values()
    positional = [p.name for p in params if p.kind is not inspect.Parameter.KEYWORD_ONLY]
    assert not positional, f"{name} can be built by position ({positional}): declare it kw_only=True"
    with pytest.raises(TypeError):
        cls(None)  # type: ignore[call-arg]


def test_no_array_like_struct_is_built_by_position() -> None:
    names = set(array_like_structs())
    seen: set[Path] = set()
    found = []
    for folder in SCANNED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            real = path.resolve()  # radixserve/kernels and radixserve/frontend link to the top-level folders
            # Hidden folders hold no project code (benchmarks/.peers: the peers' virtual environments).
            if real in seen or any(part.startswith(".") for part in path.relative_to(ROOT).parts):
                continue
            seen.add(real)
            for line, name in positional_constructions(real.read_text(), names):
                found.append(f"{path.relative_to(ROOT)}:{line}: {name}(...) by position")
    assert not found, "\n".join(found)


def test_the_scan_finds_a_positional_construction() -> None:
    source = (
        "from m import StepOutput\nx = StepOutput('g', 0)\ny = m.StepOutput(group_id='g')\nz = other('g')\n"
    )
    assert positional_constructions(source, {"StepOutput"}) == [(2, "StepOutput")]
