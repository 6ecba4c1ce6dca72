"""A GGUF file from llama.cpp's own llama-quantize (``tests/data/kquant_tiny.gguf``, made by
``tests/make_kquant_gguf.py``: Q4_K_M with overrides, so k-quants, their fallbacks and IQ4_NL): its
blocks decode as gguf's reference does, bit for bit (in torch and in the C++ kernels), and the engine
serves it greedy token-identical to the fp32 model of its dequantization."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize as reference_dequantize
from gguf_files import KQUANT_DIMS, dequantized_weights, write_fp32_folder

from radixserve import Engine, SamplingParams
from radixserve.kernels import cpu_build, gguf_int8
from radixserve.model import gguf_blocks, gguf_load, native_step

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "kquant_tiny.gguf"
TYPES = {"Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q2_K", "Q3_K", "IQ4_NL"}
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
PROMPTS = [[5, 17, 42, 7], [100, 3], [250, 251, 252, 9, 11, 13], [64], list(range(20, 60))]


@pytest.fixture(autouse=True)
def _cache_in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gguf_load, "models_cache", lambda: tmp_path / "cache")


def _quantized() -> list[tuple[str, int, np.ndarray]]:
    return [
        (t.name, int(t.tensor_type), np.asarray(t.data))
        for t in GGUFReader(FIXTURE).tensors
        if gguf_blocks.is_blocks(int(t.tensor_type))
    ]


def test_the_fixture_holds_llama_quantizes_block_types() -> None:
    types = {t.tensor_type.name for t in GGUFReader(FIXTURE).tensors}
    assert types >= TYPES, f"llama-quantize wrote {sorted(types)}"
    assert FIXTURE.stat().st_size < 500_000


def test_llama_cpp_blocks_decode_as_the_reference_bit_for_bit() -> None:
    for name, qtype, data in _quantized():
        want = reference_dequantize(data, GGMLQuantizationType(qtype)).astype(np.float32)
        got = gguf_blocks.dequantize(torch.from_numpy(data.copy()), qtype).numpy()
        assert np.array_equal(got.view(np.uint32), want.reshape(got.shape).view(np.uint32)), name


@pytest.mark.skipif(not cpu_build.load(), reason="no C++ CPU kernels here (they need a compiler)")
def test_the_kernels_decode_llama_cpp_blocks_as_the_reference() -> None:
    """x = the identity: each output is one decoded weight (few-rows and tile paths)."""
    for name, qtype, data in _quantized():
        blocks = torch.from_numpy(data.copy())[:16]
        k = blocks.shape[1] // gguf_blocks.FORMATS[qtype].bytes * gguf_blocks.FORMATS[qtype].weights
        want = gguf_blocks.dequantize(blocks, qtype).T.contiguous()
        eye = torch.eye(k)
        for rows in (slice(0, 3), slice(0, k)):
            got = torch.ops.radixserve_cpu.gguf_linear(eye[rows], blocks, qtype, k, None)
            assert torch.equal(got, want[rows]), name


def test_the_integer_form_of_llama_cpp_blocks_is_the_reference_bit_for_bit() -> None:
    """``chunk_integers`` (what the int8 kernel multiplies): scale * value + minimum per chunk of 32 is
    gguf's dequantization, for every tensor of a type the int8 kernel takes."""
    seen = set()
    for name, qtype, data in _quantized():
        if qtype not in gguf_blocks.CHUNK_AFFINE:
            continue
        seen.add(gguf_blocks.TYPE_NAMES[qtype])
        got = gguf_blocks.affine_weights(*gguf_blocks.chunk_integers(torch.from_numpy(data.copy()), qtype))
        assert torch.equal(got, gguf_blocks.dequantize(torch.from_numpy(data.copy()), qtype)), name
    assert seen >= {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q5_0", "IQ4_NL"}


@pytest.mark.skipif(not cpu_build.load(), reason="no C++ CPU kernels here (they need a compiler)")
def test_the_int8_kernel_multiplies_llama_cpp_blocks_as_its_reference() -> None:
    """The int8 block kernel on llama-quantize's own k-quant, Q5_0 and IQ4_NL tensors: within fp32
    summation of its reference terms (kernels/gguf_int8.py), and within 2% of the exact product."""
    seen = set()
    for name, qtype, data in _quantized():
        if qtype not in gguf_int8.TYPES:
            continue
        seen.add(gguf_blocks.TYPE_NAMES[qtype])
        blocks = torch.from_numpy(data.copy())
        k = blocks.shape[1] // gguf_blocks.FORMATS[qtype].bytes * gguf_blocks.FORMATS[qtype].weights
        x = torch.randn(40, k, generator=torch.Generator().manual_seed(qtype))
        got = torch.ops.radixserve_cpu.gguf_int8_linear(x, blocks, qtype, k, None)
        terms = gguf_int8.reference_terms(x, *gguf_blocks.chunk_integers(blocks, qtype))
        err = (got.double() - terms.sum(-1)).abs()
        assert bool((err <= terms.shape[-1] * 2.0**-24 * terms.abs().sum(-1)).all()), name
        exact = torch.ops.radixserve_cpu.gguf_linear(x, blocks, qtype, k, None)
        assert float((got - exact).norm() / exact.norm()) < 0.02, name
    assert seen >= {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q5_0", "IQ4_NL"}


def test_the_llama_quantize_file_serves_token_identical_to_its_fp32_dequantization(tmp_path: Path) -> None:
    folder = write_fp32_folder(tmp_path / "fp32", dequantized_weights(FIXTURE, KQUANT_DIMS), KQUANT_DIMS)
    options = {"num_pages": 128, "page_size": 4}
    fp32 = Engine(model=str(folder), enforce_eager=True, **options)
    served = Engine(model=str(FIXTURE), enforce_eager=True, **options)
    assert served.model.quantization == "gguf"
    if cpu_build.load() and cpu_build.isa() in native_step.ISAS:  # decode runs in the new block kernels
        assert getattr(served.runner, "native", None) is not None
    a = [o.outputs[0].token_ids for o in fp32.generate(PROMPTS, GREEDY)]
    b = [o.outputs[0].token_ids for o in served.generate(PROMPTS, GREEDY)]
    assert a == b
