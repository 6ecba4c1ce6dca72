"""HF quantized checkpoints (model/hf_quant.py, model/hf_quant_load.py): llm-compressor's own files
(tests/data/hf_quant) decode to the tool's own dequantization bit for bit; AWQ, GPTQ (act-order, v1
and v2 zero points) and compressed-tensors files from the spec writer (tests/hf_quant_files.py) are
token-identical to the fp32 folder of their dequantization; W8A8 runs int8 x int8 arithmetic that
equals its torch reference and stays within the activation rounding's bound of the dequantized
product; and what is not supported fails with an error that names it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_quant_files import act_order_groups, pack, quantize, write_dequantized, write_quantized
from safetensors.torch import load_file, save_file
from tokenizer_util import make_tokenizer

from radixserve import Engine, SamplingParams
from radixserve.model import hf_quant
from radixserve.model.gguf import GGUFLinear, Weight
from radixserve.model.gguf_blocks import F32, Q4_0, Q4_1, Q5_0, dequantize
from radixserve.model.layers import Linear
from radixserve.model.llama import DecoderLayer, LlamaForCausalLM, target_of
from radixserve.model.loader import load_model
from radixserve.model.quant import Int8Linear, int8_linear, quantize_rows
from radixserve.model.sharding import keep_cols

CPU = torch.device("cpu")
DATA = Path(__file__).resolve().parent.parent / "data" / "hf_quant"
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
PROMPTS = [[5, 17, 42, 7], [100, 3], [250, 251, 252, 9, 11, 13], [64]]
OPTIONS: dict[str, Any] = {"enforce_eager": True, "num_pages": 64, "page_size": 4}
# name: (writer method, options) of the spec-written fixtures
SPEC = {
    "awq": ("awq", {}),  # on Q5_0 blocks
    "gptq-sym": ("gptq", {"symmetric": True}),  # on Q4_0 blocks
    "ct-w4a16-sym": ("pack-quantized", {"symmetric": True}),  # bf16 scales, on Q4_0 blocks
    "gptq-sym-actorder-v1": ("gptq", {"symmetric": True, "act_order": True}),
    "gptq-asym-actorder-v1": ("gptq", {"act_order": True}),
    "gptq-asym-v2": ("gptq", {"v2": True}),  # on Q5_0 blocks
    "ct-w4a16-asym-g_idx": ("pack-quantized", {"act_order": True}),
}


def _weight(model: LlamaForCausalLM, hf_name: str) -> torch.Tensor:
    """The fp32 weight ``model`` multiplies by for the HF weight ``hf_name`` (an int8 one dequantized)."""
    name, fused = target_of(hf_name)
    module = model.get_submodule(name.removesuffix(".weight"))
    if isinstance(module, Int8Linear):
        w = module.qweight.float() * module.scale[:, None]
    elif isinstance(module, GGUFLinear):
        w = torch.cat([dequantize(module.part(i), q) for i, q in enumerate(module.qtypes)])
        if module.input_order is not None:  # its column j is input channel input_order[j]
            w = w.index_select(1, torch.argsort(module.input_order))
    else:
        assert isinstance(module, Linear)
        w = module.weight
    return w if fused is None else model._fused_slice(w, *fused)


def _layer(model: LlamaForCausalLM) -> DecoderLayer:
    layer = model.layers[0]
    assert isinstance(layer, DecoderLayer)
    return layer


def _tool_folder(tmp_path: Path, scheme: str) -> Path:
    folder = tmp_path / scheme
    shutil.copytree(DATA / scheme, folder)
    return folder


def _tool_dequantized(tmp_path: Path, folder: Path) -> Path:
    """The fp32 folder of a tool fixture's own dequantization: its unquantized tensors (embedding,
    norms, LM head) and the tool's dequantized Linears."""
    plain = {n: t for n, t in load_file(str(folder / "model.safetensors")).items() if "proj" not in n}
    src = tmp_path / "plain"
    src.mkdir()
    save_file(plain, str(src / "model.safetensors"))
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["quantization_config"]
    (src / "config.json").write_text(json.dumps(cfg))
    make_tokenizer().save_pretrained(src)
    return write_dequantized(src, tmp_path / "fp32", load_file(str(folder / "dequantized.safetensors.ref")))


