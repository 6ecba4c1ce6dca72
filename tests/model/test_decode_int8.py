"""``decode_arithmetic`` int8 (``model/arithmetic.apply_decode``): every product over GGUF blocks in int8,
decode steps included, on int8 tiles made once at load.

A tiny GGUF of several block types (head_dim 32: the native step's QKV bands are whole heads, and
int8 tiles are 32 rows) runs the same steps in two runners with int8 decode: the torch step (each
GGUFLinear through ``gguf_int8_tiles_linear``) and the native step (the tiles streamed inside
``decode_step``). Both multiply the same tiles by the same quantized rows, so they must agree within
1e-4; and both must differ from the exact runner (the int8 path really ran).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf_files import Dims, write_tiny_gguf

from radixserve.cache.page_pool import KVPool
from radixserve.kernels import cpu_build, gguf_int8
from radixserve.model import arithmetic, native_step
from radixserve.model.attention import get_backend
from radixserve.model.gguf import GGUFLinear
from radixserve.model.loader import load_model
from radixserve.model.runner import ModelRunner, SeqChunk

if not cpu_build.load() or cpu_build.isa() not in native_step.ISAS:
    pytest.skip("no C++ CPU kernels with AVX-512 or AVX2: no native step", allow_module_level=True)

Q = GGMLQuantizationType
DIMS = Dims(hidden=128, inter=96, layers=2, heads=4, kv_heads=2)  # head_dim 32
MIX = {
    "attn_q.weight": Q.Q4_0,
    "attn_k.weight": Q.Q5_0,
    "attn_v.weight": Q.Q8_0,
    "attn_output.weight": Q.Q4_1,
    "ffn_gate.weight": Q.Q4_1,
    "ffn_up.weight": Q.Q5_1,
    "ffn_down.weight": Q.Q4_0,
}


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    file = tmp_path_factory.mktemp("decode_int8") / "mixed.gguf"
    write_tiny_gguf(file, Q.Q4_1, dims=DIMS, types=MIX)
    return file


def _runner(path: Path, native: bool, decode: str) -> ModelRunner:
    model = load_model(path, torch.float32, torch.device("cpu"), "gguf")
    arithmetic.apply(model, "exact", many_rows=8, decode=decode)
    c = model.config
    pool = KVPool(c.num_layers, 200, 4, c.num_kv_heads, c.head_dim, "float32")
    runner = ModelRunner(model, pool, get_backend("cpu"), torch.device("cpu"), native_step=native)
    assert (runner.native is not None) == native
    return runner


def _steps(vocab: int) -> list[list[SeqChunk]]:
    """8 prefills, then decode steps of 1, 3 and 8 rows."""
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (9, 30, 17, 5, 12, 3, 21, 8)]
    pages = [list(range(1 + 20 * i, 21 + 20 * i)) for i in range(len(seqs))]
    steps = [[SeqChunk(s, 0, len(s), p) for s, p in zip(seqs, pages)]]
    for rows in ([2], [0, 5, 4], list(range(8))):
        step = []
        for i in rows:
            seqs[i].append(int(torch.randint(3, vocab, (1,), generator=gen)))
            step.append(SeqChunk(list(seqs[i]), len(seqs[i]) - 1, 1, pages[i]))
        steps.append(step)
    return steps


def _logits(runner: ModelRunner, steps: list[list[SeqChunk]]) -> list[torch.Tensor]:
    return [runner.run(step).logits for step in steps]


@pytest.fixture(autouse=True)
def _vnni() -> None:
    if not gguf_int8.available():
        pytest.skip(f"the VNNI block kernel does not run here: {gguf_int8.why_unavailable()}")


# llama-quantize's own Q4_K_M mix (tests/make_kquant_gguf.py): Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q5_0, IQ4_NL.
KQUANT_FIXTURE = Path(__file__).resolve().parents[1] / "data" / "kquant_tiny.gguf"


@pytest.mark.parametrize("file", ["mixed", "kquant"])
def test_native_int8_step_matches_the_torch_int8_step(mixed_gguf: Path, file: str) -> None:
    path = mixed_gguf if file == "mixed" else KQUANT_FIXTURE
    reference = _runner(path, False, "int8")
    native = _runner(path, True, "int8")
    exact = _runner(path, False, "exact")
    assert native.native is not None
    assert all(k >= gguf_int8.TILES_KIND for k in native.native.kinds)  # every weight streamed as tiles
    steps = _steps(reference.model.config.vocab_size)
    want, got, exact_logits = _logits(reference, steps), _logits(native, steps), _logits(exact, steps)
    for w, g, e in zip(want, got, exact_logits):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
        assert not torch.equal(w, e)  # the int8 arithmetic ran (close to exact, not equal)
        assert float((w - e).norm() / e.norm()) < 0.05


def test_the_lm_head_and_every_decoder_weight_get_tiles(mixed_gguf: Path) -> None:
    model = load_model(mixed_gguf, torch.float32, torch.device("cpu"), "gguf")
    arithmetic.apply(model, "exact", many_rows=8, decode="int8")
    linears = [m for m in model.modules() if isinstance(m, GGUFLinear)]
    assert model.lm_head in linears and model.decode_arithmetic == "int8" and model.arithmetic == "int8"
    assert all(t is not None for m in linears for t in m.tiles)


def test_int8_decode_changes_the_disk_tier_fingerprint(mixed_gguf: Path) -> None:
    """Its K/V differ from exact and from int8 prefill's (decoded tokens too): kept apart on disk."""
    from radixserve.cache.tiers import model_fingerprint

    prints = set()
    for prefill, decode in (("exact", "exact"), ("int8", "exact"), ("exact", "int8")):
        model = load_model(mixed_gguf, torch.float32, torch.device("cpu"), "gguf")
        arithmetic.apply(model, prefill, many_rows=8, decode=decode)
        prints.add(model_fingerprint(model, model.config, torch.float32, 4))
    assert len(prints) == 3


def test_decode_int8_needs_gguf_weights(tiny_llama: Path) -> None:
    model = load_model(tiny_llama, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="decode_arithmetic int8 runs on GGUF blocks"):
        arithmetic.apply(model, "exact", many_rows=8, decode="int8")


def test_without_the_kernel_decode_stays_exact_with_one_warning(
    mixed_gguf: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(gguf_int8.DISABLE_ENV, "0")  # what a CPU without AVX512-VNNI gets
    model = load_model(mixed_gguf, torch.float32, torch.device("cpu"), "gguf")
    with caplog.at_level(logging.INFO, logger="radixserve.model"):
        assert arithmetic.apply(model, "exact", many_rows=8, decode="int8") == "exact"
    lines = [r for r in caplog.records if "decode_arithmetic int8" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING and "VNNI" in lines[0].getMessage()
    assert all(t is None for m in model.modules() if isinstance(m, GGUFLinear) for t in m.tiles)


def test_engine_serves_with_int8_decode_and_refuses_it_with_tensor_parallel(mixed_gguf: Path) -> None:
    from radixserve import Engine, SamplingParams

    engine = Engine(str(mixed_gguf), decode_arithmetic="int8", kv_cache_gb=0.01, enforce_eager=True)
    assert isinstance(engine.runner, ModelRunner) and engine.runner.native is not None
    out = engine.generate(["hello there"], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 6
    with pytest.raises(ValueError, match="tensor_parallel_size > 1 is not built"):
        Engine(str(mixed_gguf), decode_arithmetic="int8", tensor_parallel_size=2)
