"""The paged KV pool: preallocated K/V tensors and an O(1)-per-page allocator.

Every page is in exactly one place: the allocator's free list, the radix tree, or a running
request's private tail. The allocator only knows the first; ``RadixCache.check_integrity`` checks all three.

The pool owns the KV dtype (``kernels/kv_dtype.py``): float32, bfloat16, or int8 with one fp32 scale
per (token, KV head) for K and for V beside the pages. It also holds the prompt scores of every
position (``scores``: ``cache/scores.py``). A page leaves the device (for the host or disk tier) as
one byte record, ``page_bytes`` long, holding its K, V and scales of every layer and then its scores,
so it describes itself wherever it goes.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch

from radixserve.cache.scores import ScoreTable
from radixserve.kernels.kv_dtype import KV_DTYPES, TORCH_DTYPES, LayerCache


class PageCopier(Protocol):
    """What the pool needs of an attention backend to copy pages (``AttentionBackend`` has it)."""

    def gather_pages(self, buffer: torch.Tensor, pages: torch.Tensor) -> torch.Tensor: ...

    def scatter_pages(self, buffer: torch.Tensor, pages: torch.Tensor, src: torch.Tensor) -> None: ...


class PagedPool(Protocol):
    """What the tiers need of a pool: a ``KVPool``, or a tensor-parallel engine's view of its ranks'
    pools (``engine/tensor_parallel.py``), whose page records hold ``shards`` ranks' parts."""

    page_size: int
    page_bytes: int
    kv_dtype: str
    k_buffer: torch.Tensor
    shards: int

    def read_pages(self, copier: PageCopier, pages: list[int]) -> torch.Tensor: ...

    def write_pages(self, copier: PageCopier, pages: list[int], records: torch.Tensor) -> None: ...


class KVPool:
    """K and V for every layer, each ``[num_layers, num_pages, page_size, kv_heads, head_dim]`` of the
    KV dtype; for int8 also ``k_scale``/``v_scale [num_layers, num_pages, page_size, kv_heads]`` fp32."""

    shards = 1  # one rank's pages (PagedPool)

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        kv_dtype: str | torch.dtype = "float32",
        device: torch.device | str = "cpu",
    ) -> None:
        if not 1 <= page_size <= 64:
            raise ValueError(f"page_size must be in [1, 64], got {page_size}")
        if num_pages < 1:
            raise ValueError("the KV pool needs at least one page")
        if isinstance(kv_dtype, torch.dtype):  # a float dtype by its torch name
            kv_dtype = str(kv_dtype).removeprefix("torch.")
        if kv_dtype not in TORCH_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_DTYPES)}, got {kv_dtype!r}")
        shape = (num_layers, num_pages, page_size, num_kv_heads, head_dim)
        self.kv_dtype = kv_dtype
        self.dtype = TORCH_DTYPES[kv_dtype]
        self.k_buffer = torch.zeros(shape, dtype=self.dtype, device=device)
        self.v_buffer = torch.zeros(shape, dtype=self.dtype, device=device)
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None
        if kv_dtype == "int8":
            self.k_scale = torch.zeros(shape[:-1], dtype=torch.float32, device=device)
            self.v_scale = torch.zeros(shape[:-1], dtype=torch.float32, device=device)
        # Each layer's K and V as views, made once: the model takes them as they are (a view made
        # inside a compiled graph and written by an opaque op loses its offset in torch 2.13).
        self.layers = [
            LayerCache(
                self.k_buffer[i],
                self.v_buffer[i],
                None if self.k_scale is None else self.k_scale[i],
                None if self.v_scale is None else self.v_scale[i],
            )
            for i in range(num_layers)
        ]
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.scores = ScoreTable(num_pages, page_size, device)
        kv_bytes = self.bytes_per_page(num_layers, page_size, num_kv_heads, head_dim, kv_dtype)
        self.page_bytes = kv_bytes + ScoreTable.record_bytes(page_size)  # a tier record's length

    @staticmethod
    def bytes_per_page(
        num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, kv_dtype: str
    ) -> int:
        """One page's K and V of every layer, with the int8 scales: what ``--kv-cache-gb`` is divided by,
        and, with the page's scores (``ScoreTable.record_bytes``), the length of its record in the tiers."""
        rows = 2 * num_layers * page_size * num_kv_heads  # K and V rows of head_dim values
        size = torch.empty(0, dtype=TORCH_DTYPES[kv_dtype]).element_size()
        scales = 4 if kv_dtype == "int8" else 0
        return rows * (head_dim * size + scales)

    def layer(self, i: int) -> LayerCache:
        return self.layers[i]

    def buffers(self) -> list[torch.Tensor]:
        """Every tensor a page has a part of, each ``[num_layers, num_pages, ...]``: K, V, then the scales."""
        out = [self.k_buffer, self.v_buffer]
        if self.k_scale is not None and self.v_scale is not None:
            # 5-D like the K/V buffers, so every backend's page copy takes them
            out += [self.k_scale.unsqueeze(-1), self.v_scale.unsqueeze(-1)]
        return out

    def read_pages(self, copier: PageCopier, pages: list[int]) -> torch.Tensor:
        """Pages as byte records ``[len(pages), page_bytes]`` uint8 (on the pool's device)."""
        idx = torch.tensor(pages, device=self.k_buffer.device)
        parts = []
        for buffer in self.buffers():
            part = copier.gather_pages(buffer, idx).transpose(0, 1).contiguous()  # [n, layers, ...]
            parts.append(part.view(len(pages), -1).view(torch.uint8))
        parts.append(self.scores.read_pages(idx))
        return torch.cat(parts, dim=1)

    def write_pages(self, copier: PageCopier, pages: list[int], records: torch.Tensor) -> None:
        """The inverse of ``read_pages``: write byte records ``[len(pages), page_bytes]`` into ``pages``."""
        if records.shape != (len(pages), self.page_bytes) or records.dtype != torch.uint8:
            raise ValueError(
                f"page records must be [{len(pages)}, {self.page_bytes}] uint8, got {records.shape}"
            )
        idx = torch.tensor(pages, device=self.k_buffer.device)
        records = records.to(self.k_buffer.device)
        start = 0
        for buffer in self.buffers():
            shape = (len(pages), buffer.shape[0], *buffer.shape[2:])
            nbytes = buffer.element_size() * buffer[:, 0].numel()
            part = records[:, start : start + nbytes].contiguous().view(buffer.dtype).view(shape)
            copier.scatter_pages(buffer, idx, part.transpose(0, 1))
            start += nbytes
        self.scores.write_pages(idx, records[:, start:])


class PageAllocator:
    """A free list of page indices. ``can_allocate(n)`` and ``allocate(n)`` go in pairs."""

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self._free: list[int] = list(range(num_pages - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(
                f"asked for {n} pages with only {len(self._free)} free; call can_allocate first"
            )
        if n == 0:
            return []
        pages = self._free[-n:]
        del self._free[-n:]
        return pages

    def free(self, pages: Iterable[int]) -> None:
        self._free.extend(pages)

    def free_pages(self) -> list[int]:
        """A copy of the free list, for integrity checks."""
        return list(self._free)
