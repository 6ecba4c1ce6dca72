"""Where radixserve keeps what it builds on the user's machine: converted models and their int8 copies
(model/default_model.py, model/quant.py), compiled C++ kernels (kernels/cpu_build.py), inductor's
caches (model/compiled.py). One folder, ``${XDG_CACHE_HOME:-~/.cache}/radixserve``."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """radixserve's cache folder; the environment is read at each call, so a test (or a user) that sets
    XDG_CACHE_HOME afterwards is obeyed."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "radixserve"
