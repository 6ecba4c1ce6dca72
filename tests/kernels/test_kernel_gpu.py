"""Native CUDA runs of the Triton kernels at model-like sizes, bf16 included (skipped without CUDA)."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch

from radixserve.kernels import ops, reference

MakePaged = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
NATIVE_CUDA = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not NATIVE_CUDA, reason="needs CUDA with TRITON_INTERPRET unset"),
]
TOLERANCE = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 2e-2}
CUDA = torch.device("cuda")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("page_size", "group", "head_dim"), [(16, 4, 128), (1, 3, 64), (64, 7, 64)])
def test_decode_native(
    page_size: int, group: int, head_dim: int, dtype: torch.dtype, make_paged: MakePaged
) -> None:
    seq_lens = torch.randint(1, 3000, (24,), generator=torch.Generator().manual_seed(0)).tolist()
    k_cache, v_cache, table = make_paged(seq_lens, page_size, 2, head_dim, dtype, device=CUDA)
    q = torch.randn(len(seq_lens), 2 * group, head_dim, device=CUDA, dtype=dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=CUDA)
    for splits in (None, 1, 7):
        got = ops.decode_attention(q, k_cache, v_cache, table, lens, head_dim**-0.5, num_splits=splits)
        want = reference.decode_attention(q, k_cache, v_cache, table, lens, head_dim**-0.5)
        torch.testing.assert_close(got.float(), want.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("page_size", "group", "head_dim"), [(16, 4, 128), (1, 1, 64), (64, 3, 64)])
def test_extend_native(
    page_size: int, group: int, head_dim: int, dtype: torch.dtype, make_paged: MakePaged
) -> None:
    batch = [(0, 300), (500, 1), (1000, 0), (77, 129), (0, 1)]
    seq_lens = [p + n for p, n in batch]
    k_cache, v_cache, table = make_paged(seq_lens, page_size, 2, head_dim, dtype, device=CUDA)
    cu = torch.tensor(
        [0, *torch.tensor([n for _, n in batch]).cumsum(0).tolist()], dtype=torch.int32, device=CUDA
    )
    q = torch.randn(int(cu[-1]), 2 * group, head_dim, device=CUDA, dtype=dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=CUDA)
    got = ops.extend_attention(q, k_cache, v_cache, table, cu, lens, head_dim**-0.5)
    want = reference.extend_attention(q, k_cache, v_cache, table, cu, lens, head_dim**-0.5)
    torch.testing.assert_close(got.float(), want.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_kv_ops_native(dtype: torch.dtype) -> None:
    buffer = torch.randn(4, 64, 16, 8, 128, device=CUDA).to(dtype)
    pages = torch.randperm(64, device=CUDA)[:20].int()
    assert torch.equal(ops.gather_pages(buffer, pages), reference.gather_pages(buffer, pages))
    src = torch.randn(4, 20, 16, 8, 128, device=CUDA).to(dtype)
    got, want = buffer.clone(), buffer.clone()
    ops.scatter_pages(got, pages, src)
    reference.scatter_pages(want, pages, src)
    assert torch.equal(got, want)

    k = torch.randn(100, 8, 128, device=CUDA)
    v = torch.randn(100, 8, 128, device=CUDA)
    slots = torch.randperm(64 * 16, device=CUDA)[:100]
    got_k, got_v, want_k, want_v = buffer[0].clone(), buffer[1].clone(), buffer[0].clone(), buffer[1].clone()
    ops.store_kv(got_k, got_v, k, v, slots)
    reference.store_kv(want_k, want_v, k, v, slots)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)


def test_offsets_past_int32() -> None:
    # A layer of ~2.2e9 fp16 elements per cache: the last page starts beyond 2**31 elements.
    num_pages, page_size, heads, dim = 135_000, 16, 8, 128
    if torch.cuda.get_device_properties(0).total_memory < 24 * 2**30:
        pytest.skip("needs ~9 GiB free for two large caches")
    k_cache = torch.empty(num_pages, page_size, heads, dim, device=CUDA, dtype=torch.float16)
    v_cache = torch.empty_like(k_cache)
    last = num_pages - 1
    assert last * page_size * heads * dim > 2**31
    k = torch.randn(page_size, heads, dim, device=CUDA, dtype=torch.float16)
    v = torch.randn(page_size, heads, dim, device=CUDA, dtype=torch.float16)
    slots = torch.arange(page_size, device=CUDA) + last * page_size
    ops.store_kv(k_cache, v_cache, k, v, slots)
    assert torch.equal(k_cache[last], k) and torch.equal(v_cache[last], v)
    q = torch.randn(1, 2 * heads, dim, device=CUDA, dtype=torch.float16)
    table = torch.tensor([[last]], dtype=torch.int32, device=CUDA)
    lens = torch.tensor([page_size], dtype=torch.int32, device=CUDA)
    got = ops.decode_attention(q, k_cache, v_cache, table, lens, dim**-0.5)
    want = reference.decode_attention(q, k_cache, v_cache, table, lens, dim**-0.5)
    torch.testing.assert_close(got.float(), want.float(), atol=3e-3, rtol=3e-3)
    packed = ops.gather_pages(k_cache[None], table[0])
    assert torch.equal(packed[0, 0], k)
