"""The graph-safe decode step (``model/graph_step.py``) and device sampling (``sampling/device_sampler.py``).

On the CPU: a step padded to its bucket gives the unpadded step's logits and K/V, and the torch
runner's greedy tokens in float32; neither the step nor the sampling reads a value back to the host
(``readback.forbid_readback``, which also must catch a read-back added to the step); device sampling
picks ``Sampler``'s tokens, seeded draws included. On a GPU (``@pytest.mark.gpu``): the captured graphs
replay the eager step's logits, under ``torch.cuda.set_sync_debug_mode("error")``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch
from readback import ReadBack, forbid_readback

from radixserve.cache.page_pool import KVPool
from radixserve.config import EngineConfig
from radixserve.knobs import add_arguments
from radixserve.model.attention import select_backend
from radixserve.model.graph_step import GraphStep, bucket_for, buckets
from radixserve.model.llama import LlamaForCausalLM
from radixserve.model.loader import load_model
from radixserve.model.pending import PENDING, Pending
from radixserve.model.runner import ModelRunner, SeqChunk
from radixserve.sampling.device_sampler import SamplingBuffers, sample
from radixserve.sampling.params import SamplingParams
from radixserve.sampling.sampler import Sampler, SamplingBatch

CPU = torch.device("cpu")
NUM_PAGES = 800


def _model(path: Path, device: torch.device = CPU) -> LlamaForCausalLM:
    return load_model(path, torch.float32, device)


def _pool(
    model: LlamaForCausalLM, page_size: int, kv_dtype: str = "float32", device: torch.device = CPU
) -> KVPool:
    c = model.config
    return KVPool(c.num_layers, NUM_PAGES, page_size, c.num_kv_heads, c.head_dim, kv_dtype, device)


def _prefilled(
    model: LlamaForCausalLM, pool: KVPool, rows: int, shared: bool, seed: int = 0
) -> tuple[ModelRunner, list[list[int]], list[list[int]]]:
    """A torch runner over ``pool`` and ``rows`` prompts (5 to 40 tokens) prefilled into it; their page
    tables are scattered over the pool, each with spare pages past its tokens, and with ``shared`` the
    first page is one page shared by every row (a common prefix). Returns (runner, tokens, tables)."""
    gen = torch.Generator().manual_seed(seed)
    vocab, ps = model.config.vocab_size, pool.page_size
    runner = ModelRunner(model, pool, select_backend("auto", CPU), CPU, native_step=False)
    prefix = torch.randint(3, vocab, (ps,), generator=gen).tolist()
    order = torch.randperm(NUM_PAGES - 1, generator=gen).add(1).tolist()  # pages 1.. in random order
    seqs: list[list[int]] = []
    tables: list[list[int]] = []
    for i in range(rows):
        length = int(torch.randint(5, 41, (1,), generator=gen))
        seq = torch.randint(3, vocab, (length,), generator=gen).tolist()
        if shared:
            seq[:ps] = prefix
        need = -(-(len(seq) + 8) // ps)  # room for the decode steps, plus a spare page
        table, order = order[:need], order[need:]
        if shared:
            table[0] = 0 if i == 0 else tables[0][0]
        seqs.append(seq)
        tables.append(table)
    for i in range(rows):  # one at a time: the shared first page is written once, then read
        runner.run([SeqChunk(seqs[i], 0, len(seqs[i]), tables[i])])
    return runner, seqs, tables


def _decode(seqs: list[list[int]], tables: list[list[int]]) -> list[SeqChunk]:
    return [SeqChunk(s, len(s) - 1, 1, t) for s, t in zip(seqs, tables)]


def _grow(seqs: list[list[int]], tokens: list[int]) -> None:
    for s, t in zip(seqs, tokens):
        s.append(t)


def test_buckets() -> None:
    assert buckets(64) == (1, 2, 4, 8, 16, 32, 64)
    assert buckets(48) == (1, 2, 4, 8, 16, 32, 48)
    assert buckets(300) == (1, 2, 4, 8, 16, 32, 64, 128, 256, 300)
    assert [bucket_for(n, buckets(48)) for n in (1, 3, 8, 33, 48)] == [1, 4, 8, 48, 48]
    with pytest.raises(ValueError):
        bucket_for(49, buckets(48))


@pytest.mark.parametrize(
    ("page_size", "kv_dtype", "shared"),
    [(4, "float32", False), (1, "float32", True), (16, "bfloat16", True), (4, "int8", False)],
)
def test_padded_bucket_equals_unpadded_step(
    tiny_llama: Path, page_size: int, kv_dtype: str, shared: bool
) -> None:
    """Batches of 1, 3, 5, 8 and 13 rows padded to buckets 1, 4, 8, 8, 16: the real rows' logits and
    the pool's K/V are those of the same step run at exactly its rows; padding writes no K/V."""
    model = _model(tiny_llama)
    pool = _pool(model, page_size, kv_dtype)
    _, seqs, tables = _prefilled(model, pool, 13, shared)
    step = GraphStep(model, pool, select_backend("auto", CPU), 16, 64)
    assert step.buckets == (1, 2, 4, 8, 16)
    for n, bucket in ((1, 1), (3, 4), (5, 8), (8, 8), (13, 16)):
        assert bucket_for(n, step.buckets) == bucket
        chunks = _decode(seqs[:n], tables[:n])
        step.buffers.fill(chunks, n)
        step.forward(n)
        unpadded = step.buffers.logits[:n].clone()
        pool_after = [b.clone() for b in pool.buffers()]
        padded = step.run(chunks)
        torch.testing.assert_close(padded, unpadded, rtol=1e-5, atol=1e-5)
        assert torch.equal(padded.argmax(-1), unpadded.argmax(-1))
        for before, after in zip(pool_after, pool.buffers()):
            torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
        _grow(seqs[:n], padded.argmax(-1).tolist())