@pytest.mark.parametrize("scheme", ["w4a16-sym", "w4a16-asym-actorder", "w8a8"])
def test_llm_compressor_files_decode_as_the_tool_decodes_them(tmp_path: Path, scheme: str) -> None:
    model = load_model(_tool_folder(tmp_path, scheme), torch.float32, CPU)
    ref = load_file(str(DATA / scheme / "dequantized.safetensors.ref"))
    assert len(ref) == 14  # 2 layers x 7 Linears; the LM head is in the tool's ignore list
    for name, want in ref.items():
        assert torch.equal(_weight(model, name), want), name
    layer = _layer(model)
    # The tool wrote an fp32 model's scales as fp32, which no GGUF block holds: dense, not Q4_0.
    kind = Int8Linear if scheme == "w8a8" else Linear
    assert isinstance(layer.self_attn.qkv_proj, kind) and isinstance(layer.mlp.down_proj, kind)
    assert type(model.lm_head) is Linear
    assert model.checkpoint_quantization is not None and model.checkpoint_quantization.startswith(
        "compressed-tensors"
    )


@pytest.mark.parametrize("case", sorted(SPEC))
def test_w4a16_is_token_identical_to_its_dequantization(
    tmp_path: Path, tiny_models: dict[str, Path], case: str
) -> None:
    method, options = SPEC[case]
    src = tiny_models["llama"]
    dense = write_quantized(src, tmp_path / "q", method, group=32, **options)
    exact = write_dequantized(src, tmp_path / "fp32", dense)
    quantized = Engine(model=str(tmp_path / "q"), **OPTIONS)
    reference = Engine(model=str(exact), **OPTIONS)
    for name, want in dense.items():
        assert torch.equal(_weight(quantized.model, name), want), name
    # fp16/bf16 scales: GGUF blocks (Q4_0 symmetric; asymmetric Q5_0 for odd zero points times
    # full-mantissa scales, Q4_1 where a part's every -z s is an fp16 value, as bf16 scales' short
    # mantissa often makes it); act-order groups sorted, the product's input reordered to match.
    layer = _layer(quantized.model)
    for lin in (layer.self_attn.qkv_proj, layer.mlp.down_proj):
        assert isinstance(lin, GGUFLinear)
        types = set(lin.qtypes)
        assert types == {Q4_0} if "-sym" in case else (Q5_0 in types and types <= {Q4_1, Q5_0}), types
        assert (lin.input_order is not None) == options.get("act_order", False)
    a = [o.outputs[0].token_ids for o in reference.generate(PROMPTS, GREEDY)]
    b = [o.outputs[0].token_ids for o in quantized.generate(PROMPTS, GREEDY)]
    assert a == b


def test_llm_compressor_w4a16_is_token_identical_to_its_dequantization(tmp_path: Path) -> None:
    folder = _tool_folder(tmp_path, "w4a16-asym-actorder")
    exact = _tool_dequantized(tmp_path, folder)
    a = [o.outputs[0].token_ids for o in Engine(model=str(exact), **OPTIONS).generate(PROMPTS, GREEDY)]
    b = [o.outputs[0].token_ids for o in Engine(model=str(folder), **OPTIONS).generate(PROMPTS, GREEDY)]
    assert a == b


