"""The model step as compiled code: every decoder layer through torch.compile (dynamo, then
inductor's C++ codegen), one graph for all of them. Not CUDA graphs: "compiled" here always means
torch.compile (the docs' "captured step" is this compiled step).

Why: an eager decode step on CPU runs ~1,800 small ops, each a Python call and an OpenMP parallel
region ending in a barrier; the Python between them and the barriers cost about as much as the
matrix products. Captured, the element-wise work between two matrix products (RMSNorm with the
residual add, the rotary embedding, SwiGLU's gate) becomes one generated C++ loop, and the
matrix products and attention run as opaque calls into prepacked oneDNN weights
(``radixserve_cpu::linear``) and the backend's C++ attention.

- One graph: layers differ only in their weights and K/V cache tensors, which are graph inputs, so
  the graph traced for the first layer serves the other 29 (``regional'' compilation, as PyTorch
  recommends for repeated blocks): start-up compiles one layer, not the model. Token counts and
  plan sizes are dynamic, and sizes 0 and 1 are not special-cased (``_shape_config``), so the same
  graph serves decode, prefill and mixed steps of any size.
- Cache: inductor's code and graph caches live in ``${XDG_CACHE_HOME:-~/.cache}/radixserve/inductor``
  unless ``TORCHINDUCTOR_CACHE_DIR`` says otherwise; weights are inputs, not frozen constants, so the
  graph cache holds across restarts and a restart does not recompile.
- Fallback: without a C++ compiler, or if compiling fails, the step runs eagerly; one log line says so.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from radixserve.paths import cache_root

logger = logging.getLogger("radixserve.model")

COST = "the model step runs eagerly (slower on CPU)"
T = TypeVar("T")


def cache_dir() -> Path:
    return cache_root() / "inductor"


def find_compiler() -> str | None:
    """The C++ compiler inductor would run (``$CXX``, else g++), if it is on this machine."""
    return shutil.which(os.environ.get("CXX", "g++"))


def _shape_config() -> AbstractContextManager[Any]:
    """No specialising sizes 0 and 1 (a one-token step, a plan with one work item), and no assuming
    two sizes equal because they were equal once (duck shapes): one graph for every step."""
    import torch.fx.experimental._config as shape_config

    return shape_config.patch(backed_size_oblivious=True, use_duck_shape=False)  # type: ignore[no-any-return,attr-defined]


class CompiledLayers:
    """Compiles ``layers`` in place; ``run`` calls the model through them, or eagerly after a failure."""

    def __init__(self, layers: nn.ModuleList) -> None:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        # Importing dynamo fills in torch's default (a temp dir) unless the user chose one; inductor
        # reads the variable at each use, so ours still applies.
        if os.environ.get("TORCHINDUCTOR_CACHE_DIR") in (None, os.path.abspath(default_cache_dir())):
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir())
        import torch._inductor.config as inductor_config

        inductor_config.size_asserts = False  # per-call Python checks of every op's output strides
        # One code object (DecoderLayer.forward) gets a graph per model architecture in a process
        # (and one for one-token steps); the default limit of 8 would quietly run later ones eagerly.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        self.layers = layers
        self.active = True
        for layer in layers:
            layer.compile(dynamic=True, fullgraph=True)

    @classmethod
    def create(cls, layers: nn.ModuleList) -> CompiledLayers | None:
        """Captured ``layers``, or None (logged once) where this machine cannot compile them."""
        if find_compiler() is None:
            logger.warning("no C++ compiler (%s) found: %s", os.environ.get("CXX", "g++"), COST)
            return None
        return cls(layers)

    def run(self, forward: Callable[..., T], *args: Any) -> T:
        if not self.active:
            return forward(*args)
        try:
            with _shape_config():
                return forward(*args)
        except (torch._dynamo.exc.TorchDynamoException, torch._inductor.exc.InductorError) as exc:
            # A compile error surfaces at the first call of a new graph; the step is safe to
            # repeat (its K/V writes go to the same slots).
            logger.warning("compiling the model step failed (%s: %s): %s", type(exc).__name__, exc, COST)
            self.release()
            return forward(*args)

    def release(self) -> None:
        """Back to eager layers."""
        self.active = False
        for layer in self.layers:
            layer._compiled_call_impl = None
