"""``server`` and ``runtime`` never import ``disagg``: the disaggregated roles plug into the engine
loop from above (``disagg/process.py`` hands ``runtime/engine_process.main`` its role), and
``launch.py``, which builds either backend, sits above both. Every import counts: at the top, inside a
function, or for type checking only. (The import-graph test of the whole project can fold this one in.)"""

from __future__ import annotations

import ast
from pathlib import Path

import radixserve

ROOT = Path(radixserve.__file__).parent


def imported(path: Path, root: Path = ROOT) -> set[str]:
    """Every module an ``import`` or ``from ... import`` anywhere in the file names (absolute or
    relative), and for ``from m import x`` also ``m.x``, which may be a module. ``root``: the
    ``radixserve`` folder the file is in."""
    package = ".".join(path.relative_to(root.parent).with_suffix("").parts[:-1])
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def imports_of(package: str) -> dict[str, set[str]]:
    return {
        str(path.relative_to(ROOT.parent)): imported(path) for path in sorted((ROOT / package).rglob("*.py"))
    }


def into(graph: dict[str, set[str]], package: str) -> dict[str, list[str]]:
    hits = {
        module: sorted(n for n in names if n == package or n.startswith(package + "."))
        for module, names in graph.items()
    }
    return {module: names for module, names in hits.items() if names}


def test_server_never_imports_disagg() -> None:
    assert into(imports_of("server"), "radixserve.disagg") == {}
    assert into(imports_of("runtime"), "radixserve.disagg") == {}


def test_the_scan_sees_the_edges_that_go_the_allowed_way() -> None:
    # disagg stands on the runtime (the roles on the loop's hooks, the coordinator on AsyncEngine): if
    # the scan found none of those edges, it would be looking in the wrong place.
    edges = into(imports_of("disagg"), "radixserve.runtime")
    assert {"radixserve/disagg/decode.py", "radixserve/disagg/process.py"} <= set(edges)
    assert "radixserve.runtime.engine_loop" in edges["radixserve/disagg/process.py"]


def test_the_scan_finds_an_import_inside_a_function_and_a_relative_one(tmp_path: Path) -> None:
    probe = tmp_path / "radixserve" / "server" / "probe.py"
    probe.parent.mkdir(parents=True)
    probe.write_text(
        "def f():\n    from radixserve.disagg import decode\n\nfrom ..disagg.transport import T\n"
    )
    found = imported(probe, tmp_path / "radixserve")
    assert {"radixserve.disagg.decode", "radixserve.disagg.transport"} <= found
