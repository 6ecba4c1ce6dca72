"""Triton extend attention against the reference: ragged batches, prefixes, page sizes, GQA ratios."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from radixserve.kernels import ops, reference

MakePaged = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
TOLERANCE = {torch.float32: 1e-4, torch.float16: 3e-3}
# (cached prefix, new tokens) per sequence: empty prefixes, a single new token, a sequence with no new
# tokens in the middle, and a chunk longer than one query block (64) on top of a prefix.
BATCH = [(0, 5), (37, 1), (20, 0), (45, 70), (0, 17)]
KV_HEADS = 2


def _run(
    batch: list[tuple[int, int]],
    page_size: int,
    group: int,
    head_dim: int,
    dtype: torch.dtype,
    make_paged: MakePaged,
    device: torch.device,
    **kw: Any,  # num_splits, max_q_len
) -> None:
    seq_lens = [prefix + new for prefix, new in batch]
    k_cache, v_cache, table = make_paged(
        seq_lens, page_size, KV_HEADS, head_dim, dtype, seed=page_size * 10 + group
    )
    cu = [0]
    for _, new in batch:
        cu.append(cu[-1] + new)
    gen = torch.Generator().manual_seed(group)
    q = torch.randn(cu[-1], KV_HEADS * group, head_dim, generator=gen).to(device, dtype)
    cu_q_lens = torch.tensor(cu, dtype=torch.int32, device=device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    scale = head_dim**-0.5
    got = ops.extend_attention(q, k_cache, v_cache, table, cu_q_lens, lens, scale, **kw)
    want = reference.extend_attention(q, k_cache, v_cache, table, cu_q_lens, lens, scale)
    assert got.shape == q.shape and got.dtype == q.dtype
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


# Every page size, GQA ratio and dtype appears, without the full (slow in the interpreter) cross product.
CASES = [
    (1, 1, torch.float32),
    (1, 4, torch.float16),
    (16, 3, torch.float32),
    (16, 1, torch.float16),
    (64, 4, torch.float32),
    (64, 3, torch.float16),
]


@pytest.mark.parametrize(("page_size", "group", "dtype"), CASES)
def test_extend_matches_reference(
    page_size: int, group: int, dtype: torch.dtype, make_paged: MakePaged, device: torch.device
) -> None:
    _run(BATCH, page_size, group, 32, dtype, make_paged, device)


def test_extend_single_sequence_no_prefix_with_given_max_q_len(
    make_paged: MakePaged, device: torch.device
) -> None:
    _run([(0, 66)], 16, 2, 40, torch.float32, make_paged, device, max_q_len=66)


def test_extend_all_sequences_empty(make_paged: MakePaged, device: torch.device) -> None:
    k_cache, v_cache, table = make_paged([3, 4], 4, 1, 16, torch.float32)
    q = torch.empty(0, 1, 16, device=device)
    cu = torch.zeros(3, dtype=torch.int32, device=device)
    lens = torch.tensor([3, 4], dtype=torch.int32, device=device)
    assert ops.extend_attention(q, k_cache, v_cache, table, cu, lens, 1.0).shape == (0, 1, 16)


def test_extend_strided_q(make_paged: MakePaged, device: torch.device) -> None:
    # q as a view into a fused qkv projection, like the model produces it.
    seq_lens = [16, 3]
    k_cache, v_cache, table = make_paged(seq_lens, 4, 1, 16, torch.float32, seed=3)
    fused = torch.randn(9, 5, 16, generator=torch.Generator().manual_seed(9)).to(device)
    q = fused[:, :3]
    cu = torch.tensor([0, 6, 9], dtype=torch.int32, device=device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    got = ops.extend_attention(q, k_cache, v_cache, table, cu, lens, 0.25)
    want = reference.extend_attention(q, k_cache, v_cache, table, cu, lens, 0.25)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
