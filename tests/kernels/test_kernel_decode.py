"""Triton decode attention against the reference: page sizes, GQA ratios, splits, strides."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from radixserve.kernels import ops, reference
from radixserve.kernels.decode_attention import MAX_SPLITS

MakePaged = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
TOLERANCE = {torch.float32: 1e-4, torch.float16: 3e-3}
# Per page size: lengths from a single token to several pages, including non-multiples of the page.
SEQ_LENS = {1: [1, 7, 40], 16: [1, 16, 45, 150], 64: [1, 64, 100, 200]}
KV_HEADS = 2


def _check(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    lens: torch.Tensor,
    **kw: Any,  # num_splits, max_q_len
) -> None:
    scale = q.shape[-1] ** -0.5
    got = ops.decode_attention(q, k_cache, v_cache, table, lens, scale, **kw)
    want = reference.decode_attention(q, k_cache, v_cache, table, lens, scale)
    assert got.dtype == q.dtype and got.shape == q.shape
    tol = TOLERANCE[q.dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


# Every (page size, GQA ratio) pair, dtypes alternating, instead of the full cross product.
CASES = [
    (1, 1, torch.float32),
    (1, 3, torch.float16),
    (1, 4, torch.float32),
    (16, 1, torch.float16),
    (16, 3, torch.float32),
    (16, 4, torch.float16),
    (64, 1, torch.float32),
    (64, 3, torch.float16),
    (64, 4, torch.float32),
]


@pytest.mark.parametrize(("page_size", "group", "dtype"), CASES)
def test_decode_matches_reference(
    page_size: int, group: int, dtype: torch.dtype, make_paged: MakePaged, device: torch.device
) -> None:
    seq_lens = SEQ_LENS[page_size]
    head_dim = 32
    k_cache, v_cache, table = make_paged(
        seq_lens, page_size, KV_HEADS, head_dim, dtype, seed=page_size + group
    )
    gen = torch.Generator().manual_seed(group)
    q = torch.randn(len(seq_lens), KV_HEADS * group, head_dim, generator=gen).to(device, dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    # Three splits make the longer sequences span several splits and leave the short ones with empty ones.
    _check(q, k_cache, v_cache, table, lens, num_splits=3)


@pytest.mark.parametrize("num_splits", [None, 1, MAX_SPLITS])
def test_decode_split_counts(num_splits: int | None, make_paged: MakePaged, device: torch.device) -> None:
    seq_lens = [300, 5, 129]
    k_cache, v_cache, table = make_paged(seq_lens, 16, 1, 16, torch.float32, seed=7)
    q = torch.randn(3, 4, 16, generator=torch.Generator().manual_seed(3)).to(device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    kw = {} if num_splits is None else {"num_splits": num_splits}
    _check(q, k_cache, v_cache, table, lens, **kw)


def test_decode_odd_head_dim_strided_q_and_int64_indices(make_paged: MakePaged, device: torch.device) -> None:
    # head_dim 40 pads to 64 lanes; q is a view into a fused qkv tensor; index tensors are int64.
    seq_lens = [70, 3]
    k_cache, v_cache, table = make_paged(seq_lens, 8, 2, 40, torch.float32, seed=11)
    fused = torch.randn(2, 10, 40, generator=torch.Generator().manual_seed(5)).to(device)
    q = fused[:, :6]
    assert not q.is_contiguous()
    lens = torch.tensor(seq_lens, device=device)
    _check(q, k_cache, v_cache, table.long(), lens, num_splits=2)


def test_decode_rejects_bad_split_count(make_paged: MakePaged, device: torch.device) -> None:
    k_cache, v_cache, table = make_paged([4], 4, 1, 16, torch.float32)
    q = torch.zeros(1, 1, 16, device=device)
    with pytest.raises(ValueError, match="num_splits"):
        ops.decode_attention(
            q, k_cache, v_cache, table, torch.tensor([4], device=device), 1.0, num_splits=MAX_SPLITS + 1
        )
