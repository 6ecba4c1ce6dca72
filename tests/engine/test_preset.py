"""``preset`` (presets.py): ``fast`` resolves to explicit knobs, a knob given explicitly wins, ``exact``
and no preset change nothing, and the ``serve`` flags go through the same resolution."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from radixserve.config import EngineConfig
from radixserve.server.launch import add_serve_arguments, engine_config_from_args


def _changed(config: EngineConfig) -> dict[str, object]:
    return {
        f.name: getattr(config, f.name)
        for f in dataclasses.fields(config)
        if getattr(config, f.name) != f.default and f.name != "preset"
    }


def test_fast_resolves_to_explicit_knobs() -> None:
    config = EngineConfig(preset="fast")
    assert config.quantization == "int8" and config.prefill_arithmetic == "auto"
    expected = {"quantization": "int8", "prefill_arithmetic": "auto"}
    if any(f.name == "kv_cache_dtype" for f in dataclasses.fields(EngineConfig)):
        expected["kv_cache_dtype"] = "bfloat16"
    assert _changed(config) == expected


def test_explicit_knobs_win_over_the_preset() -> None:
    config = EngineConfig(preset="fast", prefill_arithmetic="bfloat16", page_size=32)
    assert config.prefill_arithmetic == "bfloat16" and config.page_size == 32
    assert config.quantization == "int8"


def test_a_gguf_model_keeps_its_own_weights_under_fast() -> None:
    config = EngineConfig(model="/models/x.gguf", preset="fast")
    assert config.quantization == "gguf" and config.prefill_arithmetic == "auto"


@pytest.mark.parametrize("preset", [None, "exact"])
def test_exact_and_no_preset_change_nothing(preset: str | None) -> None:
    assert _changed(EngineConfig(preset=preset)) == {}


def test_an_unknown_preset_is_refused_with_the_choices() -> None:
    with pytest.raises(ValueError, match="preset"):
        EngineConfig(preset="fastest")


def test_serve_flags_resolve_the_preset_and_explicit_flags_win() -> None:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    config = engine_config_from_args(parser.parse_args(["--preset", "fast", "--prefill-arithmetic", "int8"]))
    assert config.preset == "fast" and config.quantization == "int8" and config.prefill_arithmetic == "int8"
    with pytest.raises(SystemExit):
        parser.parse_args(["--preset", "turbo"])
