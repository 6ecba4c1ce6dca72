"""The model step captured as one compiled graph (torch.compile: dynamo, then inductor's C++ codegen).

Why: an eager decode step on CPU runs ~1,800 small ops, each a Python call and an OpenMP parallel
region that ends in a barrier; the Python between them and the barriers cost about as much as the
matrix products. Captured, the element-wise work between two matrix products (RMSNorm and the
residual add, the rotary embedding, SwiGLU) becomes one generated C++ loop, and with freezing the
weights become constants that oneDNN/MKL prepack for the matrix products. The attention ops stay
opaque calls into the backend's own kernels.

- Shapes: token counts and plan sizes are dynamic, so one graph serves decode, prefill and mixed
  steps of any size (dynamo still specialises sizes 0 and 1, so a one-token step gets its own graph).
- Cache: inductor's code and graph caches live in ``${XDG_CACHE_HOME:-~/.cache}/radixserve/inductor``
  unless ``TORCHINDUCTOR_CACHE_DIR`` says otherwise, so a restart loads instead of recompiling.
- Fallback: without a C++ compiler, or if compiling fails, the step runs eagerly; one log line says so.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger("radixserve.model")

COST = "the model step runs eagerly (slower on CPU)"


def cache_dir() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "radixserve" / "inductor"


def find_compiler() -> str | None:
    """The C++ compiler inductor would run (``$CXX``, else g++), if it is on this machine."""
    return shutil.which(os.environ.get("CXX", "g++"))


def _SHAPE_CONFIG() -> Any:
    """One graph for every step size: no specialising sizes 0 and 1 (a one-token step, a plan with
    one work item), and no assuming two sizes equal because they were equal once (duck shapes)."""
    import torch.fx.experimental._config as shape_config

    return shape_config.patch(
        backed_size_oblivious=os.environ.get("RS_BSO", "1") == "1",
        use_duck_shape=os.environ.get("RS_DUCK", "0") == "1",
    )


class CapturedStep:
    """Calls ``fn`` through torch.compile; switches to ``fn`` itself for good if compiling fails."""

    def __init__(self, fn: Callable[..., torch.Tensor]) -> None:
        import torch._inductor.config as inductor_config
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        # Importing dynamo fills in torch's default (a temp dir) unless the user chose one; inductor
        # reads the variable at each use, so ours still applies.
        if os.environ.get("TORCHINDUCTOR_CACHE_DIR") in (None, os.path.abspath(default_cache_dir())):
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir())

        inductor_config.freezing = os.environ.get("RS_FREEZE", "0") == "1"
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 32)
        self.fn = fn
        self.compiled: Callable[..., torch.Tensor] | None = torch.compile(fn, dynamic=True)

    @classmethod
    def create(cls, fn: Callable[..., torch.Tensor]) -> CapturedStep | None:
        """A captured ``fn``, or None (logged once) where this machine cannot compile it."""
        if find_compiler() is None:
            logger.warning("no C++ compiler (%s) found: %s", os.environ.get("CXX", "g++"), COST)
            return None
        return cls(fn)

    def __call__(self, *args: Any) -> torch.Tensor:
        if self.compiled is None:
            return self.fn(*args)
        try:
            with _SHAPE_CONFIG():
                return self.compiled(*args)
        except Exception as exc:  # a compile error surfaces at the first call of each new shape
            logger.warning("compiling the model step failed (%s: %s): %s", type(exc).__name__, exc, COST)
            self.compiled = None
            return self.fn(*args)
