"""One attention step's tensors for the CPU attention benchmarks (``attention_cpu``, ``bf16_bench``):
the default model's shapes (9 q heads, 3 kv heads, head_dim 64, page size 16, float32), pages shuffled
through a pool, the metadata ``paged_attention`` takes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.kernels.kv_dtype import LayerCache
from radixserve.model.attention import AttentionBackend, AttentionMetadata, paged_attention

Q_HEADS, KV_HEADS, HEAD_DIM, PAGE = 9, 3, 64, 16
SCALE = HEAD_DIM**-0.5


@dataclass
class Case:
    name: str
    extend: list[tuple[int, int]]  # (new tokens, cached tokens) per extend sequence
    decode: list[int]  # context length per decode row
    shared: int = 0  # leading tokens of the decode rows on pages they share


CASES = [
    Case("decode batch 1 @512", [], [512]),
    Case("decode batch 8 @512", [], [512] * 8),
    Case("decode batch 32 @512", [], [512] * 32),
    Case("decode 8 x (shared 1000 + ~50 own)", [], [1000 + 45 + 2 * i for i in range(8)], shared=1000),
    Case("decode 32 x (shared 1000 + ~50 own)", [], [1000 + 30 + i for i in range(32)], shared=1000),
    Case("extend 100 over 500 cached", [(100, 500)], []),
    Case("prefill 512", [(512, 0)], []),
    Case("mixed: extend 100/500 + decode 8 @512", [(100, 500)], [512] * 8),
]


class Step:
    """One step's tensors over a shuffled pool of ``layers`` layers: metadata for ``paged_attention``."""

    def __init__(self, case: Case, layers: int, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        lens = [new + cached for new, cached in case.extend] + case.decode
        shared_pages = case.shared // PAGE
        own = [
            (n + PAGE - 1) // PAGE - (shared_pages if i >= len(case.extend) else 0)
            for i, n in enumerate(lens)
        ]
        num_pages = sum(own) + shared_pages + 1
        order = torch.randperm(num_pages, generator=gen).tolist()
        prefix, rest = order[:shared_pages], iter(order[shared_pages:])
        tables = []
        for i, n_own in enumerate(own):
            head = prefix if i >= len(case.extend) else []
            tables.append(head + [next(rest) for _ in range(n_own)])
        width = max(map(len, tables))
        table = torch.zeros(len(tables), width, dtype=torch.int32)
        for i, t in enumerate(tables):
            table[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
        shape = (layers, num_pages, PAGE, KV_HEADS, HEAD_DIM)
        self.k = torch.randn(shape, generator=gen)
        self.v = torch.randn(shape, generator=gen)
        new = [n for n, _ in case.extend] + [1] * len(case.decode)
        self.tokens = sum(new)
        self.q = torch.randn(self.tokens, Q_HEADS, HEAD_DIM, generator=gen)
        self.new_k = torch.randn(self.tokens, KV_HEADS, HEAD_DIM, generator=gen)
        self.new_v = torch.randn(self.tokens, KV_HEADS, HEAD_DIM, generator=gen)
        slots = []
        for b, (n_new, n) in enumerate(zip(new, lens)):
            slots += [tables[b][p // PAGE] * PAGE + p % PAGE for p in range(n - n_new, n)]
        # Extend sequences first, single-token rows last: the runner's order for ``plan_step``.
        self.num_extend = len(case.extend)
        self.page_table = table
        self.cu_q_lens = torch.zeros(len(new) + 1, dtype=torch.int32)
        self.cu_q_lens[1:] = torch.tensor(new, dtype=torch.int32).cumsum(0)
        self.seq_lens = torch.tensor(lens, dtype=torch.int32)
        self.slots = torch.tensor(slots)
        self.meta: AttentionMetadata | None = None

    def plan(self, backend: AttentionBackend) -> None:
        plan = backend.plan_step(self.page_table, self.cu_q_lens, self.seq_lens, self.num_extend, PAGE)
        self.meta = AttentionMetadata(self.slots, plan)

    def layer(self, backend: AttentionBackend, i: int) -> torch.Tensor:
        assert self.meta is not None, "plan() first"
        return paged_attention(
            backend, self.q, self.new_k, self.new_v, LayerCache(self.k[i], self.v[i]), self.meta, SCALE
        )
