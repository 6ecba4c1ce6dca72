"""``forbid_readback``: fail on any read of a tensor's values by the host, on any device.

A CUDA graph replays kernels and nothing else, so a step to be captured must not ask the device for a
value. On CUDA ``torch.cuda.set_sync_debug_mode("error")`` catches that; on the CPU nothing syncs,
so this catches the same things by what they are:
- ``.item()``, ``bool()``, ``int()``, ``float()`` of a tensor (``aten._local_scalar_dense``);
- ops whose output shape depends on the data: ``nonzero``, ``masked_select``, ``unique``, indexing by
  a bool mask (each a sync on CUDA);
- ``.tolist()`` and ``.numpy()``, which read memory directly without dispatching an op.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# aten ops whose output's shape, or a host value, depends on tensor data
FORBIDDEN = {
    "_local_scalar_dense",
    "nonzero",
    "nonzero_static",
    "masked_select",
    "_unique",
    "_unique2",
    "unique_dim",
    "unique_consecutive",
    "bincount",
    "repeat_interleave",
}
PATCHED = ("tolist", "numpy")  # Tensor methods that read memory without an op


class ReadBack(AssertionError):
    """The step read a tensor's values back to the host."""


def _bool_index(args: Any) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args)


class _Forbid(TorchDispatchMode):
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        if name in FORBIDDEN:
            raise ReadBack(f"host read-back: aten.{name}")
        if name in ("index", "_unsafe_index", "index_put", "index_put_") and _bool_index(args[1]):
            raise ReadBack(f"host read-back: aten.{name} with a bool mask (a data-dependent shape)")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def forbid_readback() -> Iterator[None]:
    """Raise ``ReadBack`` on any host read of tensor values inside the block."""

    def refuse(name: str) -> Any:
        def method(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            raise ReadBack(f"host read-back: Tensor.{name}")

        return method

    saved = {name: getattr(torch.Tensor, name) for name in PATCHED}
    try:
        for name in PATCHED:
            setattr(torch.Tensor, name, refuse(name))
        with _Forbid():
            yield
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)
