"""Issue 21's benchmark arithmetic with known answers (no model, no server): the bytes of each weight
format and KV dtype, the physical limit by arithmetic, the modes' knobs and their flags, and the
accuracy maths on synthetic scores."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from benchmarks.lib import modes, servers
from benchmarks.lib.accuracy import Scored, agreement, compare_scores, parse_choice
from benchmarks.lib.common import cpu_flags
from benchmarks.lib.modes import Formats, Limits, Shapes, StepModel, kv_token_bytes, matrix_bytes
from benchmarks.step import step_modes, step_targets

# SmolLM2-135M's shapes
SMOL = Shapes(hidden=576, intermediate=1536, layers=30, heads=9, kv_heads=3, head_dim=64, vocab=49152)


def test_matrix_bytes_per_format() -> None:
    assert matrix_bytes("f32", 10, 64) == 10 * 64 * 4
    assert matrix_bytes("bf16", 10, 64) == 10 * 64 * 2
    assert matrix_bytes("int8", 10, 64) == 10 * 64 + 10 * 4  # 1 byte a weight + an fp32 scale a row
    assert matrix_bytes("q4_1", 10, 64) == 10 * 2 * 20  # 20 bytes per 32 weights
    assert matrix_bytes("q4_0", 10, 64) == 10 * 2 * 18
    assert matrix_bytes("q8_0", 10, 64) == 10 * 2 * 34
    assert matrix_bytes("q4_k", 2, 512) == 2 * 2 * 144
    with pytest.raises(ValueError, match="blocks of 32"):
        matrix_bytes("q4_1", 10, 48)
    with pytest.raises(ValueError, match="unknown weight format 'q3_k'"):
        matrix_bytes("q3_k", 1, 256)


def test_block_formats_agree_with_the_gguf_package() -> None:
    gguf = pytest.importorskip("gguf")
    for name, (block, nbytes) in modes.BLOCK_FORMATS.items():
        assert tuple(gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name.upper()]]) == (block, nbytes)


def test_kv_bytes_per_token_with_int8_scales() -> None:
    # K and V x 30 layers x 3 heads x 64 dims
    assert kv_token_bytes("float32", 30, 3, 64) == 2 * 30 * 3 * 64 * 4 == 46080
    assert kv_token_bytes("bfloat16", 30, 3, 64) == 46080 // 2
    assert kv_token_bytes("int8", 30, 3, 64) == 46080 // 4 + 2 * 30 * 3 * 4  # + a scale per token and head
    with pytest.raises(ValueError, match="fp4"):
        kv_token_bytes("fp4", 30, 3, 64)


def test_step_bytes_of_fp32_gguf_and_int8_weights() -> None:
    fp32 = StepModel(SMOL, Formats.uniform(30, "f32"), "float32")
    body, head = fp32.weight_bytes()
    assert body == 30 * 4 * (2 * 576 * 576 + 2 * 192 * 576 + 3 * 1536 * 576)  # q, o; k, v; gate, up, down
    assert head == 49152 * 576 * 4  # 113 MB, the issue's figure
    gguf = StepModel(SMOL, Formats.uniform(30, "q4_1", head="q8_0"), "bfloat16")
    g_body, g_head = gguf.weight_bytes()
    assert g_body * 4 * 32 == body * 20  # 20 bytes per 32 weights against 4 bytes a weight
    assert g_head == 49152 * 18 * 34
    nbytes, _ = gguf.decode(8, 512)
    assert nbytes == g_body + g_head + 8 * 512 * 46080 / 2
    int8 = StepModel(SMOL, Formats.uniform(30, "int8", head="f32"), "int8")
    i_body, i_head = int8.weight_bytes()
    assert i_body == body // 4 + 30 * 4 * (576 + 192 + 192 + 576 + 1536 + 1536 + 576)  # + row scales
    assert i_head == head
    assert int8.decode(1, 100)[0] == i_body + i_head + 100 * kv_token_bytes("int8", 30, 3, 64)


def test_mixed_gguf_layers_are_counted_layer_by_layer() -> None:
    layers = Formats.uniform(2, "q4_1").layers
    mixed = Formats(({**layers[0], "ffn_down": "q6_k"}, layers[1]), head="q6_k")
    model = StepModel(Shapes(256, 512, 2, 4, 2, 64, 1024), mixed, "float32")
    body, head = model.weight_bytes()
    plain, _ = StepModel(
        Shapes(256, 512, 2, 4, 2, 64, 1024), Formats.uniform(2, "q4_1"), "float32"
    ).weight_bytes()
    assert body - plain == 256 * (2 * 210 - 16 * 20)  # one down projection [256, 512]: q6_k vs q4_1 rows
    assert head == 1024 * 210 and "q4_1 x 13, q6_k x 1" in mixed.describe()


def test_flops_go_to_the_arithmetic_that_runs_them() -> None:
    model = StepModel(SMOL, Formats.uniform(30, "int8", head="f32"), "float32")
    _, flops = model.decode(4, 100)
    linear = 2.0 * 4 * 30 * (2 * 576 * 576 + 2 * 192 * 576 + 3 * 1536 * 576)
    head = 2.0 * 4 * 49152 * 576
    attention = 4.0 * 4 * 100 * 9 * 64 * 30
    assert flops == {"int8": pytest.approx(linear), "fp32": pytest.approx(head + attention)}
    _, prefill = StepModel(SMOL, Formats.uniform(30, "f32"), "float32").prefill(512, 0, "bf16")
    assert set(prefill) == {"bf16", "fp32"}  # the linears at bf16; the head (last row) and attention fp32
    assert prefill["bf16"] == pytest.approx(2.0 * 512 * linear / (2.0 * 4))


def test_limit_is_the_bytes_or_the_arithmetic_each_at_its_peak() -> None:
    limits = Limits(bandwidth_gb_s=10.0, peaks_gflop_s={"fp32": 100.0, "int8": 400.0})
    assert limits.seconds(1e9, {"fp32": 1e9}) == pytest.approx(0.1)  # bytes: 1 GB at 10 GB/s
    assert limits.seconds(1e6, {"fp32": 50e9}) == pytest.approx(0.5)  # compute-bound
    assert limits.seconds(1e6, {"fp32": 10e9, "int8": 80e9}) == pytest.approx(0.1 + 0.2)  # one after another
    with pytest.raises(ValueError, match="no measured peak for bf16"):
        limits.seconds(1e6, {"bf16": 1.0})
    assert limits.as_json()["peak_gflop_s"] == 100.0  # step_bench's key of the fp32 peak


def test_modes_pass_known_knobs_explicitly_and_leave_out_missing_defaults() -> None:
    ref = modes.MODES["fp32"]
    with_knobs = {"quantization", "kv_cache_dtype", "prefill_arithmetic", "preset"}
    assert modes.engine_options(ref, with_knobs) == {
        "quantization": None,
        "kv_cache_dtype": "float32",  # explicit: a later default ("auto") cannot change the reference
        "prefill_arithmetic": "exact",
    }
    assert modes.engine_options(ref, {"quantization"}) == {"quantization": None}
    bf16 = modes.MODES["gguf+kv-bf16"]
    assert modes.engine_options(bf16, {"quantization"}) == {
        "quantization": "gguf",
        "kv_cache_dtype": "bfloat16",
    }
    assert modes.engine_options(modes.MODES["fast"], with_knobs) == {"preset": "fast"}
    assert servers.server_flags({"quantization": "gguf", "kv_cache_dtype": "int8", "preset": None}) == [
        "--quantization",
        "gguf",
        "--kv-cache-dtype",
        "int8",
    ]


def test_unavailable_names_the_missing_knob_or_choice() -> None:
    assert modes.unavailable({"quantization": "int8"}) is None
    assert "no_such_knob" in (modes.unavailable({"no_such_knob": 1}) or "")
    assert "fp4" in (modes.unavailable({"quantization": "fp4"}) or "")


def test_parse_modes_expands_groups_once_and_refuses_unknown_names() -> None:
    grid = modes.parse_modes("grid")
    assert len(grid) == 12 and {(m.weights, m.kv) for m in grid} == {
        (w, kv) for w in modes.WEIGHTS for kv in modes.KV_DTYPES
    }
    picked = [m.name for m in modes.parse_modes("fp32,arith,fp32")]
    assert picked[0] == "fp32" and picked.count("fp32") == 1
    assert "fp32+prefill-int8" in picked and "gguf+prefill-bf16" in picked
    assert len(modes.parse_modes("all")) == len(modes.MODES)
    int8 = modes.MODES["gguf+kv-bf16+int8"]  # int8 at every step: decode_arithmetic, beside the grid
    assert int8.name not in [m.name for m in grid]
    assert modes.engine_options(int8)["decode_arithmetic"] == "int8"
    with pytest.raises(ValueError, match="unknown mode 'fp4'.*groups: all"):
        modes.parse_modes("fp32,fp4")


def _scored(logliks: list[float], top1: list[str]) -> Scored:
    return Scored(["<t0>"] + [f"t{i}" for i in range(1, len(logliks) + 1)], logliks, top1)


def test_agreement_mean_max_and_top1_on_synthetic_scores() -> None:
    ref = [_scored([-1.0, -2.0, -0.5], ["a", "b", "c"]), _scored([-3.0], ["x"])]
    test = [_scored([-1.1, -2.0, -0.2], ["a", "z", "c"]), _scored([-2.5], ["x"])]
    acc = agreement(ref, test)
    assert acc.tokens == 4
    assert acc.mean_abs_dloglik == pytest.approx((0.1 + 0.0 + 0.3 + 0.5) / 4)
    assert acc.max_abs_dloglik == pytest.approx(0.5)
    assert acc.top1_agreement == pytest.approx(3 / 4)
    assert compare_scores(ref, test)["enough_tokens"] is False  # 4 < 400
    other = [Scored(["<t0>", "u1", "u2", "u3"], [-1.0, -2.0, -0.5], ["a", "b", "c"]), ref[1]]
    assert "tokenized" in compare_scores(ref, other)["error"]


def test_parse_choice_drops_the_first_token_and_any_generated_ones() -> None:
    lp = {
        "tokens": ["A", "B", "C", "D"],
        "token_logprobs": [None, -1.0, -2.0, -0.1],
        "top_logprobs": [None, {"B": -1.0, "X": -0.5}, {"C": -2.0}, {"D": -0.1}],
    }
    echoed = parse_choice(lp)
    assert echoed.logliks == [-1.0, -2.0, -0.1] and echoed.top1 == ["X", "C", "D"]
    one_new = parse_choice(lp, generated=1)  # a server that needed max_tokens 1: D is its new token
    assert (
        one_new.tokens == ["A", "B", "C"] and one_new.logliks == [-1.0, -2.0] and one_new.top1 == ["X", "C"]
    )


def test_cpu_flags_from_cpuinfo() -> None:
    info = "processor : 0\nmodel name : Some CPU\nflags : fpu avx2 avx512f avx512_vnni amx_tile\n"
    flags = cpu_flags(info)
    assert flags["avx512f"] and flags["avx512_vnni"] and flags["amx_tile"] and flags["avx2"]
    assert not flags["avx512_bf16"] and not flags["amx_int8"]
    assert cpu_flags("") == {f: False for f in flags}


def _fake_engine(quantization: str | None, head: torch.nn.Module, kv: torch.dtype) -> Any:
    cfg = SimpleNamespace(num_layers=2)
    return SimpleNamespace(
        config=SimpleNamespace(quantization=quantization),
        dtype=torch.float32,
        model=SimpleNamespace(config=cfg, lm_head=head),
        pool=SimpleNamespace(k_buffer=torch.zeros(1, dtype=kv)),
        model_path="/nowhere",
    )


def test_formats_and_kv_dtype_are_read_off_the_engine() -> None:
    fp32 = _fake_engine(None, torch.nn.Linear(4, 4), torch.float32)
    assert step_modes.engine_formats(fp32) == Formats.uniform(2, "f32")
    assert step_modes.engine_kv_dtype(fp32) == "float32"
    int8_head = torch.nn.Module()
    int8_head.register_buffer("qweight", torch.zeros(4, 4, dtype=torch.int8))
    with_int8_head = _fake_engine("int8", int8_head, torch.bfloat16)
    assert step_modes.engine_formats(with_int8_head) == Formats.uniform(2, "int8", head="int8")
    assert step_modes.engine_kv_dtype(with_int8_head) == "bfloat16"
    fp32_head = _fake_engine("int8", torch.nn.Linear(4, 4), torch.int8)
    assert step_modes.engine_formats(fp32_head).head == "f32"
    assert step_modes.engine_kv_dtype(fp32_head) == "int8"
    fp32_head.pool.kv_dtype = "int8"  # a pool that names its dtype is taken at its word
    fp32_head.pool.k_buffer = torch.zeros(1, dtype=torch.uint8)
    assert step_modes.engine_kv_dtype(fp32_head) == "int8"


def test_the_default_gguf_files_own_types_give_its_bytes() -> None:
    pytest.importorskip("gguf")
    from radixserve.model.default_model import find_default_gguf

    try:
        path = find_default_gguf()
    except FileNotFoundError:
        pytest.skip("the default model's GGUF file is not installed")
    formats = step_modes.gguf_formats(path, SMOL.layers)
    assert formats.describe() == "q4_1; head q8_0"
    body, head = StepModel(SMOL, formats, "float32").weight_bytes()
    tensors = {name: n_bytes for name, (_, n_bytes) in step_modes.gguf_tensors(path).items()}  # read once
    linears = [f"blk.{i}.{n}.weight" for i in range(SMOL.layers) for n in step_modes.GGUF_NAMES]
    assert body == sum(tensors[n] for n in linears)
    assert head == tensors["token_embd.weight"]


def test_limits_need_the_peaks_of_the_arithmetic_the_modes_use() -> None:
    assert step_modes.used_arithmetics([modes.MODES["fp32"], modes.MODES["gguf+kv-bf16"]]) == {"fp32"}
    assert step_modes.used_arithmetics([modes.MODES["int8"]]) == {"fp32", "int8"}
    assert step_modes.used_arithmetics([modes.MODES["fp32+prefill-bf16"]]) == {"fp32", "bf16"}
    assert step_modes.used_arithmetics([modes.MODES["fast"]]) == {"fp32", "int8", "bf16"}
    limits = Limits(10.0, {"fp32": 100.0, "int8": 400.0})
    auto: Any = SimpleNamespace(config=SimpleNamespace(prefill_arithmetic="auto"))
    assert step_modes.engine_arithmetic(auto, limits) == "int8"  # the fastest peak: a lower bound
    exact: Any = SimpleNamespace(config=SimpleNamespace())  # a build without the knob: the weights' own
    assert step_modes.engine_arithmetic(exact, limits) is None


def test_accuracy_figures_go_beside_each_modes_speed(tmp_path: Path) -> None:
    acc = {"tokens": 432, "mean_abs_dloglik": 0.0123, "max_abs_dloglik": 0.5, "top1_agreement": 0.975}
    doc = {"modes": {"fp32+kv-bf16": {"accuracy": acc}, "gguf": {"unavailable": "no gguf"}}}
    path = tmp_path / "accuracy.json"
    path.write_text(json.dumps(doc))
    _, rows = step_modes.accuracy_rows(path, ["fp32", "fp32+kv-bf16", "gguf"])
    assert len(rows) == 1 and rows[0][0] == "fp32+kv-bf16"
    assert "432 tokens" in rows[0][1] and "0.0123" in rows[0][1] and "97.5%" in rows[0][1]
    assert len(rows[0]) == len(step_modes.HEADER)


def test_step_targets_against_this_runs_fp32_mode() -> None:
    def steps(**ms: float) -> dict[str, Any]:
        return {"steps": {k: {"ms": v, "pct_of_limit": 100 * 10 / v} for k, v in ms.items()}}

    results = {
        "fp32": steps(decode_b1_c512=20.0, decode_b8_c512=50.0, prefill_512=400.0),  # 1 x 512 at 50% of 10 ms
        "gguf": steps(decode_b1_c512=5.0, decode_b8_c512=25.0),  # 4x and 2x
        "fp32+prefill-int8": steps(prefill_512=160.0),  # 2.5x
        "gguf+kv-bf16": {"unavailable": "no"},
    }
    accuracy = {
        "fp32+kv-bf16": {"accuracy": {"mean_abs_dloglik": 0.004, "top1_agreement": 0.99}},
        "fp32+prefill-int8": {"accuracy": {"mean_abs_dloglik": 0.2, "top1_agreement": 0.93}},
    }
    got = {r["target"]: (r["value"], r["met"]) for r in step_targets.target_rows(results, accuracy)}
    assert got["fp32 decode 1 x 512 at >= 60% of its byte limit"] == (pytest.approx(50.0), False)
    assert got["GGUF-exact decode 8 x 512 >= 2.5x fp32"] == (pytest.approx(2.0), False)
    assert got["GGUF-exact decode 1 x 512 >= 3x fp32"] == (pytest.approx(4.0), True)
    assert got["bf16 KV decode 8 x 2048 >= 1.3x fp32 KV"] == (None, None)  # not run
    assert got["bf16 KV mean abs d loglik <= 0.01"] == (pytest.approx(0.004), True)  # lower is better
    assert got["fp32+prefill-int8: prefill 512 >= 2x fp32"] == (pytest.approx(2.5), True)
    assert got["fp32+prefill-int8: top-1 agreement >= 95%"] == (pytest.approx(0.93), False)
    md = step_targets.render(step_targets.target_rows(results, accuracy))
    assert "| GGUF-exact decode 1 x 512 >= 3x fp32 | 4 | yes |" in md and "| not run |" in md
