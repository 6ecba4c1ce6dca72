"""The C++ CPU backend (radixserve.kernels.cpu) against the torch reference, in float32 within 1e-5:
page sizes 1/16/64, GQA groups 1/3/4, lengths off the page grid, prefill with no cached prefix,
extend over a cached prefix, decode with and without shared-prefix (cascade) groups, batch-1 decode
over a long context (split across threads), mixed steps through ``paged_attention``, and padding."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable

import pytest
import torch

from radixserve.kernels import cpu_build, reference
from radixserve.kernels.kv_dtype import LayerCache
from radixserve.model.attention import AttentionBackend, AttentionMetadata, get_backend, paged_attention

if not cpu_build.load() and shutil.which(os.environ.get("CXX", "c++")) is None:
    pytest.skip("no C++ compiler to build the CPU kernels", allow_module_level=True)
from radixserve.kernels import cpu  # noqa: E402  (a failed build with a compiler present is an error)

MakePaged = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
ops = torch.ops.radixserve_cpu
CPU = torch.device("cpu")
GROUPS = [(1, 3), (3, 3), (4, 2)]  # (GQA group, kv heads): 3, 9 and 8 q heads
HEAD_DIM = 64


def _cu(q_lens: list[int]) -> torch.Tensor:
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(q_lens, dtype=torch.int32).cumsum(0)
    return cu


def _share_prefix(table: torch.Tensor, rows: list[int], num_pages: int) -> None:
    """Make ``rows`` of ``table`` start with the first ``num_pages`` pages of ``rows[0]`` (a radix-tree
    prefix)."""
    for r in rows[1:]:
        table[r, :num_pages] = table[rows[0], :num_pages]


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize(("group", "kv_heads"), GROUPS)
def test_extend_matches_reference(page_size: int, group: int, kv_heads: int, make_paged: MakePaged) -> None:
    # (new tokens, whole length): plain prefill, extends over cached prefixes on and off the page
    # grid, one over a long prefix (split along the context), a single new token among many rows.
    segs = [(37, 37), (100, 600), (5, 5 + 2 * page_size), (1, 70), (64, 64 + 13), (3, 2500)]
    k_cache, v_cache, table = make_paged(
        [n for _, n in segs], page_size, kv_heads, HEAD_DIM, torch.float32, CPU
    )
    gen = torch.Generator().manual_seed(page_size * 10 + group)
    q = torch.randn(sum(t for t, _ in segs), kv_heads * group, HEAD_DIM, generator=gen)
    cu, lens = _cu([t for t, _ in segs]), torch.tensor([n for _, n in segs], dtype=torch.int32)
    got = cpu.extend_attention(q, k_cache, v_cache, table, cu, lens, 0.125)
    torch.testing.assert_close(
        got, reference.extend_attention(q, k_cache, v_cache, table, cu, lens, 0.125), atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize(("group", "kv_heads"), GROUPS)
@pytest.mark.parametrize("shared", [False, True])
def test_decode_matches_reference(
    page_size: int,
    group: int,
    kv_heads: int,
    shared: bool,
    make_paged: MakePaged,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    lens = [1, 7, 300, 301, 333, 2 * page_size + 5, 129, 164, 1000, 17]
    k_cache, v_cache, table = make_paged(
        lens, page_size, kv_heads, HEAD_DIM, torch.float32, CPU, seed=page_size
    )
    if shared:  # two groups sharing leading pages: rows 2-4 (a document) and rows 6-7
        _share_prefix(table, [2, 3, 4], 299 // page_size)  # 256 tokens or more: the default cascades
        _share_prefix(table, [6, 7], 128 // page_size)  # cascades with a lower threshold
        monkeypatch.setattr(cpu, "CASCADE_MIN_TOKENS", 64 if page_size < 64 else 256)
    gen = torch.Generator().manual_seed(group)
    q = torch.randn(len(lens), kv_heads * group, HEAD_DIM, generator=gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    plan = cpu.plan_decode(table, seq_lens, page_size)
    cascade_rows = int(
        (plan.items[:, 2] - plan.items[:, 1] > 1).sum()
    )  # items attending several rows at once
    assert (cascade_rows > 0) == shared
    got = cpu.decode_attention(q, k_cache, v_cache, table, seq_lens, 0.125, plan=plan)
    torch.testing.assert_close(
        got, reference.decode_attention(q, k_cache, v_cache, table, seq_lens, 0.125), atol=1e-5, rtol=1e-5
    )


def test_batch_one_decode_over_a_long_context_is_split_across_threads(make_paged: MakePaged) -> None:
    k_cache, v_cache, table = make_paged([5000], 16, 3, HEAD_DIM, torch.float32, CPU)
    lens = torch.tensor([5000], dtype=torch.int32)
    items, *_, merge_slots = ops.plan(table, torch.tensor([0, 1], dtype=torch.int32), lens, 16, 2, 32)
    assert items.shape[0] > 2 and merge_slots.numel() == items.shape[0]  # flash-decoding pieces, merged
    q = torch.randn(1, 9, HEAD_DIM)
    want = reference.decode_attention(q, k_cache, v_cache, table, lens, 0.125)
    plan = cpu.Plan(*ops.plan(table, torch.tensor([0, 1], dtype=torch.int32), lens, 16, 2, 32))
    torch.testing.assert_close(
        cpu.decode_attention(q, k_cache, v_cache, table, lens, 0.125, plan=plan), want, atol=1e-5, rtol=1e-5
    )
    single = cpu.Plan(*ops.plan(table, torch.tensor([0, 1], dtype=torch.int32), lens, 16, 1, 32))
    assert single.items.shape[0] == 1  # one thread: nothing to split
    torch.testing.assert_close(
        cpu.decode_attention(q, k_cache, v_cache, table, lens, 0.125, plan=single), want, atol=1e-5, rtol=1e-5
    )


def _mixed_step(
    backend: AttentionBackend, make_paged: MakePaged, page_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of two extend sequences (one over a cached prefix) and three decode rows, two of
    them sharing a prefix, through ``paged_attention`` (store_kv first, then attention)."""
    new = [40, 9, 1, 1, 1]
    lens = [40, 9 + 50, 200, 230, 33]
    k_cache, v_cache, table = make_paged(lens, page_size, 3, HEAD_DIM, torch.float32, CPU, seed=7)
    _share_prefix(table, [2, 3], 150 // page_size)
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(sum(new), 9 + 3 + 3, HEAD_DIM, generator=gen)  # strided views, as the model makes them
    q, k, v = qkv.split([9, 3, 3], dim=1)
    slots = []
    for b, (t, n) in enumerate(zip(new, lens)):
        slots += [int(table[b, p // page_size]) * page_size + p % page_size for p in range(n - t, n)]
    plan = backend.plan_step(table, _cu(new), torch.tensor(lens, dtype=torch.int32), 2, page_size)
    meta = AttentionMetadata(torch.tensor(slots, dtype=torch.int64), plan)
    out = paged_attention(backend, q, k, v, LayerCache(k_cache, v_cache), meta, 0.125)
    return out, torch.stack((k_cache, v_cache))


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_mixed_extend_and_decode_step_through_paged_attention(
    page_size: int, make_paged: MakePaged, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cpu, "CASCADE_MIN_TOKENS", 64)  # the two decode rows sharing 150 tokens cascade
    got, got_cache = _mixed_step(get_backend("cpu"), make_paged, page_size)
    want, want_cache = _mixed_step(get_backend("torch"), make_paged, page_size)
    assert torch.equal(got_cache, want_cache)  # store_kv wrote the same slots
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_padding_rows_and_segments(make_paged: MakePaged) -> None:
    """Negative slots are skipped; an empty decode row, an extend segment with no new tokens and
    query rows past the last segment (a batch bucket's padding) come out as zeros."""
    k_cache, v_cache, table = make_paged([20, 30], 16, 3, HEAD_DIM, torch.float32, CPU)
    before = k_cache.clone()
    k = torch.randn(3, 3, HEAD_DIM)
    cpu.store_kv(k_cache, v_cache, k, k, torch.tensor([-1, 5, -1]))
    assert torch.equal(k_cache.view(-1, 3, HEAD_DIM)[5], k[1])
    k_cache.view(-1, 3, HEAD_DIM)[5] = before.view(-1, 3, HEAD_DIM)[5]
    assert torch.equal(k_cache, before)

    q = torch.randn(3, 9, HEAD_DIM)
    lens = torch.tensor([20, 0, 30], dtype=torch.int32)
    out = cpu.decode_attention(q, k_cache, v_cache, table[[0, 1, 1]], lens, 0.125)
    assert out[1].abs().sum() == 0
    torch.testing.assert_close(
        out[[0, 2]],
        reference.decode_attention(q[[0, 2]], k_cache, v_cache, table, lens[[0, 2]], 0.125),
        atol=1e-5,
        rtol=1e-5,
    )

    q = torch.randn(8, 9, HEAD_DIM)  # rows 0-3: sequence 0; sequence 1 has none; rows 4-7: padding
    cu, ext_lens = torch.tensor([0, 4, 4], dtype=torch.int32), torch.tensor([20, 30], dtype=torch.int32)
    out = cpu.extend_attention(q, k_cache, v_cache, table, cu, ext_lens, 0.125)
    assert out[4:].abs().sum() == 0
    torch.testing.assert_close(
        out[:4],
        reference.extend_attention(q[:4], k_cache, v_cache, table[:1], cu[:2], ext_lens[:1], 0.125),
        atol=1e-5,
        rtol=1e-5,
    )


def test_one_plan_serves_every_layer(make_paged: MakePaged) -> None:
    k_cache, v_cache, table = make_paged([90, 45, 300], 16, 3, HEAD_DIM, torch.float32, CPU)
    layers = torch.randn(3, 2, *k_cache.shape)
    lens = torch.tensor([90, 45, 300], dtype=torch.int32)
    plan = cpu.plan_decode(table, lens, 16)
    for kc, vc in layers:
        q = torch.randn(3, 9, HEAD_DIM)
        got = cpu.decode_attention(q, kc, vc, table, lens, 0.125, plan=plan)
        torch.testing.assert_close(got, cpu.decode_attention(q, kc, vc, table, lens, 0.125), atol=0, rtol=0)
        torch.testing.assert_close(
            got, reference.decode_attention(q, kc, vc, table, lens, 0.125), atol=1e-5, rtol=1e-5
        )


def test_other_dtypes_and_head_dims_use_the_reference_with_a_plan_made_once(make_paged: MakePaged) -> None:
    k_cache, v_cache, table = make_paged(
        [50, 70], 16, 2, 20, torch.float32, CPU
    )  # head_dim 20: no vector width fits
    lens = torch.tensor([50, 70], dtype=torch.int32)
    q = torch.randn(2, 4, 20)
    plan = cpu.plan_decode(table, lens, 16)
    got = cpu.decode_attention(q, k_cache, v_cache, table, lens, 0.2, plan=plan)
    assert plan.fallback is not None
    torch.testing.assert_close(got, reference.decode_attention(q, k_cache, v_cache, table, lens, 0.2))
    kb, vb, qb = k_cache.bfloat16(), v_cache.bfloat16(), q.bfloat16()
    got = cpu.extend_attention(qb, kb, vb, table, torch.tensor([0, 1, 2], dtype=torch.int32), lens, 0.2)
    want = reference.extend_attention(
        qb, kb, vb, table, torch.tensor([0, 1, 2], dtype=torch.int32), lens, 0.2
    )
    torch.testing.assert_close(got, want)


def test_malformed_plans_and_page_tables_raise_instead_of_reading_out_of_bounds(
    make_paged: MakePaged,
) -> None:
    k_cache, v_cache, table = make_paged([40], 16, 3, HEAD_DIM, torch.float32, CPU)
    lens = torch.tensor([40], dtype=torch.int32)
    q = torch.randn(1, 9, HEAD_DIM)
    plan = cpu.plan_decode(table, lens, 16)
    with pytest.raises(RuntimeError, match="page"):
        cpu.decode_attention(q, k_cache, v_cache, torch.full_like(table, 10_000), lens, 0.125, plan=plan)
    bad = cpu.Plan(plan.items.clone(), plan.rows, plan.merge_rows, plan.merge_offsets, plan.merge_slots)
    bad.items[0, 0] = 5  # a segment that does not exist
    with pytest.raises(RuntimeError, match="malformed"):
        cpu.decode_attention(q, k_cache, v_cache, table, lens, 0.125, plan=bad)
    with pytest.raises(RuntimeError, match="slot"):
        cpu.store_kv(k_cache, v_cache, q[:, :3], q[:, :3], torch.tensor([10_000]))


def test_ops_have_schemas_and_fake_kernels_for_tracing(make_paged: MakePaged) -> None:
    k_cache, v_cache, table = make_paged([40, 70], 16, 3, HEAD_DIM, torch.float32, CPU)
    lens = torch.tensor([40, 70], dtype=torch.int32)
    plan = cpu.plan_decode(table, lens, 16)
    q, k = torch.randn(2, 9, HEAD_DIM), torch.randn(2, 3, HEAD_DIM)
    slots = torch.tensor([int(table[0, 2]) * 16 + 7, int(table[1, 4]) * 16 + 5])
    assert "Tensor(a!) k_cache" in str(ops.store_kv.default._schema)
    torch.library.opcheck(ops.paged_attention.default, (q, k_cache, v_cache, table, *plan.tensors(), 0.125))
    torch.library.opcheck(ops.store_kv.default, (k_cache.clone(), v_cache.clone(), k, k, slots))
    torch.library.opcheck(ops.plan.default, (table, torch.arange(3, dtype=torch.int32), lens, 16, 2, 32))

    def step(q: torch.Tensor, k: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor) -> torch.Tensor:
        cpu.store_kv(kc, vc, k, k, slots)
        return cpu.decode_attention(q, kc, vc, table, lens, 0.125, plan=plan)

    want_caches = (k_cache.clone(), v_cache.clone())
    want = step(q, k, *want_caches)
    got_caches = (k_cache.clone(), v_cache.clone())
    got = torch.compile(step, backend="aot_eager", fullgraph=True)(q, k, *got_caches)  # dynamo + FakeTensors
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert torch.equal(got_caches[0], want_caches[0]) and torch.equal(got_caches[1], want_caches[1])


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_split_extend_and_cascade_merge_alike_on_any_number_of_threads(
    threads: int, make_paged: MakePaged
) -> None:
    """Plans made for 4 threads split long contexts (extend and a cascade group's shared pages) into
    pieces merged through their log-sum-exps; the op runs them on however many threads there are."""
    lens = [2000, 1300, 1301, 1302]  # an extend of 40 over 1,960 cached; three decode rows sharing 1,280
    k_cache, v_cache, table = make_paged(lens, 16, 3, HEAD_DIM, torch.float32, CPU, seed=5)
    _share_prefix(table, [1, 2, 3], 80)
    q = torch.randn(43, 9, HEAD_DIM)
    cu = torch.tensor([0, 40, 41, 42, 43], dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    plan = cpu.Plan(*ops.plan(table, cu, seq_lens, 16, 4, 256))
    assert plan.items.shape[0] > 6 and plan.merge_rows.numel() == 43  # every row split or cascaded
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out, lse = ops.paged_attention(q, k_cache, v_cache, table, *plan.tensors(), 0.125)
    finally:
        torch.set_num_threads(saved)
    want = reference.extend_attention(q[:40], k_cache, v_cache, table[:1], cu[:2], seq_lens[:1], 0.125)
    torch.testing.assert_close(out[:40], want, atol=1e-5, rtol=1e-5)
    want = reference.decode_attention(q[40:], k_cache, v_cache, table[1:], seq_lens[1:], 0.125)
    torch.testing.assert_close(out[40:], want, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(lse).all()
