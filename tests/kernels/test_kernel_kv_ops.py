"""store_kv / gather_pages / scatter_pages against the reference: same-dtype copies must be bit-exact."""

from __future__ import annotations

import pytest
import torch

from radixserve.kernels import ops, reference


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize(
    ("src_dtype", "cache_dtype"),
    [(torch.float32, torch.float32), (torch.float32, torch.float16), (torch.float16, torch.float16)],
)
def test_store_kv_matches_reference(
    page_size: int, src_dtype: torch.dtype, cache_dtype: torch.dtype, device: torch.device
) -> None:
    gen = torch.Generator().manual_seed(page_size)
    num_pages, kv_heads, head_dim, tokens = 12, 3, 24, 9
    shape = (num_pages, page_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(device, cache_dtype)
    v_cache = torch.randn(shape, generator=gen).to(device, cache_dtype)
    slots = torch.randperm(num_pages * page_size, generator=gen)[:tokens].to(device)
    k = torch.randn(tokens, kv_heads, head_dim, generator=gen).to(device, src_dtype)
    v = torch.randn(tokens, kv_heads, head_dim, generator=gen).to(device, src_dtype)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    reference.store_kv(want_k, want_v, k, v, slots)
    ops.store_kv(k_cache, v_cache, k, v, slots)
    assert torch.equal(k_cache, want_k)
    assert torch.equal(v_cache, want_v)


def test_store_kv_strided_source_and_padding_slots(device: torch.device) -> None:
    # k/v as views into a fused projection output; slot -1 marks a padding row that must not be written.
    gen = torch.Generator().manual_seed(1)
    k_cache = torch.zeros(4, 16, 2, 32, device=device)
    v_cache = torch.zeros_like(k_cache)
    fused = torch.randn(5, 6, 32, generator=gen).to(device)
    k, v = fused[:, 2:4], fused[:, 4:6]
    slots = torch.tensor([3, -1, 40, 63, 17], device=device)
    ops.store_kv(k_cache, v_cache, k, v, slots)
    want_k, want_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    keep = slots >= 0
    reference.store_kv(want_k, want_v, k[keep], v[keep], slots[keep])
    assert torch.equal(k_cache, want_k)
    assert torch.equal(v_cache, want_v)


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gather_scatter_roundtrip(page_size: int, dtype: torch.dtype, device: torch.device) -> None:
    gen = torch.Generator().manual_seed(page_size)
    num_layers, num_pages, kv_heads, head_dim = 3, 8, 2, 16
    buffer = torch.randn(num_layers, num_pages, page_size, kv_heads, head_dim, generator=gen).to(
        device, dtype
    )
    pages = torch.tensor([6, 1, 4], device=device, dtype=torch.int32)

    packed = ops.gather_pages(buffer, pages)
    assert packed.is_contiguous()
    assert torch.equal(packed, reference.gather_pages(buffer, pages))

    src = torch.randn(packed.shape, generator=gen).to(device, dtype)
    got, want = buffer.clone(), buffer.clone()
    ops.scatter_pages(got, pages, src)
    reference.scatter_pages(want, pages, src)
    assert torch.equal(got, want)


def test_gather_scatter_strided_buffer(device: torch.device) -> None:
    # A pool that is a view (head_dim sliced out of a wider tensor) must be addressed by its strides.
    gen = torch.Generator().manual_seed(2)
    wide = torch.randn(2, 6, 4, 3, 40, generator=gen).to(device)
    buffer = wide[..., 4:36]
    pages = torch.tensor([5, 0], device=device)
    assert torch.equal(ops.gather_pages(buffer, pages), reference.gather_pages(buffer, pages))

    src = torch.randn(2, 2, 4, 3, 32, generator=gen).to(device)
    before = wide.clone()
    ops.scatter_pages(buffer, pages, src)
    assert torch.equal(buffer[:, pages], src)
    untouched = torch.ones(6, dtype=torch.bool)
    untouched[[5, 0]] = False
    assert torch.equal(wide[:, untouched.to(device)], before[:, untouched.to(device)])
    assert torch.equal(wide[..., :4], before[..., :4])


def test_empty_inputs_are_noops(device: torch.device) -> None:
    buffer = torch.randn(2, 3, 4, 1, 16, device=device)
    none = torch.empty(0, dtype=torch.int64, device=device)
    assert ops.gather_pages(buffer, none).shape == (2, 0, 4, 1, 16)
    before = buffer.clone()
    ops.scatter_pages(buffer, none, torch.empty(2, 0, 4, 1, 16, device=device))
    ops.store_kv(
        buffer[0], buffer[1], torch.empty(0, 1, 16, device=device), torch.empty(0, 1, 16, device=device), none
    )
    assert torch.equal(buffer, before)
