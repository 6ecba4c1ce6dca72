"""The native decode step (``model/native_step.py``) against the torch step it replaces.

Two runners over identical pools run the same steps (prefills, a chunked prefill beside decode rows,
decode batches of 1, 3 and 8 rows); the native runner's decode-only steps go through
``radixserve_cpu::decode_step`` and must give the reference's logits within 1e-4, on random tiny
models (GQA, qkv bias, q/k norm, bf16 K/V) and on the real default model's fp32 weights. Mixed steps
run the torch model in both runners, so the native step's K/V must be what the torch step reads next.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf_files import write_tiny_gguf
from hf_quant_files import write_quantized

from radixserve.cache.page_pool import KVPool
from radixserve.kernels import cpu_build
from radixserve.model import compiled, native_step
from radixserve.model.attention import get_backend
from radixserve.model.llama import Attention, DecoderLayer
from radixserve.model.loader import load_model
from radixserve.model.runner import ModelRunner, SeqChunk

if not cpu_build.load() or cpu_build.isa() not in native_step.ISAS:
    pytest.skip("no C++ CPU kernels with AVX-512 or AVX2: no native step", allow_module_level=True)


def _runner(
    model_path: Path,
    native: bool,
    captured: bool = False,
    kv_dtype: str = "float32",
    quantization: str | None = None,
) -> ModelRunner:
    model = load_model(model_path, torch.float32, torch.device("cpu"), quantization)
    c = model.config
    pool = KVPool(c.num_layers, 400, 4, c.num_kv_heads, c.head_dim, kv_dtype)
    runner = ModelRunner(model, pool, get_backend("cpu"), torch.device("cpu"), captured, native_step=native)
    assert (runner.native is not None) == native
    return runner


def _steps(vocab: int) -> list[list[SeqChunk]]:
    """8 prefills, a chunked prefill beside 2 decode rows (a mixed step), then decode steps of 1, 3, 8
    rows and 8 again."""
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (9, 30, 17, 5, 12, 3, 21, 8, 40)]
    pages = [list(range(1 + 40 * i, 41 + 40 * i)) for i in range(len(seqs))]
    steps = [[SeqChunk(seqs[i], 0, len(seqs[i]), pages[i]) for i in range(8)]]
    steps.append([SeqChunk(seqs[8], 0, 20, pages[8])])  # the first chunk of a chunked prefill

    def decode(rows: list[int]) -> list[SeqChunk]:
        out = []
        for i in rows:
            seqs[i].append(int(torch.randint(3, vocab, (1,), generator=gen)))
            out.append(SeqChunk(seqs[i], len(seqs[i]) - 1, 1, pages[i]))
        return out

    # the second chunk beside two decode rows: one mixed step, run by the torch model
    steps.append([SeqChunk(seqs[8], 20, 20, pages[8]), *decode([0, 1])])
    for rows in ([2], [0, 8, 4], list(range(8)), [7, 6, 5, 4, 3, 2, 1, 8]):
        steps.append(decode(rows))
    return steps


def _compare(reference: ModelRunner, native: ModelRunner, steps: list[list[SeqChunk]]) -> int:
    """Runs ``steps`` on both; asserts equal logits; returns how many steps the native call ran."""
    calls = 0
    forward = native.native.forward if native.native is not None else None

    def counted(*args: torch.Tensor) -> torch.Tensor:
        nonlocal calls
        calls += 1
        assert forward is not None
        return forward(*args)

    if native.native is not None:
        native.native.forward = counted  # type: ignore[method-assign,assignment]
    for step in steps:
        want = reference.run(step).logits
        got = native.run([SeqChunk(list(c.token_ids), c.num_computed, c.num_new, c.page_table) for c in step])
        torch.testing.assert_close(got.logits, want, atol=1e-4, rtol=1e-4)
    return calls


@pytest.mark.parametrize(
    ("kind", "kv_dtype"),
    [("llama", "float32"), ("qwen2", "float32"), ("qwen3", "float32"), ("llama", "bfloat16")],
)
def test_native_step_matches_reference(tiny_models: dict[str, Path], kind: str, kv_dtype: str) -> None:
    reference = _runner(tiny_models[kind], False, kv_dtype=kv_dtype)
    native = _runner(tiny_models[kind], True, kv_dtype=kv_dtype)
    steps = _steps(reference.model.config.vocab_size)
    assert _compare(reference, native, steps) == 4  # every decode-only step, not the mixed one


@pytest.mark.parametrize("threads", [1, 3, 4])
def test_native_step_matches_reference_at_other_thread_counts(tiny_llama: Path, threads: int) -> None:
    """The step's attention units are a row's kv heads, split into runs until the rows share the
    threads out evenly (8 rows on 1 or 4 threads: whole rows; 1 or 3 rows on 3 or 4: runs of heads);
    every split gives the reference's logits."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        reference = _runner(tiny_llama, False)
        native = _runner(tiny_llama, True)
        assert _compare(reference, native, _steps(reference.model.config.vocab_size)) == 4
    finally:
        torch.set_num_threads(before)


