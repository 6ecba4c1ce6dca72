"""The graph-safe decode step: one function over preallocated buffers, with no host read-back.

Why: a CUDA graph replays a fixed sequence of kernels on fixed addresses, so a step that is to be
captured (``model/cuda_graphs.py``) may neither allocate its inputs afresh nor ask the device for a
value (``.item()``, ``.tolist()``, a shape that depends on data): either breaks the capture or, worse,
replays a stale value. This module keeps that contract on any device, so the CPU tests can hold it.

- Buffers (``DecodeBuffers``), sized once for the largest bucket: the token ids, positions, K/V slots
  and sequence lengths as the rows of one int64 ``[4, rows]`` tensor (one copy from the host a step),
  the page tables ``[rows, width]`` int32 (``width``: the pages of the longest context) and the logits
  ``[rows, vocab]`` float32 the step writes.
- Buckets (``buckets``): a step of n decode rows runs at the smallest bucket >= n; rows past n are
  padding: token 0 at position 0, slot -1 (their K/V is written nowhere: the Triton store skips negative
  slots, and the CPU store below rewrites row 0's K/V instead), one token of context (page 0, so their
  attention stays finite) and logits nobody reads. The pool reserves no page, hence the negative slot
  rather than a scratch page.
- Attention: the runner's Triton backend on CUDA (its decode kernel reads the page table on the device
  and sizes its splits from the table's width, a constant here); elsewhere ``GraphSafeTorchBackend``,
  a dense, masked torch decode over every page of the table (the reference's planned decode reads
  lengths back to the host to group rows; this one does not). Slow for long contexts: it serves the
  tests and any device without Triton, not CPU serving, which keeps its native step.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import ClassVar, Protocol

import numpy as np
import torch

from radixserve.cache.page_pool import KVPool
from radixserve.kernels.kv_dtype import LayerCache, dequantize, quantize_int8
from radixserve.kernels.parts import PartsPlan
from radixserve.model.attention import AttentionBackend, AttentionMetadata, StepPlan, TorchBackend
from radixserve.model.llama import LlamaForCausalLM
from radixserve.model.pending import Pending

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # batch sizes a decode step is padded to


class DecodeChunk(Protocol):
    """What the step needs of a decode row (``runner.SeqChunk`` has it)."""

    token_ids: list[int]
    num_computed: int
    num_new: int
    page_table: list[int]
    want_all_logits: bool


def buckets(max_batch: int) -> tuple[int, ...]:
    """The standard buckets below ``max_batch``, then ``max_batch`` itself: every batch the scheduler
    can form has a bucket, and the largest buffer is no larger than the largest batch."""
    return (*(b for b in BUCKETS if b < max_batch), max_batch)


def bucket_for(rows: int, sizes: Sequence[int]) -> int:
    """The smallest bucket of ``sizes`` (ascending) that holds ``rows`` rows."""
    i = bisect.bisect_left(sizes, rows)
    if i == len(sizes):
        raise ValueError(f"{rows} rows exceed the largest bucket ({sizes[-1]})")
    return sizes[i]


def decode_only(chunks: Sequence[DecodeChunk], max_rows: int) -> bool:
    """Whether the graph step runs ``chunks``: 1 to ``max_rows`` rows, each decoding one token and none
    asking for the logits of all its positions (prompt logprobs, drafts)."""
    if not 1 <= len(chunks) <= max_rows:
        return False
    return all(c.num_new == 1 and not c.want_all_logits for c in chunks)


class DecodeBuffers:
    """Every input and the output of the step, allocated once on the step's device."""

    IDS, POSITIONS, SLOTS, SEQ_LENS = range(4)  # the rows of ``index``

    def __init__(self, rows: int, width: int, vocab: int, page_size: int, device: torch.device) -> None:
        self.rows, self.width, self.page_size = rows, width, page_size
        self.index = torch.zeros(4, rows, dtype=torch.int64, device=device)
        self.page_table = torch.zeros(rows, width, dtype=torch.int32, device=device)
        self.logits = torch.zeros(rows, vocab, dtype=torch.float32, device=device)
        self.fill_padding(0, rows)

    def fill_padding(self, start: int, end: int) -> None:
        """Rows ``[start, end)`` as padding (see the module's docstring); at start-up, for capture."""
        self.index[:, start:end] = torch.tensor([0, 0, -1, 1], device=self.index.device)[:, None]
        self.page_table[start:end] = 0

    def fill(self, chunks: Sequence[DecodeChunk], rows: int) -> None:
        """Write ``chunks`` into the first ``len(chunks)`` rows and padding up to ``rows`` (the bucket):
        built on the host, then two copies to the device, the only transfers of a step."""
        ps, width = self.page_size, self.width
        index = torch.empty(4, rows, dtype=torch.int64)
        index[:, len(chunks) :] = torch.tensor([0, 0, -1, 1])[:, None]
        table = np.zeros((rows, width), dtype=np.int32)  # numpy: a row from a list is one C loop
        cols: list[int] = []
        for i, c in enumerate(chunks):
            pos = c.num_computed
            pages = c.page_table[:width]
            table[i, : len(pages)] = pages
            cols += (c.token_ids[pos], pos, pages[pos // ps] * ps + pos % ps, pos + 1)
        index[:, : len(chunks)] = torch.tensor(cols, dtype=torch.int64).view(-1, 4).T
        self.index[:, :rows].copy_(index, non_blocking=True)
        self.page_table[:rows].copy_(torch.from_numpy(table), non_blocking=True)


class GraphSafeTorchBackend(TorchBackend):
    """The torch reference's page copies, with a decode attention that never reads back to the host:
    every page of the table is read and positions past a row's length are masked. Takes only decode
    plans (``PartsPlan`` with no extend part), as the graph step makes them."""

    name: ClassVar[str] = "torch-graph-safe"

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: LayerCache,
        slot_mapping: torch.Tensor,
        plan: StepPlan,
        scale: float,
    ) -> torch.Tensor:
        assert isinstance(plan, PartsPlan) and plan.extend is None and plan.decode is not None
        table, seq_lens, _ = plan.decode
        store_rows(cache, k, v, slot_mapping)
        return dense_decode(q, cache, table, seq_lens, scale)


def store_rows(cache: LayerCache, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """Write each row's K/V into its slot, without looking at which slots are negative (padding):
    a padding row writes row 0's K/V into row 0's slot again, so duplicates carry equal values."""
    heads, dim = cache.k.shape[-2:]
    src = torch.where(slots >= 0, torch.arange(slots.shape[0], device=slots.device), 0)
    dst = slots.index_select(0, src)
    for pages, x, scales in ((cache.k, k, cache.k_scale), (cache.v, v, cache.v_scale)):
        x = x.index_select(0, src)
        if pages.dtype == torch.int8:
            assert scales is not None, "int8 pages need their scales"
            x, s = quantize_int8(x)
            scales.view(-1, heads).index_copy_(0, dst, s)
        pages.view(-1, heads, dim).index_copy_(0, dst, x.to(pages.dtype))


def dense_decode(
    q: torch.Tensor, cache: LayerCache, table: torch.Tensor, seq_lens: torch.Tensor, scale: float
) -> torch.Tensor:
    """``q [B, q_heads, D]`` over the first ``seq_lens[b]`` tokens of row b's pages -> ``[B, q_heads, D]``,
    in fp32 as the reference's."""
    rows, q_heads, dim = q.shape
    kv_heads = cache.k.shape[2]
    pages = table.long().flatten()

    def read(values: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
        picked = None if scales is None else scales.index_select(0, pages)
        got = dequantize(values.index_select(0, pages), picked)
        return got.view(rows, -1, kv_heads, dim).transpose(1, 2)  # [B, kv_heads, L, D]

    keys, values = read(cache.k, cache.k_scale), read(cache.v, cache.v_scale)
    qg = q.float().view(rows, kv_heads, q_heads // kv_heads, dim)
    scores = torch.matmul(qg, keys.transpose(-1, -2)) * scale  # [B, kv_heads, group, L]
    length = keys.shape[2]
    past = torch.arange(length, device=q.device)[None, :] >= seq_lens[:, None]  # [B, L]
    scores = scores.masked_fill(past[:, None, None, :], float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), values)
    return out.reshape(rows, q_heads, dim).to(q.dtype)


class GraphStep:
    """The decode step as one function of ``buffers`` (``forward``), and ``run`` that fills them from a
    batch and calls it, or replays its captured graph where one is given (``model/cuda_graphs.py``)."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        pool: KVPool,
        backend: AttentionBackend,
        max_batch: int,
        max_context: int,
    ) -> None:
        device = pool.k_buffer.device
        self.model, self.pool = model, pool
        # Triton's kernels never read back; elsewhere the dense torch decode above.
        self.backend = backend if backend.name == "triton" else GraphSafeTorchBackend()
        self.buckets = buckets(max_batch)
        width = min(-(-max_context // pool.page_size), pool.num_pages)
        vocab = model.config.vocab_size
        self.buffers = DecodeBuffers(self.buckets[-1], width, vocab, pool.page_size, device)
        self.replay: dict[int, torch.cuda.CUDAGraph] = {}  # bucket -> its captured ``forward``

    def covers(self, chunks: Sequence[DecodeChunk]) -> bool:
        return decode_only(chunks, self.buckets[-1])

    def forward(self, rows: int) -> None:
        """The step over the first ``rows`` rows of the buffers: K/V written into the pool, logits into
        ``buffers.logits``. Reads nothing back to the host (``tests/model/test_graph_step.py``)."""
        b = self.buffers
        ids, positions, slots, seq_lens = b.index[:, :rows].unbind(0)
        plan = PartsPlan(0, None, (b.page_table[:rows], seq_lens, None))
        with torch.no_grad():
            hidden = self.model(ids, positions, AttentionMetadata(slots, plan), self.pool, self.backend)
            b.logits[:rows].copy_(self.model.compute_logits(hidden))

    def run(self, chunks: Sequence[DecodeChunk], pending: Pending | None = None) -> torch.Tensor:
        """Each chunk's next-token logits ``[len(chunks), vocab]`` (a copy: the buffer is the next
        step's). A chunk of ``pending`` takes its token from the previous step's, on the device."""
        rows = bucket_for(len(chunks), self.buckets)
        self.buffers.fill(chunks, rows)
        if pending is not None:
            pending.fill(self.buffers.index[0], pending.chunks)
        graph = self.replay.get(rows)
        if graph is not None:
            graph.replay()
        else:
            self.forward(rows)
        return self.buffers.logits[: len(chunks)].clone()