def test_packing_layouts_decode_to_the_codes_written() -> None:
    word = torch.tensor([[0x76543210]], dtype=torch.int32)  # nibble i holds i
    assert hf_quant.unpack_rows(word).tolist() == [[0, 1, 2, 3, 4, 5, 6, 7]]
    top = torch.tensor([[0xF0123456 - 2**32]], dtype=torch.int32)  # the sign bit set
    assert hf_quant.unpack_rows(top).tolist() == [[6, 5, 4, 3, 2, 1, 0, 15]]
    # AWQ: column j of a word is nibble AWQ_NIBBLE[j] (its pack order 0 2 4 6 1 3 5 7, inverted).
    codes = torch.arange(8).reshape(1, 8)
    awq = pack(codes, (0, 2, 4, 6, 1, 3, 5, 7))
    assert hf_quant.unpack_rows(awq).tolist() == [[0, 2, 4, 6, 1, 3, 5, 7]]
    scheme = hf_quant.Scheme("awq", hf_quant.W4A16, group_size=8, symmetric=False)
    tensors = {"qweight": awq, "qzeros": pack(torch.full((1, 8), 3)), "scales": torch.ones(1, 8).half()}
    assert hf_quant.decode_awq(tensors, scheme, "x").dense().tolist() == [[j - 3.0] for j in range(8)]


def test_w8a8_runs_int8_arithmetic_within_the_rounding_bound(tmp_path: Path) -> None:
    model = load_model(_tool_folder(tmp_path, "w8a8"), torch.float32, CPU)
    assert model.quantization == "int8"
    lin = _layer(model).mlp.gate_up_proj
    assert isinstance(lin, Int8Linear)
    assert int(lin.qweight.min()) == -128  # llm-compressor's range; the kernel must take it
    x = torch.randn(11, 64, generator=torch.Generator().manual_seed(0))
    for rows in (1, 3, 8, 11):  # the few-row kernel and _int_mm
        got = lin(x[:rows])
        # Its own reference: the same per-token quantization and int32 sums, in torch.
        want = int8_linear(x[:rows], lin.qweight, lin.scale, None)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    # The dequantized product differs only by the activations' rounding: |x - q s| <= s / 2 per
    # element, so each output is within s_x / 2 * sum_k |W[n, k]| (plus float rounding).
    dense = lin.qweight.float() * lin.scale[:, None]
    exact = x @ dense.t()
    _, x_scale = quantize_rows(x)
    bound = x_scale / 2 * dense.abs().sum(dim=1) + 1e-5
    err = (lin(x) - exact).abs()
    assert bool((err <= bound).all()) and float(err.max()) > 0


def test_w8a8_model_agrees_with_its_dequantization(tmp_path: Path) -> None:
    folder = _tool_folder(tmp_path, "w8a8")
    exact = _tool_dequantized(tmp_path, folder)
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    prompts = [list(range(3, 60)), list(range(100, 160, 2))]
    ref = Engine(model=str(exact), **OPTIONS).generate(prompts, params)
    got = Engine(model=str(folder), **OPTIONS).generate(prompts, params)
    deltas = [
        abs(a.logprob - b.logprob)
        for r, g in zip(ref, got, strict=True)
        for a, b in zip((r.prompt_logprobs or [])[1:], (g.prompt_logprobs or [])[1:], strict=True)
        if a is not None and b is not None
    ]
    assert len(deltas) == 56 + 29
    # Measured on this fixture: mean ~0.01, max ~0.05 nats; the bound leaves room for other CPUs.
    assert 0 < sum(deltas) / len(deltas) < 0.05 and max(deltas) < 0.25


def _with_config(tmp_path: Path, scheme: str, edit: dict[str, Any]) -> Path:
    folder = _tool_folder(tmp_path, scheme)
    cfg = json.loads((folder / "config.json").read_text())
    qcfg = cfg["quantization_config"]
    for path, value in edit.items():
        target = qcfg
        *parents, last = path.split(".")
        for p in parents:
            target = target[p]
        target[last] = value
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


