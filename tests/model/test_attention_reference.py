"""The torch reference attention (the CPU path) against a naive per-sequence softmax, including cascade
decoding over page-table prefixes shared by several sequences."""

from __future__ import annotations

import pytest
import torch

from radixserve.kernels import reference


def _naive_decode(
    q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, table: torch.Tensor, lens: list[int]
) -> torch.Tensor:
    outs = []
    kv_heads, dim = kc.shape[2], kc.shape[3]
    for b, n in enumerate(lens):
        k = kc[table[b].long()].flatten(0, 1)[:n]
        v = vc[table[b].long()].flatten(0, 1)[:n]
        qg = q[b].view(kv_heads, -1, dim)
        p = (torch.einsum("hgd,lhd->hgl", qg, k) * 0.125).softmax(-1)
        outs.append(torch.einsum("hgl,lhd->hgd", p, v).reshape(-1, dim))
    return torch.stack(outs)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_decode_with_shared_prefix_pages_matches_naive(page_size: int) -> None:
    torch.manual_seed(0)
    kc, vc = torch.randn(2, 600, page_size, 3, 64).unbind(0)
    shared = list(range(1, 1 + 40 // page_size + 1))
    tables, lens = [], []
    for b in range(10):
        if b < 4:  # a document shared by four sequences, then their own pages
            own = [300 + 20 * b + i for i in range(4)]
            tables.append(shared + own)
            lens.append(len(shared) * page_size + 1 + b)
        elif b < 6:  # a second group, sharing two pages
            tables.append([450, 451] + [500 + 10 * b + i for i in range(4)])
            lens.append(2 * page_size + 3 * page_size + b % 2 + 1)
        else:  # nothing shared
            tables.append([100 + 30 * b + i for i in range(5)])
            lens.append(4 * page_size + 1)
    width = max(map(len, tables))
    table = torch.zeros(len(tables), width, dtype=torch.int32)
    for i, t in enumerate(tables):
        table[i, : len(t)] = torch.tensor(t)
    q = torch.randn(len(tables), 9, 64)
    got = reference.decode_attention(q, kc, vc, table, torch.tensor(lens, dtype=torch.int32), 0.125)
    torch.testing.assert_close(got, _naive_decode(q, kc, vc, table, lens), atol=1e-5, rtol=1e-5)
    shared_pages, groups = reference._shared_prefixes(table.long(), torch.tensor(lens), page_size)
    assert len(groups) == 2 and shared_pages[6:].eq(0).all()  # the cascade really ran


def test_a_plan_made_once_serves_every_layer_like_planning_each_call() -> None:
    """The runner plans a step's index work once and hands it to every layer: same results as
    planning inside each call, with padding masked (ragged lengths) and cascade groups found."""
    torch.manual_seed(1)
    page_size = 4
    kc, vc = torch.randn(2, 3, 200, page_size, 2, 16).unbind(0)  # three "layers"
    tables = [[1, 2, 3, 10, 11], [1, 2, 3, 20, 21], [40, 41, 42, 43, 44]]
    lens = torch.tensor([18, 19, 13], dtype=torch.int32)
    table = torch.tensor(tables, dtype=torch.int32)
    plan = reference.plan_decode(table, lens, page_size)
    assert len(plan.blocks) == 1 and plan.blocks[0].bias is not None and len(plan.groups) == 1
    for layer in range(3):
        q = torch.randn(3, 4, 16)
        got = reference.decode_attention(q, kc[layer], vc[layer], table, lens, 0.25, plan=plan)
        torch.testing.assert_close(
            got, reference.decode_attention(q, kc[layer], vc[layer], table, lens, 0.25)
        )
        torch.testing.assert_close(got, _naive_decode(q * 2, kc[layer], vc[layer], table, lens.tolist()))

    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    ext_lens = torch.tensor([9, 7], dtype=torch.int32)  # the first has a cached prefix of 4 tokens
    ext_plan = reference.plan_extend(table[:2], cu, ext_lens, page_size)
    assert ext_plan.seqs[0][4] is not None and ext_plan.seqs[1][4] is None  # prefix mask vs plain causal
    q = torch.randn(12, 4, 16)
    torch.testing.assert_close(
        reference.extend_attention(q, kc[0], vc[0], table[:2], cu, ext_lens, 0.25, plan=ext_plan),
        reference.extend_attention(q, kc[0], vc[0], table[:2], cu, ext_lens, 0.25),
    )


def test_rows_of_very_different_lengths_are_not_padded_to_the_longest() -> None:
    """A 2,000-token document beside short chats: the short rows go into their own padded block (the
    plan's blocks), and every row still matches the naive per-sequence softmax."""
    torch.manual_seed(2)
    page_size = 16
    kc, vc = torch.randn(2, 400, page_size, 3, 64).unbind(0)
    lens = [2000, 40, 1900, 70, 17, 1100]
    tables, next_page = [], 1
    for n in lens:
        pages = -(-n // page_size)
        tables.append(list(range(next_page, next_page + pages)))
        next_page += pages
    table = torch.zeros(len(lens), max(map(len, tables)), dtype=torch.int32)
    for i, t in enumerate(tables):
        table[i, : len(t)] = torch.tensor(t)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    plan = reference.plan_decode(table, seq_lens, page_size)
    widths = sorted(int(b.pages.shape[1]) for b in plan.blocks)
    assert len(plan.blocks) >= 2 and widths[0] <= 5  # the chats read 5 pages, not 125
    q = torch.randn(len(lens), 9, 64)
    got = reference.decode_attention(q, kc, vc, table, seq_lens, 0.125, plan=plan)
    torch.testing.assert_close(got, _naive_decode(q, kc, vc, table, lens), atol=1e-5, rtol=1e-5)
