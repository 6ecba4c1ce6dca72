"""The paged KV pool: preallocated K/V tensors and an O(1)-per-page allocator.

Every page is in exactly one place: the allocator's free list, the radix tree, or a running
request's private tail. The allocator only knows the first; ``RadixCache.check_integrity`` checks all three.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class KVPool:
    """K and V for every layer, each ``[num_layers, num_pages, page_size, kv_heads, head_dim]``."""

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        if not 1 <= page_size <= 64:
            raise ValueError(f"page_size must be in [1, 64], got {page_size}")
        if num_pages < 1:
            raise ValueError("the KV pool needs at least one page")
        shape = (num_layers, num_pages, page_size, num_kv_heads, head_dim)
        self.k_buffer = torch.zeros(shape, dtype=dtype, device=device)
        self.v_buffer = torch.zeros(shape, dtype=dtype, device=device)
        # Each layer's K and V as views, made once: the model takes them as they are (a view made
        # inside a compiled graph and written by an opaque op loses its offset in torch 2.13).
        self.layers = [(self.k_buffer[i], self.v_buffer[i]) for i in range(num_layers)]
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size

    @staticmethod
    def bytes_per_page(
        num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        return (
            2 * num_layers * page_size * num_kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()
        )

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.layers[i]


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