@pytest.mark.parametrize(
    ("scheme", "edit", "message"),
    [
        ("w4a16-sym", {"config_groups.group_0.weights.num_bits": 3}, "weights.num_bits 3"),
        ("w4a16-sym", {"format": "marlin-24", "config_groups.group_0.format": "marlin-24"}, "format"),
        ("w8a8", {"config_groups.group_0.input_activations.dynamic": False}, "input_activations.dynamic"),
        ("w8a8", {"config_groups.group_0.input_activations.strategy": "tensor"}, "strategy 'tensor'"),
        ("w4a16-sym", {"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes'"),
    ],
)
def test_unsupported_configs_are_refused_by_name(
    tmp_path: Path, scheme: str, edit: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        load_model(_with_config(tmp_path, scheme, edit), torch.float32, CPU)


def test_gptq_and_awq_configs_are_checked(tmp_path: Path) -> None:
    base = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}
    assert hf_quant.parse_scheme(base).zero_offset == 1  # v1 unless it says otherwise
    assert hf_quant.parse_scheme(base | {"checkpoint_format": "gptq_v2"}).zero_offset == 0
    with pytest.raises(ValueError, match="bits 8"):
        hf_quant.parse_scheme(base | {"bits": 8})
    with pytest.raises(ValueError, match="checkpoint_format 'marlin'"):
        hf_quant.parse_scheme(base | {"checkpoint_format": "marlin"})
    with pytest.raises(ValueError, match="version 'gemv'"):
        hf_quant.parse_scheme({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"})


def test_damaged_files_and_int8_on_top_fail_clearly(tmp_path: Path, tiny_models: dict[str, Path]) -> None:
    folder = tmp_path / "q"
    write_quantized(tiny_models["llama"], folder, "gptq", group=32, act_order=True)
    with pytest.raises(ValueError, match="already|does not apply"):
        load_model(folder, torch.float32, CPU, quantization="int8")
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["model.layers.1.mlp.down_proj.qzeros"]
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.down_proj.*qzeros"):
        load_model(folder, torch.float32, CPU)
    tensors["model.layers.1.mlp.down_proj.qzeros"] = torch.zeros(3, 8, dtype=torch.int32)
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=r"down_proj\.(qzeros|scales)"):
        load_model(folder, torch.float32, CPU)


def test_int4_weights_become_gguf_blocks_only_where_the_blocks_hold_them_exactly() -> None:
    torch.manual_seed(0)
    w = torch.randn(64, 96)
    groups = torch.arange(96) // 32

    def int4(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, g: torch.Tensor) -> Any:
        return hf_quant.Int4Weight(codes.to(torch.int16), zeros.to(torch.int16), scales.float(), g)

    codes, zeros, scales, dense = quantize(w, groups, symmetric=True)
    held = int4(codes, zeros, scales, groups).blocks()
    assert held is not None and held[0] == Q4_0 and torch.equal(dequantize(held[1], Q4_0), dense)
    assert held[2] is None  # groups already in order: the input as it is
    # Asymmetric with power-of-two scales: every -z s is an fp16 value, so Q4_1 holds it.
    codes, zeros, _, _ = quantize(w, groups, symmetric=False)
    pow2 = torch.full(zeros.shape, 2.0**-6)
    held = int4(codes, zeros, pow2, groups).blocks()
    assert held is not None and held[0] == Q4_1
    assert torch.equal(dequantize(held[1], Q4_1), int4(codes, zeros, pow2, groups).dense())
    # An odd zero times a scale with a full fp16 mantissa is no fp16 value: Q5_0 holds q - z instead,
    # for every zero point a 4-bit code can have (GPTQ v1's stored z - 1 gives z up to 16).
    odd_and_16 = torch.where(torch.arange(zeros.numel()).view(zeros.shape) % 2 == 0, 7, 16)
    for z in (torch.full(zeros.shape, 15), odd_and_16):
        full = int4(codes, z, torch.full(zeros.shape, 1 + 2.0**-10), groups)
        held = full.blocks()
        assert held is not None and held[0] == Q5_0
        assert torch.equal(dequantize(held[1], Q5_0), full.dense())
    # Act-order groups of 32 interleave over the input: sorted, each 32 columns share a group, and the
    # blocks hold the weight's columns in that order (column j is input channel order[j]).
    shuffled = act_order_groups(w, 32).long()
    act = int4(codes, zeros * 0 + 8, torch.full(zeros.shape, 0.25), shuffled)
    held = act.blocks()
    assert held is not None and held[0] == Q4_0 and held[2] is not None
    assert torch.equal(shuffled[held[2]], torch.arange(96) // 32)
    assert torch.equal(dequantize(held[1], Q4_0), act.dense()[:, held[2]])
    # What the blocks cannot hold exactly stays dense: a q - z beyond Q5_0's [-16, 15], a scale that
    # is no fp16 value, act-order groups of 16 (32 sorted columns still span two groups).
    wide = torch.full(zeros.shape, 17)
    assert int4(codes, wide, torch.full(zeros.shape, 1 + 2.0**-10), groups).blocks() is None
    assert int4(codes, zeros * 0 + 8, torch.full(zeros.shape, 1 + 2.0**-20), groups).blocks() is None
    by16 = act_order_groups(w, 16).long()
    z16 = torch.full((64, 6), 8)
    assert int4(codes, z16, torch.full(z16.shape, 0.25), by16).blocks() is None


def test_fused_parts_of_different_act_orders_stay_dense(tmp_path: Path, tiny_models: dict[str, Path]) -> None:
    """q/k/v share one input, so one order: a file whose k_proj ranks its input otherwise keeps that
    layer's q/k/v dense (the rest of the model still on blocks)."""
    write_quantized(tiny_models["llama"], tmp_path / "q", "gptq", group=32, symmetric=True, act_order=True)
    file = tmp_path / "q" / "model.safetensors"
    tensors = load_file(str(file))
    name = "model.layers.0.self_attn.k_proj.g_idx"
    tensors[name] = tensors[name].flip(0).contiguous()
    save_file(tensors, str(file))
    model = load_model(tmp_path / "q", torch.float32, CPU)
    first, second = model.layers[0], model.layers[1]
    assert isinstance(first, DecoderLayer) and isinstance(second, DecoderLayer)
    assert type(first.self_attn.qkv_proj) is Linear and isinstance(first.self_attn.o_proj, GGUFLinear)
    assert isinstance(second.self_attn.qkv_proj, GGUFLinear)


def test_an_act_order_linear_on_blocks_equals_its_dense_weight_whole_and_split_along_its_input() -> None:
    torch.manual_seed(1)
    w = torch.randn(48, 128)
    groups = act_order_groups(w, 32).long()
    codes, zeros, scales, dense = quantize(w, groups, symmetric=False)
    held = hf_quant.Int4Weight(codes.to(torch.int16), zeros.to(torch.int16), scales.float(), groups).blocks()
    assert held is not None and held[2] is not None
    lin = GGUFLinear([Weight(held[0], held[1], 128)], None, held[2])
    x = torch.randn(5, 128)
    torch.testing.assert_close(lin(x), x @ dense.T, rtol=1e-5, atol=1e-5)
    # A tensor-parallel rank keeps input channels [64, 128): the blocks' columns of those channels are
    # spread over every block, so the split holds them as fp32 columns in the input's own order.
    keep_cols(lin, 64, 128, keep_bias=True)
    assert lin.input_order is None and lin.qtypes == [F32]
    torch.testing.assert_close(lin(x[:, 64:]), x[:, 64:] @ dense[:, 64:].T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("method", "symmetric", "qtype"), [("gptq", True, Q4_0), ("awq", False, Q5_0)])
def test_a_w4a16_file_serves_on_blocks_and_takes_int8_decode(
    tmp_path: Path, tiny_models: dict[str, Path], method: str, symmetric: bool, qtype: int
) -> None:
    write_quantized(tiny_models["llama"], tmp_path / "q", method, group=32, symmetric=symmetric)
    engine = Engine(model=str(tmp_path / "q"), **OPTIONS)
    layer = _layer(engine.model)
    assert engine.model.quantization == "gguf"
    for lin in (
        layer.self_attn.qkv_proj,
        layer.self_attn.o_proj,
        layer.mlp.gate_up_proj,
        layer.mlp.down_proj,
    ):
        assert isinstance(lin, GGUFLinear) and set(lin.qtypes) == {qtype}
    # Approximate, as over a .gguf model's blocks: it runs, and stays close to the exact tokens' start.
    fast = Engine(model=str(tmp_path / "q"), decode_arithmetic="int8", **OPTIONS)
    out = fast.generate(PROMPTS, GREEDY)
    assert all(len(o.outputs[0].token_ids) == GREEDY.max_tokens for o in out)
