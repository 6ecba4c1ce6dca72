"""Tensor parallelism (engine/tensor_parallel.py, model/sharding.py, parallel/comm.py): N ranks give the
tokens and logits of one, eager and compiled, sharded or replicated KV heads, with the prefix cache, the
host and disk tiers, speculative decoding, int8 and GGUF weights; bad sizes are refused by name.

The tiny model has 4 query and 2 KV heads (TP=2 shards them, TP=4 replicates the KV heads); the default
SmolLM2-135M has 9 and 3 (TP=3). On 2 shared cores every rank gets one thread: keep prompts short.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from hf_quant_files import write_quantized

from radixserve import Engine, SamplingParams
from radixserve.config import EngineConfig
from radixserve.engine.tensor_parallel import STOP_WAIT_S, TensorParallel, TensorParallelError
from radixserve.model.gguf import GGUFLinear
from radixserve.model.llama import DecoderLayer
from radixserve.model.model_config import ModelConfig
from radixserve.model.runner import SeqChunk
from radixserve.model.sharding import check_tensor_parallel
from radixserve.outputs import RequestOutput
from radixserve.parallel.cpus import bind_process

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=5)
TOL = 1e-4


def tiny_engine(path: Path, **options: Any) -> Engine:
    """The tiny model's engine as these tests run it (eager, pages of 4, 64 of them); ``options`` override."""
    return Engine(str(path), **{"enforce_eager": True, "page_size": 4, "num_pages": 64, **options})


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 290) for _ in range(n)]


TINY_PROMPTS = [tokens(5 + 3 * i, i) for i in range(4)]


def assert_same(ref: list[RequestOutput], out: list[RequestOutput], tol: float = TOL) -> None:
    """Token-identical greedy outputs whose top-5 logprobs agree within ``tol``."""
    for r, o in zip(ref, out, strict=True):
        assert o.outputs[0].token_ids == r.outputs[0].token_ids
        for lr, lo in zip(r.outputs[0].logprobs or [], o.outputs[0].logprobs or [], strict=True):
            assert lr.top.keys() == lo.top.keys()
            assert max(abs(lr.top[k] - lo.top[k]) for k in lr.top) < tol


