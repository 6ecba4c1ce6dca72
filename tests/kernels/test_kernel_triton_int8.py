"""Triton kernels over int8 KV pages with their scales, against the reference (interpreted on CPU;
small shapes): decode, extend, the quantizing store, and page copies of the scales."""

from __future__ import annotations

from collections.abc import Callable

import torch

from radixserve.kernels import ops, reference
from radixserve.kernels.kv_dtype import quantize_int8

MakePaged = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
HEAD_DIM = 16
KV_HEADS = 2


def _int8_pages(
    make_paged: MakePaged, lens: list[int], page_size: int, device: torch.device
) -> tuple[torch.Tensor, ...]:
    k, v, table = make_paged(lens, page_size, KV_HEADS, HEAD_DIM, torch.float32, seed=page_size)
    (kq, ks), (vq, vs) = quantize_int8(k), quantize_int8(v)
    return kq, vq, ks, vs, table


def test_triton_decode_over_int8_pages_matches_reference(make_paged: MakePaged, device: torch.device) -> None:
    for page_size, group in ((1, 2), (16, 1)):
        lens = [1, 20, 45]
        kq, vq, ks, vs, table = _int8_pages(make_paged, lens, page_size, device)
        q = torch.randn(len(lens), KV_HEADS * group, HEAD_DIM, generator=torch.Generator().manual_seed(1))
        q, seq_lens = q.to(device), torch.tensor(lens, dtype=torch.int32, device=device)
        got = ops.decode_attention(q, kq, vq, table, seq_lens, 0.25, k_scale=ks, v_scale=vs)
        want = reference.decode_attention(q, kq, vq, table, seq_lens, 0.25, k_scale=ks, v_scale=vs)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_triton_extend_over_int8_pages_matches_reference(make_paged: MakePaged, device: torch.device) -> None:
    segs = [(9, 9), (5, 30)]  # (new tokens, whole length): a prefill and an extend over a cached prefix
    kq, vq, ks, vs, table = _int8_pages(make_paged, [n for _, n in segs], 4, device)
    q = torch.randn(14, KV_HEADS * 2, HEAD_DIM, generator=torch.Generator().manual_seed(2)).to(device)
    cu = torch.tensor([0, 9, 14], dtype=torch.int32, device=device)
    lens = torch.tensor([n for _, n in segs], dtype=torch.int32, device=device)
    got = ops.extend_attention(q, kq, vq, table, cu, lens, 0.25, k_scale=ks, v_scale=vs)
    want = reference.extend_attention(q, kq, vq, table, cu, lens, 0.25, k_scale=ks, v_scale=vs)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_triton_int8_store_and_page_copies_match_reference(device: torch.device) -> None:
    shape = (6, 4, KV_HEADS, HEAD_DIM)
    caches = [torch.zeros(shape, dtype=torch.int8, device=device) for _ in range(4)]
    scales = [torch.zeros(shape[:-1], device=device) for _ in range(4)]
    k = torch.randn(5, KV_HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(3)).to(device)
    v = torch.randn(5, KV_HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(4)).to(device)
    slots = torch.tensor([3, 9, -1, 17, 22], device=device)
    ops.store_kv(caches[0], caches[1], k, v, slots, k_scale=scales[0], v_scale=scales[1])
    reference.store_kv(caches[2], caches[3], k, v, slots, k_scale=scales[2], v_scale=scales[3])
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert torch.equal(scales[0], scales[2]) and torch.equal(scales[1], scales[3])
    assert bool(scales[0].view(-1, KV_HEADS)[[3, 9, 17, 22]].gt(0).all())  # each stored row has a scale
    # The pool copies the scales as [layers, pages, page_size, heads, 1] buffers.
    pool_scales = torch.rand(2, 6, 4, KV_HEADS, 1, device=device)
    pages = torch.tensor([4, 0], device=device)
    packed = ops.gather_pages(pool_scales, pages)
    assert torch.equal(packed, reference.gather_pages(pool_scales, pages))
    other = torch.zeros_like(pool_scales)
    ops.scatter_pages(other, pages, packed)
    assert torch.equal(other[:, [4, 0]], pool_scales[:, [4, 0]])
