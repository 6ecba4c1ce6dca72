"""Kernel tests: Triton kernels against the torch reference.

Without CUDA the kernels run in the Triton interpreter on CPU tensors: ``TRITON_INTERPRET=1`` is set
here, before any kernel module is imported (triton picks interpreter or JIT when a kernel is defined,
so modules imported earlier in the session are reloaded). With CUDA and no explicit setting, the
kernels run natively on CUDA tensors. An explicit ``TRITON_INTERPRET`` always wins.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")
INTERPRET = os.environ["TRITON_INTERPRET"] not in ("", "0")

for _name in ("kv_ops", "decode_attention", "extend_attention", "ops"):
    _module = sys.modules.get(f"radixserve.kernels.{_name}")
    if _module is not None:
        importlib.reload(_module)

DEVICE = torch.device("cpu" if INTERPRET or not torch.cuda.is_available() else "cuda")

PagedCase = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
MakePaged = Callable[..., PagedCase]


def _make_paged(
    seq_lens: list[int],
    page_size: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device = DEVICE,
    seed: int = 0,
) -> PagedCase:
    """Random ``k_cache``, ``v_cache`` and an int32 page table giving each sequence shuffled pages.

    Spare pages exist beyond those used, and page-table entries past a sequence's pages point at
    random pages, so a kernel that reads unmasked garbage is caught.
    """
    gen = torch.Generator().manual_seed(seed)
    needed = [(n + page_size - 1) // page_size for n in seq_lens]
    num_pages = sum(needed) + 3
    width = max(max(needed, default=0), 1)
    shape = (num_pages, page_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    v_cache = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    order = torch.randperm(num_pages, generator=gen)
    table = torch.randint(0, num_pages, (len(seq_lens), width), generator=gen)
    used = 0
    for b, n in enumerate(needed):
        table[b, :n] = order[used : used + n]
        used += n
    return k_cache, v_cache, table.to(device=device, dtype=torch.int32)


@pytest.fixture
def device() -> torch.device:
    return DEVICE


@pytest.fixture
def make_paged() -> MakePaged:
    return _make_paged
