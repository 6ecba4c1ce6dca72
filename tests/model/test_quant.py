"""int8 weights (``--quantization int8``, model/quant.py): the kernel's arithmetic, the cached int8
copy, the compiled step against the eager one, the disk tier's fingerprint, and the real model served
and scored against fp32 (the agreement floor catches a broken scale)."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file
from server_util import running_server

from benchmarks.lib.accuracy import TEXTS, agreement, score
from radixserve import Engine, SamplingParams
from radixserve.cache.tiers import model_fingerprint
from radixserve.config import EngineConfig
from radixserve.model import compiled, quant
from radixserve.model.llama import DecoderLayer, LlamaForCausalLM
from radixserve.model.loader import load_model
from radixserve.model.quant import Int8Linear, int8_linear, quantize_rows, weight_bytes

CPU = torch.device("cpu")
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def _layer(model: LlamaForCausalLM) -> DecoderLayer:
    layer = model.layers[0]
    assert isinstance(layer, DecoderLayer)
    return layer


def test_int8_linear_is_the_product_of_the_rounded_factors() -> None:
    gen = torch.Generator().manual_seed(0)
    w, x, bias = torch.randn(96, 64, generator=gen), torch.randn(5, 64, generator=gen), torch.randn(96)
    w[3] = 0  # an all-zero channel
    qw, sw = quantize_rows(w)
    qx, sx = quantize_rows(x)
    assert qw.dtype == torch.int8 and qw.abs().max() == 127 and sw.shape == (96, 1)
    assert torch.equal(qw[3], torch.zeros(64, dtype=torch.int8))
    got = int8_linear(x, qw, sw.squeeze(1), bias)
    want = (qx.double() * sx) @ (qw.double() * sw).T + bias
    torch.testing.assert_close(got, want.float(), atol=1e-4, rtol=1e-5)
    exact = x @ w.T + bias
    err = ((got - exact).norm() / exact.norm()).item()
    assert 0 < err < 0.02  # the rounding's error, not a wrong scale
    # Per-row activation scales: a row's result does not depend on the other rows of the step.
    alone = int8_linear(x[:1], qw, sw.squeeze(1), bias)
    assert torch.equal(alone[0], int8_linear(torch.cat([x[:1], 100 * x[1:]]), qw, sw.squeeze(1), bias)[0])


def _cache_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Int8 copies under ``tmp_path``, not the user's cache (which also holds the built C++ kernels)."""
    real = quant.cache_dir_for
    monkeypatch.setattr(quant, "cache_dir_for", lambda path: tmp_path / "cache" / real(path).name)