@pytest.mark.parametrize("shared", [False, True])
def test_greedy_tokens_equal_the_runners_step(tiny_llama: Path, shared: bool) -> None:
    """Eight decode steps of 6 rows in float32: the graph step (padded to 8) and the torch runner's
    step, each over its own pool, pick the same greedy tokens from logits within 1e-4."""
    model = _model(tiny_llama)
    pools = [_pool(model, 4), _pool(model, 4)]
    runner, seqs, tables = _prefilled(model, pools[0], 6, shared)
    _, seqs_g, _ = _prefilled(model, pools[1], 6, shared)
    step = GraphStep(model, pools[1], select_backend("auto", CPU), 8, 64)
    for _ in range(8):
        want = runner.run(_decode(seqs, tables)).logits
        got = step.run(_decode(seqs_g, tables))
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        tokens = want.argmax(-1).tolist()
        assert got.argmax(-1).tolist() == tokens
        _grow(seqs, tokens)
        _grow(seqs_g, tokens)


@pytest.mark.parametrize("kv_dtype", ["float32", "int8"])
def test_the_step_reads_nothing_back(tiny_llama: Path, kv_dtype: str) -> None:
    model = _model(tiny_llama)
    pool = _pool(model, 4, kv_dtype)
    _, seqs, tables = _prefilled(model, pool, 5, shared=True)
    step = GraphStep(model, pool, select_backend("auto", CPU), 8, 64)
    step.buffers.fill(_decode(seqs, tables), 8)
    with forbid_readback():
        step.forward(8)


