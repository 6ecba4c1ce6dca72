"""``preset`` (presets.py): ``fast`` resolves to explicit knobs, a knob given explicitly wins, ``exact``
and no preset change nothing, and the ``serve`` flags go through the same resolution."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from radixserve.config import EngineConfig
from radixserve.model import arithmetic
from radixserve.server.launch import add_serve_arguments, engine_config_from_args


def _changed(config: EngineConfig) -> dict[str, object]:
    return {
        f.name: getattr(config, f.name)
        for f in dataclasses.fields(config)
        if getattr(config, f.name) != f.default and f.name != "preset"
    }


def test_fast_resolves_to_explicit_knobs() -> None:
    # The embedded model: its own GGUF blocks (exact to its fp32 weights) and bf16 K/V.
    config = EngineConfig(preset="fast")
    assert _changed(config) == {"quantization": "gguf", "kv_cache_dtype": "bfloat16"}
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
