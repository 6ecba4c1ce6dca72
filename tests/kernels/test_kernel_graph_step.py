"""The graph-safe decode step (``model/graph_step.py``) over the Triton kernels, as CUDA runs it (here in
the interpreter on CPU without CUDA): a decode-only plan built without ``plan_step``, the page table at
its full width and padding rows at slot -1. It must give the dense torch step's logits and K/V."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from radixserve.cache.page_pool import KVPool
from radixserve.model.attention import select_backend
from radixserve.model.graph_step import GraphStep
from radixserve.model.loader import load_model
from radixserve.model.runner import ModelRunner, SeqChunk


@pytest.mark.parametrize("kv_dtype", ["float32", "int8"])
def test_graph_step_over_triton_equals_the_dense_step(
    tiny_llama: Path, kv_dtype: str, device: torch.device
) -> None:
    model = load_model(tiny_llama, torch.float32, device)
    c = model.config
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, c.vocab_size, (n,), generator=gen).tolist() for n in (7, 13, 4, 21, 10)]
    tables = [[p + 1 for p in range(8 * i, 8 * i + 8)][::-1] for i in range(len(seqs))]  # pages 1.., reversed
    steps, pools = [], []
    for name in ("triton", "torch"):
        pool = KVPool(c.num_layers, 48, 4, c.num_kv_heads, c.head_dim, kv_dtype, device)
        backend = select_backend(name, device)
        runner = ModelRunner(model, pool, select_backend("torch", device), device, native_step=False)
        for s, t in zip(seqs, tables):
            runner.run([SeqChunk(s, 0, len(s), t)])
        steps.append(GraphStep(model, pool, backend, 8, 32))
        pools.append(pool)
    assert steps[0].backend.name == "triton" and steps[1].backend.name == "torch-graph-safe"
    for n in (1, 3, 5):  # buckets 1, 4, 8
        chunks = [SeqChunk(s, len(s) - 1, 1, t) for s, t in zip(seqs[:n], tables[:n])]
        triton_logits, torch_logits = (step.run(chunks) for step in steps)
        torch.testing.assert_close(triton_logits, torch_logits, rtol=1e-4, atol=1e-4)
        for a, b in zip(*(pool.buffers() for pool in pools)):
            torch.testing.assert_close(a.float(), b.float(), rtol=1e-4, atol=1e-4)
        for s, token in zip(seqs, torch_logits.argmax(-1).tolist()):
            s.append(token)