def test_the_readback_check_catches_a_readback(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check above is worth something only if a read-back added to the step fails it."""
    model = _model(tiny_llama)
    pool = _pool(model, 4)
    _, seqs, tables = _prefilled(model, pool, 2, shared=False)
    step = GraphStep(model, pool, select_backend("auto", CPU), 2, 64)
    step.buffers.fill(_decode(seqs, tables), 2)
    norm = model.norm.forward
    readbacks = {  # what each adds to the step's final norm -> what the check names
        "_local_scalar_dense": lambda x: x * x.abs().max().item(),
        "_local_scalar_dense ": lambda x: x if bool((x > 0).any()) else -x,
        "tolist": lambda x: x + len(x.tolist()),
        "bool mask": lambda x: x + x[x > 0].sum(),
        "nonzero": lambda x: x + x.nonzero().shape[0],
    }
    for named, change in readbacks.items():
        monkeypatch.setattr(model.norm, "forward", lambda x, change=change: change(norm(x)))
        step.forward(2)  # the changed step runs without the check: the check is what fails it
        with pytest.raises(ReadBack, match=named.strip()), forbid_readback():
            step.forward(2)
        monkeypatch.undo()
    with forbid_readback():  # and the check passes the step again once it is as it was
        step.forward(2)


def test_pending_tokens_are_taken_on_the_device_without_a_read_back(tiny_llama: Path) -> None:
    """The overlapped loop's steps (engine/overlap.py): a row's last token is ``PENDING`` in the host's
    lists and comes from the previous step's sampled tokens, in their own order, on the device. The
    graph step (under ``forbid_readback``), the native step and the torch runner's step (with an extend
    chunk ordered before the decodes) each give the logits of the same step given the tokens."""
    model = _model(tiny_llama)
    vocab = model.config.vocab_size
    sampled = torch.tensor([101, 102, 103, 104, 105]) % vocab  # the previous step's row j
    rows = [3, 0, 4, 1, 2]  # chunk i's token is sampled[rows[i]]

    def steps(pool: KVPool) -> tuple[list[SeqChunk], list[SeqChunk], list[list[int]]]:
        _, seqs, tables = _prefilled(model, pool, 5, shared=False)
        known = [SeqChunk([*s, int(sampled[r])], len(s), 1, t) for s, r, t in zip(seqs, rows, tables)]
        pending = [SeqChunk([*s, PENDING], len(s), 1, t) for s, t in zip(seqs, tables)]
        return known, pending, seqs

    pool = _pool(model, 4)
    step = GraphStep(model, pool, select_backend("auto", CPU), 8, 64)
    known, pending, _ = steps(pool)
    want = step.run(known)
    with forbid_readback():
        got = step.run(pending, Pending(sampled, list(range(5)), rows))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    # The torch runner: chunk 1 recomputes its whole sequence (a preempted request whose last token is
    # unread), so the runner orders it before the four decodes.
    pool = _pool(model, 4)
    runner = ModelRunner(model, pool, select_backend("auto", CPU), CPU, native_step=False)
    known, pending, seqs = steps(pool)
    for chunks in (known, pending):
        chunks[1] = SeqChunk(chunks[1].token_ids, 0, len(seqs[1]) + 1, chunks[1].page_table)
    want = runner.run(known).logits
    got = runner.run(pending, Pending(sampled, list(range(5)), rows)).logits
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    # The native step (decode rows only), where the model's formats allow it.
    pool = _pool(model, 4)
    runner = ModelRunner(model, pool, select_backend("auto", CPU), CPU, native_step=True)
    known, pending, _ = steps(pool)
    if runner.native is not None:
        want = runner.run(known).logits
        got = runner.run(pending, Pending(sampled, list(range(5)), rows)).logits
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_runner_keeps_its_cpu_step(tiny_llama: Path) -> None:
    """On the CPU the runner never picks the graph step, cuda_graphs or not; the flag parses."""
    model = _model(tiny_llama)
    runner = ModelRunner(model, _pool(model, 4), select_backend("auto", CPU), CPU, cuda_graphs=True)
    assert runner.graph_step is None
    parser = argparse.ArgumentParser()
    add_arguments(parser, EngineConfig)
    assert parser.parse_args([]).cuda_graphs is True
    assert parser.parse_args(["--no-cuda-graphs"]).cuda_graphs is False


def _params() -> list[SamplingParams]:
    """Greedy and sampled rows with every rule the sampler has, seeded and not."""
    return [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, repetition_penalty=1.3, logit_bias={5: 4.0}),
        SamplingParams(temperature=0.8, top_k=5),
        SamplingParams(temperature=1.0, top_p=0.6, seed=7),
        SamplingParams(temperature=1.2, min_p=0.1, presence_penalty=0.5, frequency_penalty=0.3),
        SamplingParams(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, seed=11, min_tokens=4),
        SamplingParams(temperature=1.0, repetition_penalty=0.8, seed=3),
    ]


def _generators(params: list[SamplingParams]) -> list[torch.Generator | None]:
    return [None if p.seed is None else torch.Generator().manual_seed(p.seed) for p in params]


@pytest.mark.parametrize("masked", [False, True])
def test_device_sampling_picks_the_samplers_tokens(masked: bool) -> None:
    """Ten steps over random logits: ``sample`` on padded buffers (7 rows in a bucket of 8) gives
    ``Sampler``'s tokens for every row, the random ones drawn from the same generators and global RNG."""
    vocab, rows = 50, 8
    params = _params()
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (6,), generator=gen).tolist() for _ in params]
    outputs: list[list[int]] = [[] for _ in params]
    ours, theirs = _generators(params), _generators(params)
    buffers = SamplingBuffers(rows, vocab, CPU)
    for step in range(10):
        logits = torch.randn(len(params), vocab, generator=gen) * 3
        mask = torch.rand(len(params), vocab, generator=gen) > 0.3 if masked and step % 2 else None
        torch.manual_seed(100 + step)
        batch = SamplingBatch.build(params, prompts, outputs, theirs, CPU, eos_token_ids=(2,))
        want = Sampler()(logits, batch, mask).tokens.tolist()
        torch.manual_seed(100 + step)
        sampled = buffers.fill(params, ours, prompts, outputs, rows, (2,), mask)
        padded = torch.cat([logits, torch.randn(rows - len(params), vocab, generator=gen)])
        with forbid_readback():
            got = sample(padded, buffers, rows, sampled)[: len(params)]
        assert got.tolist() == want
        for out, token in zip(outputs, want):
            out.append(token)


