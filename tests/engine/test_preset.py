"""``preset`` (presets.py): ``fast`` resolves to explicit knobs, a knob given explicitly wins, ``exact``
and no preset change nothing, and the ``serve`` flags go through the same resolution. With a stored
measurement for this CPU and model it picks the fastest combination at top-1 >= vLLM bf16's and quotes
that model's accuracy; without one it says none was measured; either way it logs once, also across the
copy of the config the server hands its engine process."""

from __future__ import annotations

import argparse
import dataclasses
import logging
from pathlib import Path
from typing import Any

import pytest

from radixserve import presets
from radixserve.config import EngineConfig
from radixserve.model import arithmetic
from radixserve.server.launch import add_serve_arguments, engine_config_from_args


def _changed(config: EngineConfig) -> dict[str, object]:
    return {
        f.name: getattr(config, f.name)
        for f in dataclasses.fields(config)
        if getattr(config, f.name) != f.default and f.name not in ("preset", "preset_resolved")
    }


@pytest.fixture(autouse=True)
def empty_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cache folder of this test's own: no measurement this machine stored applies."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path


def _preset_logs(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("preset fast")]


def test_fast_resolves_to_explicit_knobs() -> None:
    # The embedded model: its own GGUF blocks (exact to its fp32 weights) and bf16 K/V; int8 products on
    # the blocks where the CPU lists VNNI (measured on that model: top-1 97.9% with outlier channels).
    config = EngineConfig(preset="fast")
    embedded: dict[str, object] = {"quantization": "gguf", "kv_cache_dtype": "bfloat16"}
    if "avx512_vnni" in arithmetic.cpu_flags():
        embedded["decode_arithmetic"] = "int8"
    assert _changed(config) == embedded
    # Another GGUF file keeps exact arithmetic: int8's accuracy was measured on the embedded model only.
    assert "decode_arithmetic" not in _changed(EngineConfig(model="/models/x.gguf", preset="fast"))
    # An HF folder keeps fp32 weights; bf16 products for prefills where the CPU lists bf16.
    folder = EngineConfig(model="/models/hf-folder", preset="fast")
    expected: dict[str, object] = {"model": "/models/hf-folder", "kv_cache_dtype": "bfloat16"}
    if arithmetic.lists_bf16():
        expected["prefill_arithmetic"] = "bfloat16"
    assert _changed(folder) == expected


def test_explicit_knobs_win_over_the_preset() -> None:
    config = EngineConfig(preset="fast", kv_cache_dtype="int8", page_size=32)
    assert config.kv_cache_dtype == "int8" and config.page_size == 32
    assert config.quantization == "gguf"


def test_a_gguf_model_keeps_its_own_weights_under_fast() -> None:
    config = EngineConfig(model="/models/x.gguf", preset="fast")
    assert config.quantization == "gguf" and config.prefill_arithmetic == "exact"


@pytest.mark.parametrize("preset", [None, "exact"])
def test_exact_and_no_preset_change_nothing(preset: str | None) -> None:
    assert _changed(EngineConfig(preset=preset)) == {}


def test_an_unknown_preset_is_refused_with_the_choices() -> None:
    with pytest.raises(ValueError, match="preset"):
        EngineConfig(preset="fastest")


def test_serve_flags_resolve_the_preset_and_explicit_flags_win() -> None:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    config = engine_config_from_args(parser.parse_args(["--preset", "fast", "--kv-cache-dtype", "int8"]))
    assert config.preset == "fast" and config.quantization == "gguf" and config.kv_cache_dtype == "int8"
    with pytest.raises(SystemExit):
        parser.parse_args(["--preset", "turbo"])


def test_the_choice_is_logged_once_also_in_the_engine_process(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="radixserve.engine")
    config = EngineConfig(preset="fast")
    # What the server's engine process does with the config it is handed (engine_process.py).
    copy = EngineConfig.from_kwargs(**dataclasses.asdict(dataclasses.replace(config, detokenize=True)))
    assert copy.quantization == config.quantization == "gguf"
    logs = _preset_logs(caplog)
    assert len(logs) == 1, logs
    assert "nothing" not in logs[0]