def assert_logits_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Within 1e-4: log-probabilities absolutely, raw logits relative to their size (fp32 sums in
    another order: the row-parallel partial sums are added after rounding; SmolLM2's logits reach ~30,
    where one fp32 ulp is 2e-6 and the measured largest difference about 1e-4)."""
    lp, lr = out.log_softmax(-1), ref.log_softmax(-1)
    assert (lp - lr).abs().max() < TOL, (lp - lr).abs().max()
    torch.testing.assert_close(out, ref, rtol=TOL, atol=TOL)


def prefill_logits(eng: Engine, prompts: list[list[int]]) -> torch.Tensor:
    """The logits after each prompt, as one batch straight through the runner, over pages nobody holds
    (the cache is flushed first)."""
    assert eng.flush_cache()
    chunks, page = [], 0
    for p in prompts:
        n = -(-len(p) // eng.config.page_size)
        chunks.append(SeqChunk(p, 0, len(p), list(range(page, page + n))))
        page += n
    return eng.runner.run(chunks).logits


@pytest.fixture(scope="module")
def tiny_ref(tiny_llama: Path) -> list[RequestOutput]:
    eng = tiny_engine(tiny_llama)
    out = eng.generate(TINY_PROMPTS, GREEDY)
    eng.close()
    return out


@pytest.mark.parametrize(("size", "eager"), [(2, True), (2, False), (4, True)])
def test_tiny_model_matches_one_rank(
    tiny_llama: Path, tiny_ref: list[RequestOutput], size: int, eager: bool
) -> None:
    """TP=2 (KV heads sharded) eager and compiled, TP=4 (KV heads replicated): TP=1's tokens and logits;
    each rank bound to its own share of the cores."""
    cores = os.sched_getaffinity(0)
    eng = tiny_engine(tiny_llama, enforce_eager=eager, tensor_parallel_size=size)
    try:
        assert eng.pool.k_buffer.shape[3] == 1  # a rank's KV heads: one of two, or both ranks' one
        assert isinstance(eng.tp, TensorParallel) and len(eng.tp.pids) == size - 1
        bound = [os.sched_getaffinity(0)] + [set(psutil.Process(pid).cpu_affinity()) for pid in eng.tp.pids]
        assert set().union(*bound) <= cores and all(bound)
        # Every thread of a rank, those it started before it was ready too (gloo's), shares its binding.
        for pid, cpus in zip([os.getpid(), *eng.tp.pids], bound, strict=True):
            assert {frozenset(os.sched_getaffinity(t.id)) for t in psutil.Process(pid).threads()} == {
                frozenset(cpus)
            }
        if len(cores) >= size:  # a share each, none shared
            assert sum(len(b) for b in bound) == len(set().union(*bound)) == len(cores) // size * size
        assert_same(tiny_ref, eng.generate(TINY_PROMPTS, GREEDY))
        eng.check_integrity()
    finally:
        eng.close()
    assert os.sched_getaffinity(0) == cores  # rank 0's binding undone
    assert all(os.sched_getaffinity(t.id) == cores for t in psutil.Process().threads())


def test_a_dead_rank_fails_the_step_and_close_kills_the_ranks_left_at_once(tiny_llama: Path) -> None:
    # A rank left waiting in a collective for the dead one never reads "stop": closing waited
    # STOP_WAIT_S (10 s) for it, and the engine process's exit and restart with it.
    eng = tiny_engine(tiny_llama, tensor_parallel_size=4)
    assert isinstance(eng.tp, TensorParallel)
    ranks = [psutil.Process(pid) for pid in eng.tp.pids]
    for i, prompt in enumerate(TINY_PROMPTS):
        eng.add_request(prompt, SamplingParams(max_tokens=200, temperature=0, ignore_eos=True), f"r{i}")
    for _ in range(3):
        eng.step()
    ranks[0].kill()
    with pytest.raises(TensorParallelError, match="rank 1 .* died of SIGKILL"):
        for _ in range(200):
            eng.step()
    started = time.monotonic()
    eng.close()
    assert time.monotonic() - started < STOP_WAIT_S / 2
    assert not any(r.is_running() and r.status() != psutil.STATUS_ZOMBIE for r in ranks)


def test_bind_process_binds_every_thread_of_the_process() -> None:
    # A rank binds itself once it is ready, after its start-up started threads (gloo's): binding the
    # calling thread alone would leave those where they were.
    cores = os.sched_getaffinity(0)
    started, stop = threading.Event(), threading.Event()

    def wait() -> None:
        started.set()
        stop.wait()

    other = threading.Thread(target=wait)
    other.start()
    started.wait()
    one = {min(cores)}
    try:
        assert bind_process(one) == cores
        assert other.native_id is not None and os.sched_getaffinity(other.native_id) == one
        assert os.sched_getaffinity(0) == one
    finally:
        bind_process(cores)
        stop.set()
        other.join()
    assert os.sched_getaffinity(0) == cores


def test_prefix_hits_and_tier_round_trip_under_tp(
    tiny_llama: Path, tiny_ref: list[RequestOutput], tmp_path: Path
) -> None:
    """Under TP=2, a device hit, and pages pushed out to the host and disk tiers and loaded back, give the
    tokens of TP=1 with no cache."""
    page_bytes = 2 * 2 * 4 * 1 * 16 * 4  # K+V, 2 layers, 4 tokens, 1 KV head a rank, head_dim 16, fp32
    doc = tokens(40, 7)
    prompt = doc + [5, 6, 7]
    ref = tiny_engine(tiny_llama, prefix_cache=False)
    (expected,) = ref.generate([prompt], GREEDY)
    ref.close()
    eng = tiny_engine(
        tiny_llama,
        num_pages=24,
        tensor_parallel_size=2,
        host_cache_gb=4 * 2 * page_bytes / 2**30,  # 4 pages of 2 ranks: the rest spill to disk
        disk_cache_gb=400 * 2 * page_bytes / 2**30,
        disk_cache_dir=str(tmp_path / "kv"),
        write_policy="write_back",
    )
    try:
        fresh = eng.generate([prompt], GREEDY)[0]
        device_hit = eng.generate([prompt], GREEDY)[0]
        assert (fresh.cached_tokens, device_hit.cached_tokens) == (0, 40)
        seed = 100
        while eng.kv_manager.tree is not None and eng.kv_manager.tree.peek(doc).num_tokens:
            eng.generate([tokens(40, seed)], GREEDY)
            seed += 1
        assert eng.kv_manager.tiers is not None
        eng.kv_manager.tiers.drain()
        before = eng.stats().tiers
        lower = eng.generate([prompt], GREEDY)[0]
        after = eng.stats().tiers
        assert lower.cached_tokens == 40
        hits = {t: after[t]["hits"] - before[t]["hits"] for t in ("host", "disk")}
        assert sum(hits.values()) == 10 and hits["disk"] > 0, hits
        assert_same([expected] * 3, [fresh, device_hit, lower])
        eng.check_integrity()
    finally:
        eng.close()


def test_speculative_decoding_under_tp(tiny_llama: Path) -> None:
    """Drafts verified by a multi-token step on every rank: greedy output as without speculation."""
    loop = tokens(6, 3) * 5  # repetition: the prompt-lookup drafts get accepted
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    ref = tiny_engine(tiny_llama)
    (expected,) = ref.generate([loop], params)
    ref.close()
    eng = tiny_engine(
        tiny_llama,
        tensor_parallel_size=2,
        speculative="ngram",
    )
    try:
        (out,) = eng.generate([loop], params)
        assert out.outputs[0].token_ids == expected.outputs[0].token_ids
        assert eng.stats().spec_verify_steps > 0
    finally:
        eng.close()


def test_int8_weights_under_tp(tiny_llama: Path) -> None:
    """int8 weights shard with their scales. int8 is approximate: each rank quantizes its slice of the
    activations, so TP=2 agrees with TP=1 int8 closely, not bit for bit."""
    one = tiny_engine(tiny_llama, quantization="int8")
    ref = prefill_logits(one, TINY_PROMPTS)
    one.close()
    eng = tiny_engine(
        tiny_llama,
        quantization="int8",
        tensor_parallel_size=2,
    )
    try:
        out = prefill_logits(eng, TINY_PROMPTS)
        assert (out - ref).abs().max() < 0.05 * ref.abs().max()
        assert (out.argmax(-1) == ref.argmax(-1)).all()
    finally:
        eng.close()


def test_gguf_weights_under_tp() -> None:
    """The default model's Q4_1 file at TP=3: blocks shard on block boundaries; exact mode, so TP=1's
    tokens and logits."""
    prompts = [[1, 504, 3458, 282], [1, 33, 28, 216, 34, 28]]
    one = Engine(quantization="gguf", enforce_eager=True, num_pages=32)
    ref = prefill_logits(one, prompts)
    one.close()
    eng = Engine(quantization="gguf", enforce_eager=True, num_pages=32, tensor_parallel_size=3)
    try:
        assert_logits_close(prefill_logits(eng, prompts), ref)
    finally:
        eng.close()


def test_act_order_w4a16_blocks_under_tp(tiny_llama: Path, tmp_path: Path) -> None:
    """A GPTQ act-order file on GGUF blocks at TP=2: a block's 32 columns lie anywhere in the input, so
    the row-parallel splits (o, down) hold theirs as fp32 in the input's order; exact, so TP=1's logits."""
    write_quantized(tiny_llama, tmp_path / "q", "gptq", group=32, symmetric=True, act_order=True)
    one = tiny_engine(tmp_path / "q")
    layer = one.model.layers[0]
    assert isinstance(layer, DecoderLayer) and isinstance(layer.mlp.down_proj, GGUFLinear)
    assert layer.mlp.down_proj.input_order is not None
    ref = prefill_logits(one, TINY_PROMPTS)
    one.close()
    eng = tiny_engine(tmp_path / "q", tensor_parallel_size=2)
    try:
        assert_logits_close(prefill_logits(eng, TINY_PROMPTS), ref)
    finally:
        eng.close()


def test_bad_sizes_are_refused_by_name(tiny_llama: Path) -> None:
    smollm = ModelConfig.from_dict(
        dict(
            model_type="llama",
            vocab_size=49152,
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            max_position_embeddings=8192,
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
        )
    )
    check_tensor_parallel(smollm, 3)
    check_tensor_parallel(smollm, 3, "gguf")  # 192 and 512 input columns a rank: whole blocks of 32
    with pytest.raises(ValueError, match=r"tensor_parallel_size 2 .* 9 query heads .* 3 KV heads .*: 1, 3\)"):
        check_tensor_parallel(smollm, 2)
    with pytest.raises(ValueError, match=r"tensor_parallel_size 9 .* 1536 MLP rows"):
        check_tensor_parallel(smollm, 9)
    with pytest.raises(
        ValueError, match="tensor_parallel_size 10 is more ranks than the model's 9 query heads"
    ):
        check_tensor_parallel(smollm, 10)
    tiny = ModelConfig.from_dir(tiny_llama)  # 4 query heads of 16, 2 KV heads
    check_tensor_parallel(tiny, 4)  # KV heads replicated
    with pytest.raises(ValueError, match="splits the GGUF o_proj's 64 input columns into 16 per rank"):
        check_tensor_parallel(tiny, 4, "gguf")
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(tensor_parallel_size=0)
    # Through the engine: refused before any worker starts.
    with pytest.raises(ValueError, match="tensor_parallel_size 3 does not split the model: .* 4 query heads"):
        Engine(str(tiny_llama), num_pages=16, tensor_parallel_size=3)


# -- the default model: SmolLM2-135M at TP=3 --------------------------------------------------------
PROMPTS = [
    "The capital of France is",
    "1, 2, 3, 4,",
    "def add(a, b):",
    "Once upon a time",
    "Water boils at",
    "The opposite of hot is",
    "Monday, Tuesday,",
    "Hello, my name is",
    "A cat is an",
    "The sun rises in the",
]
SHORT = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=5)


@pytest.fixture(scope="module")
def smollm_ref() -> Iterator[tuple[list[RequestOutput], torch.Tensor, list[list[int]]]]:
    eng = Engine(enforce_eager=True, num_pages=64)
    ids = [eng.tokenize(p) for p in PROMPTS]
    out = eng.generate(ids, SHORT)
    logits = prefill_logits(eng, ids)
    eng.close()
    yield out, logits, ids


def test_default_model_tp3_matches_tp1(smollm_ref: Any) -> None:
    """SmolLM2-135M at TP=3 with compiled steps (the default): greedy token-identical to TP=1 on 10
    prompts, logits within 1e-4. (Eager TP steps: the tiny model's tests above, at TP=2 and 4.)"""
    ref, ref_logits, ids = smollm_ref
    eng = Engine(num_pages=64, tensor_parallel_size=3)
    try:
        assert eng.runner.runner.compiled is not None  # type: ignore[union-attr]
        assert_same(ref, eng.generate(ids, SHORT))
        assert_logits_close(prefill_logits(eng, ids), ref_logits)
    finally:
        eng.close()