def test_int8_copy_is_cached_reused_and_rebuilt_when_its_source_changes(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _cache_in(tmp_path, monkeypatch)
    src = tmp_path / "model"
    shutil.copytree(tiny_llama, src)
    first = load_model(src, torch.float32, CPU, "int8")
    down = _layer(first).mlp.down_proj
    assert isinstance(down, Int8Linear) and first.quantization == "int8"
    assert not any(isinstance(m, torch.nn.Linear) for m in first.layers.modules())  # no fp32 copy kept
    (cached,) = [p for p in (tmp_path / "cache").glob("*-int8-*") if p.is_dir()]
    marker = (cached / quant.MARKER_NAME).stat().st_mtime_ns

    def no_quantizing(linear: torch.nn.Linear) -> Int8Linear:
        raise AssertionError("quantized again although the cached copy is current")

    with monkeypatch.context() as m:
        m.setattr(Int8Linear, "from_linear", no_quantizing)
        second = load_model(src, torch.float32, CPU, "int8")
    assert (cached / quant.MARKER_NAME).stat().st_mtime_ns == marker
    second_down = _layer(second).mlp.down_proj
    assert isinstance(second_down, Int8Linear)
    assert torch.equal(second_down.qweight, down.qweight) and torch.equal(second_down.scale, down.scale)
    torch.testing.assert_close(
        _layer(second).input_layernorm.weight, _layer(first).input_layernorm.weight, rtol=0, atol=0
    )

    weights = load_file(str(src / "model.safetensors"))  # a changed checkpoint: every weight doubled
    save_file({k: 2 * v for k, v in weights.items()}, str(src / "model.safetensors"), {"format": "pt"})
    third = load_model(src, torch.float32, CPU, "int8")
    third_down = _layer(third).mlp.down_proj
    assert isinstance(third_down, Int8Linear)
    assert (cached / quant.MARKER_NAME).stat().st_mtime_ns != marker
    torch.testing.assert_close(third_down.scale, 2 * down.scale)
    assert torch.equal(third_down.qweight, down.qweight)


@pytest.mark.parametrize("arch", ["llama", "llama-tied"])
def test_int8_quantizes_the_lm_head_and_keeps_the_embedding_fp32(
    tiny_models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, arch: str
) -> None:
    """The head's logits are int8_linear of the fp32 head's weight (rounded per channel), close to the
    fp32 logits; the embedding (tied or not) keeps its fp32 values for lookups."""
    _cache_in(tmp_path, monkeypatch)
    fp32 = load_model(tiny_models[arch], torch.float32, CPU)
    int8 = load_model(tiny_models[arch], torch.float32, CPU, "int8")
    head = int8.lm_head
    assert isinstance(head, Int8Linear)
    assert int8.embed_tokens.weight.dtype == torch.float32
    assert torch.equal(int8.embed_tokens.weight, fp32.embed_tokens.weight)
    qw, sw = quantize_rows(fp32.lm_head.weight.detach())
    assert torch.equal(head.qweight, qw) and torch.equal(head.scale, sw.squeeze(1))
    hidden = torch.randn(5, fp32.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want = int8.compute_logits(hidden), fp32.compute_logits(hidden)
    torch.testing.assert_close(got, int8_linear(hidden, qw, sw.squeeze(1), None), rtol=1e-6, atol=1e-6)
    assert 0 < float((got - want).abs().max() / want.abs().max()) < 0.03


def test_int8_needs_cpu_and_float32(tiny_llama: Path) -> None:
    with pytest.raises(ValueError, match="runs on CPU in float32"):
        load_model(tiny_llama, torch.bfloat16, CPU, "int8")
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(quantization="int4")


def test_disk_tier_pages_never_cross_between_fp32_and_int8(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _cache_in(tmp_path, monkeypatch)
    fp32 = load_model(tiny_llama, torch.float32, CPU)
    int8 = load_model(tiny_llama, torch.float32, CPU, "int8")
    key = lambda m: model_fingerprint(m, m.config, torch.float32, 4)  # noqa: E731
    assert key(fp32) == key(load_model(tiny_llama, torch.float32, CPU)) != key(int8)

    prompt = list(range(10, 50))
    options = dict(page_size=4, num_pages=40, disk_cache_dir=str(tmp_path / "kv"), enforce_eager=True)

    def cached_tokens(quantization: str | None) -> int:
        eng = Engine(str(tiny_llama), quantization=quantization, **options)
        out = eng.generate([prompt], GREEDY)[0]
        tiers = eng.kv_manager.tiers
        assert tiers is not None
        tiers.drain()
        eng.close()
        return out.cached_tokens

    assert cached_tokens(None) == 0
    assert cached_tokens(None) > 0  # a restart of the same model finds its pages on disk
    assert cached_tokens("int8") == 0  # int8 does not read fp32's pages
    assert cached_tokens("int8") > 0


@pytest.mark.skipif(compiled.find_compiler() is None, reason="no C++ compiler: no captured step")
def test_int8_captured_step_gives_the_eager_tokens(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _cache_in(tmp_path, monkeypatch)
    prompts = [list(range(5, 30)), [7, 8, 9], list(range(40, 52))]
    outs = {}
    for eager in (True, False):
        eng = Engine(str(tiny_llama), page_size=4, num_pages=64, quantization="int8", enforce_eager=eager)
        assert eager or (eng.runner.compiled is not None and eng.runner.compiled.active)
        outs[eager] = [
            o.token_ids for o in eng.generate(prompts, SamplingParams(max_tokens=12, temperature=0))
        ]
        assert eager or (eng.runner.compiled is not None and eng.runner.compiled.active)  # never fell back
        eng.close()
    assert outs[False] == outs[True]


@pytest.mark.real_model
def test_int8_serves_the_default_model_and_agrees_with_fp32() -> None:
    scores = {}
    for quantization in (None, "int8"):
        config = EngineConfig(quantization=quantization, kv_cache_gb=0.25, enforce_eager=True)
        with running_server(config, model_name="default") as url:
            scores[quantization] = score(url, "default", TEXTS)
            if quantization == "int8":
                body = {
                    "model": "default",
                    "prompt": "The capital of France is",
                    "max_tokens": 8,
                    "temperature": 0,
                }
                resp = httpx.post(f"{url}/v1/completions", json=body, timeout=60, trust_env=False)
                assert resp.status_code == 200 and resp.json()["choices"][0]["text"].strip()
    acc = agreement(scores[None], scores["int8"])
    print(acc)
    assert acc.tokens > 400
    assert acc.top1_agreement >= 0.88, acc  # measured 0.90; a wrong scale or layout falls far below
    assert 0 < acc.mean_abs_dloglik < 0.35, acc  # measured 0.23 nats


@pytest.mark.real_model
def test_int8_holds_a_quarter_of_the_linear_and_head_weight_bytes() -> None:
    from radixserve.model.loader import resolve_model_path

    path = resolve_model_path(None)
    fp32, int8 = (weight_bytes(load_model(path, torch.float32, CPU, q)) for q in (None, "int8"))
    ratio = fp32["linear_bytes"] / int8["linear_bytes"]
    assert 3.9 < ratio <= 4, (fp32, int8)  # int8 plus one fp32 scale per output channel
    # The int8 LM head is a second copy of the tied embedding: more held, a quarter of it read per step.
    head = load_model(path, torch.float32, CPU).lm_head.weight.numel()
    assert int8["total_bytes"] < fp32["total_bytes"] - 0.7 * fp32["linear_bytes"] + 1.01 * head
    assert 3.8 < fp32["step_bytes"] / int8["step_bytes"] <= 4, (fp32, int8)
