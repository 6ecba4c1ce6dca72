"""Outlier channels of int8 products over GGUF blocks (model/outliers.py): the channels left out of x's
int8 quantization are multiplied in fp32 beside it, in the torch product (tiles and many-row int8) and
in the native decode step; calibration at load finds a planted massive channel; the disk tier keeps
K/V made with and without them apart; ``RADIXSERVE_INT8_OUTLIERS=0`` turns them off."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf_files import Dims, random_blocks, write_tiny_gguf

from radixserve.cache.page_pool import KVPool
from radixserve.cache.tiers import model_fingerprint
from radixserve.kernels import cpu_build, gguf_int8
from radixserve.model import arithmetic, native_step, outliers
from radixserve.model.attention import get_backend
from radixserve.model.gguf import GGUFLinear, Weight
from radixserve.model.gguf_blocks import FORMATS, dequantize, dequantize_columns
from radixserve.model.llama import DecoderLayer, LlamaForCausalLM
from radixserve.model.loader import load_model
from radixserve.model.runner import ModelRunner, SeqChunk

if not cpu_build.load() or not gguf_int8.available():
    pytest.skip("the VNNI block kernel does not run here", allow_module_level=True)

Q = GGMLQuantizationType
K, N = 160, 72
CHANNELS = torch.tensor([7, 40, 131])
DIMS = Dims(hidden=128, inter=96, layers=2, heads=4, kv_heads=2)  # head_dim 32: the native step's tiles


def _linear() -> GGUFLinear:
    blocks = random_blocks(Q.Q4_1, N, K // 32, seed=3)
    return GGUFLinear([Weight(int(Q.Q4_1), blocks, K)])


def _x(rows: int) -> torch.Tensor:
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(1))
    x[:, 40] *= 80.0  # a massive channel: its block's other 31 values lose most of their bits
    return x


@pytest.mark.parametrize("path", ["tiles", "many rows"])
def test_outlier_channels_are_added_in_fp32_beside_the_int8_product(path: str) -> None:
    g = _linear()
    if path == "tiles":
        g.use_int8_tiles()
    else:
        g.use_many_rows_arithmetic("int8", 2)
    x = _x(5)
    exact = x.double() @ dequantize(g.part(0), int(Q.Q4_1)).double().T
    plain = g(x)
    g.use_outliers(CHANNELS)
    got = g(x)
    # Its own reference: the int8 product of x with those channels zeroed, plus them in float64.
    dense = dequantize(g.part(0), int(Q.Q4_1)).double()
    rest = x.index_fill(1, CHANNELS, 0.0)
    ints = gguf_int8.tiles_linear(rest, gguf_int8.pack(g.part(0), int(Q.Q4_1), K), int(Q.Q4_1), N, None)
    want = ints.double() + x[:, CHANNELS].double() @ dense[:, CHANNELS].T
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-5)
    # and the massive channel no longer costs its block's precision
    assert float((got - exact).abs().max()) < float((plain - exact).abs().max()) / 4


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q6_K])
def test_the_columns_are_the_weights_own_decoded_only_where_held(qtype: Q) -> None:
    k = 512  # two 256-weight super-blocks a row for Q6_K
    blocks = random_blocks(qtype, N, k // FORMATS[int(qtype)].weights, seed=4)
    channels = torch.tensor([3, 40, 41, 300, k - 1])
    want = dequantize(blocks, int(qtype)).index_select(1, channels)
    assert torch.equal(dequantize_columns(blocks, int(qtype), channels), want)


def test_input_order_maps_the_channels_to_the_products_columns() -> None:
    """A GPTQ act-order weight's column j is input channel order[j]: the channels are the input's."""
    blocks = random_blocks(Q.Q4_1, N, K // 32, seed=3)
    order = torch.randperm(K, generator=torch.Generator().manual_seed(2))
    g = GGUFLinear([Weight(int(Q.Q4_1), blocks, K)], input_order=order)
    g.use_int8_tiles()
    g.use_outliers(CHANNELS)
    x = _x(3)
    pair = g.outliers[0]
    assert pair is not None
    assert torch.equal(order.index_select(0, pair[0]), CHANNELS)  # the same input channels, reordered
    exact = x.double() @ dequantize(blocks, int(Q.Q4_1)).double().T.index_select(0, torch.argsort(order))
    assert float((g(x).double() - exact).abs().max()) < 0.05 * float(exact.abs().max())


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    file = tmp_path_factory.mktemp("outliers") / "tiny.gguf"
    write_tiny_gguf(file, Q.Q4_1, dims=DIMS)
    return file


def _layers(model: LlamaForCausalLM) -> list[DecoderLayer]:
    return [m for m in model.layers if isinstance(m, DecoderLayer)]


def _model(path: Path, plant: int | None = None) -> LlamaForCausalLM:
    model = load_model(path, torch.float32, torch.device("cpu"), "gguf")
    if plant is not None:  # a massive channel after the first norm, as real Llamas have
        with torch.no_grad():
            _layers(model)[0].input_layernorm.weight[plant] *= 200.0
    return model


def test_calibration_finds_a_planted_massive_channel(gguf_file: Path) -> None:
    model = _model(gguf_file, plant=77)
    arithmetic.apply(model, "exact", many_rows=8, decode="int8")
    assert model.outlier_channels == outliers.CHANNELS
    qkv = _layers(model)[0].self_attn.qkv_proj
    assert isinstance(qkv, GGUFLinear) and qkv.outliers[0] is not None
    channels, columns = qkv.outliers[0]
    assert 77 in channels.tolist() and channels.numel() == outliers.CHANNELS
    assert columns.shape == (outliers.CHANNELS, qkv.out_features)
    for layer in _layers(model):  # only the norm-fed products
        kinds = (
            layer.self_attn.qkv_proj,
            layer.mlp.gate_up_proj,
            layer.self_attn.o_proj,
            layer.mlp.down_proj,
        )
        assert all(isinstance(m, GGUFLinear) for m in kinds)
        assert [m.outliers[0] is not None for m in kinds if isinstance(m, GGUFLinear)] == [
            True,
            True,
            False,
            False,
        ]
    assert isinstance(model.lm_head, GGUFLinear) and model.lm_head.outliers[0] is not None


def test_off_switch_and_the_disk_tier_fingerprint(gguf_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    on = _model(gguf_file)
    arithmetic.apply(on, "exact", many_rows=8, decode="int8")
    monkeypatch.setenv(outliers.ENV, "0")
    off = _model(gguf_file)
    arithmetic.apply(off, "exact", many_rows=8, decode="int8")
    assert off.outlier_channels == 0
    assert all(p is None for m in off.modules() if isinstance(m, GGUFLinear) for p in m.outliers)
    prints = {model_fingerprint(m, m.config, torch.float32, 4) for m in (on, off)}
    assert len(prints) == 2


def _runner(model: LlamaForCausalLM, native: bool) -> ModelRunner:
    c = model.config
    pool = KVPool(c.num_layers, 64, 4, c.num_kv_heads, c.head_dim, "float32")
    return ModelRunner(model, pool, get_backend("cpu"), torch.device("cpu"), native_step=native)


@pytest.mark.skipif(cpu_build.isa() not in native_step.ISAS, reason="no native step on this build")
def test_the_native_step_adds_the_outlier_channels(gguf_file: Path) -> None:
    """The native step equals the torch int8 step with outliers; without its outlier tensors it would
    not (so the step really takes them)."""
    runners = []
    for in_native in (False, True):
        model = _model(gguf_file, plant=77)
        arithmetic.apply(model, "exact", many_rows=8, decode="int8")
        runners.append(_runner(model, in_native))
    torch_step, native = runners
    assert native.native is not None and any(t.numel() for t in native.native.outliers)
    prompts = [[5, 9, 11, 3, 17, 40], [8, 2, 30, 30, 1]]
    tables = [[1, 2, 3], [4, 5, 6]]
    for r in runners:
        r.run([SeqChunk(p, 0, len(p), t) for p, t in zip(prompts, tables)])
    step = [SeqChunk(p + [12], len(p), 1, t) for p, t in zip(prompts, tables)]
    want = torch_step.run(step).logits
    torch.testing.assert_close(native.run(step).logits, want, atol=1e-4, rtol=1e-4)
    native.native.outliers = [torch.empty(0)] * len(native.native.outliers)
    step = [SeqChunk(p + [12, 13], len(p) + 1, 1, t) for p, t in zip(prompts, tables)]
    without = native.run(step).logits
    assert float((without - torch_step.run(step).logits).abs().max()) > 1e-3


def test_tensor_parallel_shards_keep_their_outlier_channels() -> None:
    """A rank's rows (column-parallel) keep their columns of the outliers' weight; a rank's input columns
    (row-parallel) keep the channels inside them, renumbered: the shards' products are the whole one's."""
    from radixserve.model.sharding import keep_cols, keep_rows

    def made() -> GGUFLinear:
        g = _linear()
        g.use_many_rows_arithmetic("int8", 2)
        g.use_outliers(CHANNELS)
        return g

    x = _x(5)
    whole = made()(x)
    rows = torch.arange(8, 40)
    top = made()
    keep_rows(top, rows, pad_to=40)  # padded with zero rows, as a rank short of rows is
    torch.testing.assert_close(top(x)[:, :32], whole[:, 8:40], atol=0.0, rtol=0.0)
    assert torch.equal(top(x)[:, 32:], torch.zeros(5, 8))
    parts = []
    for start, end in ((0, 64), (64, K)):  # cut at whole blocks: every block quantizes as in the whole
        half = made()
        keep_cols(half, start, end, keep_bias=start == 0)
        pair = half.outliers[0]
        channels = CHANNELS
        assert pair is not None and torch.equal(
            pair[0] + start, channels[(channels >= start) & (channels < end)]
        )
        parts.append(half(x[:, start:end]))
    torch.testing.assert_close(parts[0] + parts[1], whole, atol=1e-4, rtol=1e-5)