def test_device_sampling_respects_top_k_and_top_p() -> None:
    """Sampled rows with top-k 3 only ever pick one of their 3 best tokens; top-p 0.01 only the best;
    min-p 1 only the best; a grammar mask's forbidden tokens never."""
    vocab, rows = 40, 4
    params = [
        SamplingParams(temperature=1.0, top_k=3),
        SamplingParams(temperature=1.0, top_p=0.01),
        SamplingParams(temperature=5.0, min_p=1.0),
        SamplingParams(temperature=3.0),
    ]
    buffers = SamplingBuffers(rows, vocab, CPU)
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(1))
    mask = torch.ones(rows, vocab, dtype=torch.bool)
    mask[3, logits[3].topk(20).indices] = False  # the best half forbidden
    top3 = set(logits[0].topk(3).indices.tolist())
    seen: set[int] = set()
    for _ in range(200):
        sampled = buffers.fill(params, [None] * rows, [[]] * rows, [[]] * rows, rows, (), mask)
        tokens = sample(logits, buffers, rows, sampled).tolist()
        assert tokens[0] in top3
        assert tokens[1] == int(logits[1].argmax())
        assert tokens[2] == int(logits[2].argmax())
        assert bool(mask[3, tokens[3]])
        seen.add(tokens[0])
    assert seen == top3  # and it does sample, not just take the best


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graphs_replay_the_eager_step(tiny_llama: Path) -> None:
    """Captured at every bucket, the graphs replay the eager step's logits; neither syncs."""
    from radixserve.model.cuda_graphs import capture

    cuda = torch.device("cuda")
    model = _model(tiny_llama, cuda)
    pool = _pool(model, 4, device=cuda)
    backend = select_backend("auto", cuda)
    runner = ModelRunner(model, pool, backend, cuda, native_step=False)
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, model.config.vocab_size, (9 + 3 * i,), generator=gen).tolist() for i in range(6)]
    tables = [list(range(1 + 8 * i, 9 + 8 * i)) for i in range(6)]
    for s, t in zip(seqs, tables):
        runner.run([SeqChunk(s, 0, len(s), t)])
    step = GraphStep(model, pool, backend, 8, 64)
    cost = capture(step)
    assert sorted(step.replay) == [1, 2, 4, 8] and cost.seconds > 0
    for n in (1, 3, 6):
        chunks = _decode(seqs[:n], tables[:n])
        rows = bucket_for(n, step.buckets)
        step.buffers.fill(chunks, rows)
        torch.cuda.set_sync_debug_mode("error")  # any synchronisation inside the step raises
        try:
            step.forward(rows)
            eager = step.buffers.logits[:n].clone()
            step.buffers.logits.zero_()
            step.replay[rows].replay()
            replayed = step.buffers.logits[:n].clone()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.testing.assert_close(replayed, eager, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(step.run(chunks), eager, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_sampling_does_not_sync_on_cuda() -> None:
    cuda = torch.device("cuda")
    params = _params()
    buffers = SamplingBuffers(8, 64, cuda)
    generators = [None if p.seed is None else torch.Generator(cuda).manual_seed(p.seed) for p in params]
    history = [[1, 2, 3]] * len(params)
    sampled = buffers.fill(params, generators, history, history, 8, (2,))
    logits = torch.randn(8, 64, device=cuda)
    torch.cuda.set_sync_debug_mode("error")
    try:
        tokens = sample(logits, buffers, 8, sampled)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert tokens.shape == (8,) and tokens.device.type == "cuda"
