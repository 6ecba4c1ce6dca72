"""kernels/ and frontend/ import as radixserve.kernels and radixserve.frontend: from a built wheel,
from the editable install, and under pytest (this very file)."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

from radixserve.kernels import cpu_build
from radixserve.server.pages.dashboard import ASSETS, PAGES

ROOT = Path(__file__).resolve().parent.parent
IMPORTS = (
    "import radixserve.kernels.reference, radixserve.frontend, radixserve; "
    "print(radixserve.kernels.reference.__file__)"
)


def test_under_pytest() -> None:
    import radixserve.frontend
    import radixserve.kernels.reference

    assert radixserve.kernels.reference.store_kv is not None and radixserve.frontend is not None


def test_built_wheel_layout_and_imports(tmp_path: Path) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path / "dist"),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
    )
    wheel = next((tmp_path / "dist").glob("radixserve-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "radixserve/kernels/reference.py" in names and "radixserve/frontend/__init__.py" in names
    # The C++ CPU kernels' sources ship beside their builder, which compiles them at first use.
    sources = {f"radixserve/kernels/csrc/{name}" for name in (*cpu_build.SOURCES, *cpu_build.HEADERS)}
    assert "radixserve/kernels/cpu_build.py" in names and sources <= set(names)
    assert not [n for n in names if n.startswith(("kernels/", "frontend/"))]  # never top-level packages
    # Every subpackage ships (pyproject.toml lists them one by one; a missing one imports only in place).
    package = ROOT / "radixserve"
    inits = {f"radixserve/{p.relative_to(package).as_posix()}" for p in package.glob("*/**/__init__.py")}
    assert inits <= set(names), sorted(inits - set(names))
    # The browser pages ship as plain files beside the routes that serve them (server/pages/dashboard.py).
    ui = {f"radixserve/server/pages/ui/{name}" for name in (*ASSETS, *PAGES.values())}
    assert ui <= set(names), ui - set(names)
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
        check=True,
        capture_output=True,
    )
    env = {**os.environ, "PYTHONPATH": str(target)}
    out = subprocess.run(
        [sys.executable, "-c", IMPORTS], cwd=tmp_path, env=env, check=True, capture_output=True, text=True
    )
    assert out.stdout.strip().startswith(str(target))


def test_editable_install_from_any_directory(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-c", IMPORTS], cwd=tmp_path, check=True, capture_output=True, text=True
    )
    assert Path(out.stdout.strip()).resolve() == ROOT / "kernels" / "reference.py"
