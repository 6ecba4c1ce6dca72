"""``preset``: one knob for a measured combination of the speed knobs (``--preset fast``).

``exact`` (and no preset, the default) changes nothing: fp32 weights and arithmetic, token-identical
to the reference. ``fast`` sets, for each knob still at its default (a knob given explicitly, i.e. to
another value than its default, wins):

- ``quantization = "int8"``: a quarter of the weight bytes a decode step reads (model/quant.py), not
  for a GGUF model (``model=*.gguf``), whose own blocks serve it;
- ``prefill_arithmetic = "auto"``: the fastest many-row product that runs here, timed at start-up
  (model/arithmetic.py); over int8 weights it is their own int8 arithmetic;
- ``kv_cache_dtype = "bfloat16"``, where the engine has that knob.

What it picks and the accuracy measured for it are logged once, from ``MEASURED`` below.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

logger = logging.getLogger("radixserve.engine")

PRESETS = ("exact", "fast")

# Accuracy of each setting against fp32, as measured (figure, where it comes from). A setting absent
# here has no measured figure yet: benchmarks/step_bench.py and the benchmark helper's accuracy runs
# (mean |Δ loglik| and top-1 agreement through /v1/completions echo) add it.
MEASURED: dict[tuple[str, str], str] = {
    ("quantization", "int8"): (
        "top-1 agreement 89.8%, mean |Δ loglik| 0.245 over 432 tokens, decoder weights int8 with an fp32 "
        "LM head (benchmarks/results/quant_bench.json; the int8 head is not yet in that run)"
    ),
    ("prefill_arithmetic", "int8"): (
        "prefill top-1 agreement 89% (198/222 tokens, tests/model/test_arithmetic.py, Intel Xeon)"
    ),
    ("prefill_arithmetic", "bfloat16"): (
        "prefill top-1 agreement 99% (220/222 tokens, tests/model/test_arithmetic.py, Intel Xeon)"
    ),
}


def fast_settings(fields: set[str], model: str | None) -> dict[str, Any]:
    """The knobs ``--preset fast`` sets (among the config's ``fields``), for ``model``."""
    settings: dict[str, Any] = {"prefill_arithmetic": "auto"}
    if not (model or "").endswith(".gguf"):
        settings["quantization"] = "int8"
    if "kv_cache_dtype" in fields:  # the KV dtype knob, where this engine has it
        settings["kv_cache_dtype"] = "bfloat16"
    return settings


def apply_preset(config: Any) -> dict[str, Any]:
    """Set ``config.preset``'s knobs on the dataclass ``config`` where they are still at their defaults;
    returns what it set (and logs it once, with the accuracy measured for each)."""
    if config.preset in (None, "exact"):
        return {}
    fields = {f.name: f for f in dataclasses.fields(config)}
    picked = {}
    for name, value in fast_settings(set(fields), config.model).items():
        if getattr(config, name) == fields[name].default:
            setattr(config, name, value)
            picked[name] = value
    kept = sorted(set(fast_settings(set(fields), config.model)) - set(picked))
    logger.info(
        "preset fast: %s%s",
        "; ".join(f"{n}={v} ({MEASURED.get((n, str(v)), 'not measured yet')})" for n, v in picked.items())
        or "nothing (every knob it sets was given)",
        f"; given explicitly, kept: {', '.join(kept)}" if kept else "",
    )
    return picked