def test_an_unmeasured_model_is_said_to_be_unmeasured(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="radixserve.engine")
    EngineConfig(model="/models/other-folder", preset="fast")
    (log,) = _preset_logs(caplog)
    assert "no accuracy was measured for this model on this CPU" in log
    assert "--model /models/other-folder" in log  # how to measure it
    assert "Xeon" not in log and "%" not in log  # no figure of another model or CPU


def _folder(root: Path, name: str) -> str:
    folder = root / name
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"weights")
    return str(folder)


MEASURED: list[dict[str, Any]] = [
    {"name": "fp32", "knobs": {}, "top1": 1.0, "mean_dloglik": 0.0, "tokens": 400, "seconds": 4.0},
    # the fastest, but below vLLM bf16's 96.8% top-1: never picked
    {"name": "int8+kv-bf16", "knobs": {"quantization": "int8", "kv_cache_dtype": "bfloat16"}, "top1": 0.9,
     "mean_dloglik": 0.05, "tokens": 400, "seconds": 1.0},
    {"name": "bf16", "knobs": {"dtype": "bfloat16", "kv_cache_dtype": "bfloat16"}, "top1": 0.975,
     "mean_dloglik": 0.02, "tokens": 400, "seconds": 2.0},
    {"name": "fp32+kv-bf16", "knobs": {"kv_cache_dtype": "bfloat16"}, "top1": 0.995, "mean_dloglik": 0.005,
     "tokens": 400, "seconds": 3.0},
]  # fmt: skip


def test_a_measured_model_gets_its_fastest_accurate_combination_and_its_accuracy(
    empty_store: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="radixserve.engine")
    model = _folder(empty_store, "measured")
    presets.record(model, MEASURED, "2026-12-02")
    config = EngineConfig(model=model, preset="fast")
    assert _changed(config) == {"model": model, "dtype": "bfloat16", "kv_cache_dtype": "bfloat16"}
    (log,) = _preset_logs(caplog)
    assert "bf16: top-1 97.5%" in log and "over 400 tokens" in log and "2026-12-02" in log
    # A knob given explicitly still wins over the measured choice.
    assert EngineConfig(model=model, preset="fast", dtype="float32").dtype == "float32"


def test_a_measurement_applies_to_its_own_model_only(
    empty_store: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="radixserve.engine")
    measured, other = _folder(empty_store, "a"), _folder(empty_store, "b")
    presets.record(measured, MEASURED, "2026-12-02")
    assert EngineConfig(model=other, preset="fast").dtype == "auto"
    # A rewritten checkpoint is another model: its old measurement no longer applies.
    (Path(measured) / "model.safetensors").write_bytes(b"new weights")
    assert EngineConfig(model=measured, preset="fast").dtype == "auto"
    logs = _preset_logs(caplog)
    assert len(logs) == 2 and all("no accuracy was measured" in log for log in logs)


def test_nothing_accurate_enough_falls_back_and_says_so(
    empty_store: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="radixserve.engine")
    model = _folder(empty_store, "inaccurate")
    presets.record(model, [m for m in MEASURED if m["top1"] < presets.MIN_TOP1], "2026-12-02")
    config = EngineConfig(model=model, preset="fast")
    assert config.quantization is None and config.kv_cache_dtype == "bfloat16"
    (log,) = _preset_logs(caplog)
    assert "no measured combination reached top-1 96.8%" in log


def test_candidates_cover_bf16_weights_where_the_cpu_runs_bf16() -> None:
    folder = presets.candidates("/models/folder", bf16=True)
    assert folder["bf16"] == {"dtype": "bfloat16", "kv_cache_dtype": "bfloat16"} and "fp32" in folder
    assert "bf16" not in presets.candidates("/models/folder", bf16=False)  # emulated bf16: never faster
    gguf = presets.candidates("/models/x.gguf", bf16=True)
    assert gguf and all(k.get("quantization") == "gguf" for k in gguf.values())  # its own blocks only
    assert "gguf+kv-bf16+int8" not in gguf
    int8 = presets.candidates("/models/x.gguf", bf16=True, vnni=True)["gguf+kv-bf16+int8"]
    assert int8 == {"quantization": "gguf", "kv_cache_dtype": "bfloat16", "decode_arithmetic": "int8"}