def test_native_step_streams_fused_projections_whose_gguf_parts_differ_in_type(tmp_path: Path) -> None:
    """llama.cpp's k-quant mixes give attn_v more bits than attn_q/attn_k in some layers (and the
    576-wide rows of the default model fall back to Q5_0 and Q8_0): each part is streamed in its own
    type, where the native step was once off for the whole model."""
    Q = GGMLQuantizationType
    mix = {
        "attn_q.weight": Q.Q4_0,
        "attn_k.weight": Q.Q5_0,
        "attn_v.weight": Q.Q8_0,
        "ffn_gate.weight": Q.Q4_1,
        "ffn_up.weight": Q.Q5_1,
        "ffn_down.weight": Q.Q8_0,
    }
    file = tmp_path / "mixed.gguf"
    write_tiny_gguf(file, Q.Q4_1, types=mix)
    reference = _runner(file, False, quantization="gguf")
    native = _runner(file, True, quantization="gguf")
    layer = native.model.layers[0]
    assert isinstance(layer, DecoderLayer)
    assert len(getattr(layer.self_attn.qkv_proj, "qtypes", [])) == 3  # q, k and v: three types
    assert _compare(reference, native, _steps(reference.model.config.vocab_size)) == 4


@pytest.mark.parametrize("symmetric", [True, False])
def test_native_step_gathers_the_input_of_act_order_blocks(
    tmp_path: Path, tiny_models: dict[str, Path], symmetric: bool
) -> None:
    """A GPTQ act-order file on GGUF blocks (Q4_0, or Q5_0 asymmetric): each weight's columns are its
    input channels sorted by group, and the step gathers each product's input in that order."""
    write_quantized(
        tiny_models["llama"], tmp_path / "q", "gptq", group=32, symmetric=symmetric, act_order=True
    )
    reference = _runner(tmp_path / "q", False)
    native = _runner(tmp_path / "q", True)
    layer = native.model.layers[0]
    assert isinstance(layer, DecoderLayer)
    assert all(
        getattr(m, "input_order", None) is not None for m in (layer.self_attn.o_proj, layer.mlp.down_proj)
    )
    assert _compare(reference, native, _steps(reference.model.config.vocab_size)) == 4


@pytest.mark.skipif(compiled.find_compiler() is None, reason="no C++ compiler for the captured step")
def test_native_step_beside_the_captured_step(tiny_llama: Path) -> None:
    reference = _runner(tiny_llama, False, captured=True)
    native = _runner(tiny_llama, True, captured=True)
    assert _compare(reference, native, _steps(reference.model.config.vocab_size)) == 4
    assert native.compiled is not None and native.compiled.active


@pytest.mark.real_model
def test_native_step_matches_reference_on_real_weights() -> None:
    from radixserve.model.default_model import prepare_default_model

    path = prepare_default_model()
    reference, native = _runner(path, False), _runner(path, True)
    assert _compare(reference, native, _steps(reference.model.config.vocab_size)) == 4


def test_cpu_without_the_isa_falls_back_with_one_log_line(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(cpu_build, "isa", lambda: "DEFAULT")
    with caplog.at_level(logging.INFO, logger="radixserve.model"):
        runner = _runner(tiny_llama, False)
        runner = ModelRunner(runner.model, runner.pool, runner.backend, torch.device("cpu"))
    assert runner.native is None
    lines = [r for r in caplog.records if "native decode step off" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING and "AVX" in lines[0].getMessage()
    step = [SeqChunk([5, 6, 7], 0, 3, [1])]
    assert runner.run(step).logits.shape[0] == 1  # the torch step still serves


def test_env_turns_it_off(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(native_step.ENV, "0")
    runner = _runner(tiny_llama, False)
    assert ModelRunner(runner.model, runner.pool, runner.backend, torch.device("cpu")).native is None


def test_an_int8_model_is_not_covered(tiny_llama: Path) -> None:
    from radixserve.model.quant import Int8Linear

    runner = _runner(tiny_llama, False)
    attn = runner.model.layers[0].self_attn
    assert isinstance(attn, Attention) and isinstance(attn.o_proj, torch.nn.Linear)
    attn.o_proj = Int8Linear.from_linear(attn.o_proj)  # type: ignore[assignment]
    why = native_step.unsupported(runner.model, runner.pool)
    assert why is not None and "Int8Linear" in why


PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a",
    "Here is a list of prime numbers: 2, 3, 5,",
    "The three laws of robotics are",
]


@pytest.mark.real_model
@pytest.mark.parametrize("quantization", [None, "gguf"], ids=["fp32", "gguf-q4_1"])
def test_native_engine_is_greedy_token_identical_to_the_torch_fp32_engine(
    monkeypatch: pytest.MonkeyPatch, quantization: str | None
) -> None:
    from radixserve import Engine, SamplingParams

    greedy = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    options: dict[str, Any] = {
        "page_size": 16,
        "kv_cache_gb": 0.25,
        "enforce_eager": True,
        "prefix_cache": False,
    }
    monkeypatch.setenv(native_step.ENV, "0")
    reference = Engine(**options)
    assert isinstance(reference.runner, ModelRunner) and reference.runner.native is None
    want = [o.outputs[0].token_ids for o in reference.generate(PROMPTS, greedy)]
    del reference
    monkeypatch.delenv(native_step.ENV)
    engine = Engine(quantization=quantization, **options)
    assert isinstance(engine.runner, ModelRunner) and engine.runner.native is not None
    assert [o.outputs[0].token_ids for o in engine.generate(PROMPTS, greedy)] == want
