"""The serving modes of issue 21 and what one step of each must read and compute.

A mode is a weights format (fp32, gguf, int8, bf16: ``--dtype bfloat16``) x a KV cache dtype (float32,
bfloat16, int8) x a prefill arithmetic (exact, int8, bfloat16), or a preset (``fast``). ``step_bench``
times each and ``accuracy_bench`` scores each against fp32, from the one list ``MODES``, so the two
cover the same combinations.

The knobs come from parallel branches (docs/benchmarks.md): a mode whose knob or choice this build
does not have is *unavailable* (``unavailable`` says why), never an error. A knob this build has is
passed explicitly, even at its default, so that a later default (``kv_cache_dtype="auto"``) cannot
change what the reference mode measures; a knob it lacks is left out when the mode asks for the
behaviour the build has without it (fp32 KV, exact arithmetic).

Byte accounting (``StepModel``): a step reads every linear weight once, in its format (``matrix_bytes``:
fp32 4 bytes a weight, int8 1 byte + one fp32 scale per output row, a GGUF block type its block
bytes), the LM head in its own format, and each row's K/V context at the KV dtype, plus one fp32 scale
per token and KV head for int8 K/V (``kv_token_bytes``). Norms and the embedding rows looked up are
left out (< 0.1% of the step).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from radixserve.config import EngineConfig

WEIGHTS = ("fp32", "gguf", "int8", "bf16")
KV_DTYPES = ("float32", "bfloat16", "int8")
ARITHMETICS = ("exact", "int8", "bfloat16")
_SHORT = {"float32": "f32", "bfloat16": "bf16", "int8": "int8"}

# A knob and the value that is what a build without it does (so leaving it out asks for that value).
IMPLIED_WITHOUT_KNOB: dict[str, Any] = {
    "kv_cache_dtype": "float32",
    "prefill_arithmetic": "exact",
    "decode_arithmetic": "exact",
    "preset": None,
}


@dataclass(frozen=True)
class Mode:
    """One combination. ``preset`` set: the preset alone decides the rest (the other fields unset)."""

    name: str
    weights: str | None = "fp32"
    kv: str | None = "float32"
    arithmetic: str | None = "exact"
    preset: str | None = None
    decode: str | None = "exact"  # decode_arithmetic (int8: every product over GGUF blocks in int8)

    def wanted(self) -> dict[str, Any]:
        """The engine options this mode asks for, each knob at the value it needs."""
        if self.preset is not None:
            return {"preset": self.preset}
        bf16 = {"dtype": "bfloat16"} if self.weights == "bf16" else {}  # the HF folder loaded as bf16
        return {
            "quantization": None if self.weights in ("fp32", "bf16") else self.weights,
            **bf16,
            "kv_cache_dtype": self.kv,
            "prefill_arithmetic": self.arithmetic,
            "decode_arithmetic": self.decode,
        }


def mode_name(weights: str, kv: str = "float32", arithmetic: str = "exact", decode: str = "exact") -> str:
    """``fp32``, ``gguf+kv-bf16``, ``fp32+prefill-int8``, ``gguf+int8``: the weights, then what differs
    from fp32/exact (``+int8``: int8 at every step, ``decode_arithmetic``)."""
    name = weights
    if kv != "float32":
        name += f"+kv-{_SHORT[kv]}"
    if arithmetic != "exact":
        name += f"+prefill-{_SHORT[arithmetic]}"
    if decode != "exact":
        name += f"+{_SHORT[decode]}"
    return name


def _modes() -> dict[str, Mode]:
    out = [Mode(mode_name(w, kv), w, kv) for w in WEIGHTS for kv in KV_DTYPES]
    # The cheaper arithmetic for many rows, over the two exact weight formats (int8 weights already
    # run int8 arithmetic).
    out += [
        Mode(mode_name(w, "float32", a), w, "float32", a) for w in ("fp32", "gguf") for a in ARITHMETICS[1:]
    ]
    # int8 at every step over GGUF blocks (decode_arithmetic int8: stored int8 tiles), fp32 and bf16 K/V.
    out += [Mode(mode_name("gguf", kv, decode="int8"), "gguf", kv, decode="int8") for kv in KV_DTYPES[:2]]
    out.append(Mode("fast", None, None, None, preset="fast", decode=None))
    return {m.name: m for m in out}


MODES = _modes()
# Named groups for --modes: the weights x KV grid (decode), the arithmetic modes (prefill), all.
GROUPS = {
    "all": list(MODES),
    "grid": [m.name for m in MODES.values() if m.arithmetic == "exact" and m.decode == "exact"],
    "arith": ["fp32"] + [m.name for m in MODES.values() if m.arithmetic not in ("exact", None)],
}


def parse_modes(spec: str) -> list[Mode]:
    """A comma list of mode names and group names (``all``, ``grid``, ``arith``), in order, once each."""
    names: list[str] = []
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        if part in GROUPS:
            names += GROUPS[part]
        elif part in MODES:
            names.append(part)
        else:
            raise ValueError(f"unknown mode {part!r}; modes: {', '.join(MODES)}; groups: {', '.join(GROUPS)}")
    return [MODES[n] for n in dict.fromkeys(names)]


def engine_options(mode: Mode, known: Iterable[str] | None = None) -> dict[str, Any]:
    """The Engine kwargs for ``mode`` in a build whose EngineConfig has the fields ``known``.

    A knob the build lacks is left out when its wanted value is what the build does anyway
    (``IMPLIED_WITHOUT_KNOB``); otherwise it is passed, and the build refuses it (``unavailable``)."""
    fields = set(known) if known is not None else {f.name for f in dataclasses.fields(EngineConfig)}
    out: dict[str, Any] = {}
    for knob, value in mode.wanted().items():
        if knob in fields or value != IMPLIED_WITHOUT_KNOB.get(knob, value):
            out[knob] = value
    return out


def unavailable(options: Mapping[str, Any]) -> str | None:
    """Why this build cannot run ``options`` (an unknown knob or choice), or None. Checks the config
    only: a refusal that needs the model (a CPU without bf16, say) shows when the engine is built."""
    try:
        EngineConfig.from_kwargs(**options)
    except (TypeError, ValueError) as exc:
        return str(exc)
    return None


# -- byte accounting ---------------------------------------------------------------------------------
# (weights per block, bytes per block) of each storage format; GGUF types by their ggml names.
BLOCK_FORMATS: dict[str, tuple[int, int]] = {
    "f32": (1, 4),
    "f16": (1, 2),
    "bf16": (1, 2),
    "q4_0": (32, 18),  # fp16 scale + 32 nibbles
    "q4_1": (32, 20),  # fp16 scale and min + 32 nibbles
    "q8_0": (32, 34),  # fp16 scale + 32 bytes
    "q4_k": (256, 144),
    "q6_k": (256, 210),
}
INT8_SCALE_BYTES = 4  # int8 weights: one fp32 scale per output row (model/quant.py)
KV_ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1}
KV_SCALE_BYTES = 4  # int8 K/V: one fp32 scale per token and KV head, for K and for V


def matrix_bytes(fmt: str, rows: int, cols: int) -> int:
    """Bytes of a ``[rows, cols]`` weight stored as ``fmt`` (``int8`` or a ``BLOCK_FORMATS`` key);
    GGUF blocks run along a row, so ``cols`` must be a multiple of the block."""
    if fmt == "int8":
        return rows * cols + rows * INT8_SCALE_BYTES
    if fmt not in BLOCK_FORMATS:
        raise ValueError(f"unknown weight format {fmt!r}; formats: int8, {', '.join(BLOCK_FORMATS)}")
    block, nbytes = BLOCK_FORMATS[fmt]
    if cols % block:
        raise ValueError(f"{fmt} stores rows in blocks of {block} weights; a row of {cols} is not whole")
    return rows * (cols // block) * nbytes


def kv_token_bytes(kv: str, layers: int, kv_heads: int, head_dim: int) -> int:
    """Bytes of one token's K and V over every layer at KV dtype ``kv`` (int8: with its scales)."""
    if kv not in KV_ELEMENT_BYTES:
        raise ValueError(f"unknown KV dtype {kv!r}; dtypes: {', '.join(KV_ELEMENT_BYTES)}")
    nbytes = 2 * layers * kv_heads * head_dim * KV_ELEMENT_BYTES[kv]
    if kv == "int8":
        nbytes += 2 * layers * kv_heads * KV_SCALE_BYTES
    return nbytes


@dataclass(frozen=True)
class Shapes:
    """The shapes a step touches, from the model config."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def of(cls, cfg: Any) -> Shapes:
        return cls(
            cfg.hidden_size,
            cfg.intermediate_size,
            cfg.num_layers,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.vocab_size,
        )

    def layer_linears(self) -> dict[str, tuple[int, int]]:
        """Each decoder layer's linear weights, ``[out, in]``, by their GGUF tensor names."""
        q, kv, h, i = (
            self.heads * self.head_dim,
            self.kv_heads * self.head_dim,
            self.hidden,
            self.intermediate,
        )
        return {
            "attn_q": (q, h),
            "attn_k": (kv, h),
            "attn_v": (kv, h),
            "attn_output": (h, q),
            "ffn_gate": (i, h),
            "ffn_up": (i, h),
            "ffn_down": (h, i),
        }


@dataclass(frozen=True)
class Formats:
    """How a mode stores its weights: per decoder layer, each linear's format (by GGUF tensor name,
    as mixed-type GGUF files differ layer to layer), and the LM head's."""

    layers: tuple[Mapping[str, str], ...]
    head: str

    @classmethod
    def uniform(cls, layers: int, fmt: str, head: str | None = None) -> Formats:
        names = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
        return cls(tuple({n: fmt for n in names} for _ in range(layers)), head or fmt)

    def describe(self) -> str:
        """``q4_1``, or ``q4_1 x 200, q8_0 x 10``, then the head: ``q4_1; head q8_0``."""
        counts: dict[str, int] = {}
        for layer in self.layers:
            for fmt in layer.values():
                counts[fmt] = counts.get(fmt, 0) + 1
        body = next(iter(counts)) if len(counts) == 1 else ", ".join(f"{f} x {n}" for f, n in counts.items())
        return f"{body}; head {self.head}"


# The arithmetic whose peak bounds a product: "fp32", "int8" (``torch._int_mm``), "bf16".
def weights_arithmetic(fmt: str) -> str:
    """The arithmetic of a weight format's own product: int8 weights multiply in int8; fp32 and GGUF
    blocks (dequantized in registers, accumulated in fp32: the exact mode) in fp32."""
    return "int8" if fmt == "int8" else ("bf16" if fmt == "bf16" else "fp32")


@dataclass(frozen=True)
class StepModel:
    """What one step of a mode reads (bytes) and computes (flops by arithmetic)."""

    shapes: Shapes
    formats: Formats
    kv: str

    def weight_bytes(self) -> tuple[int, int]:
        """(decoder linear bytes over all layers, LM head bytes)."""
        s = self.shapes
        shapes = s.layer_linears()
        body = sum(
            matrix_bytes(layer[n], o, i) for layer in self.formats.layers for n, (o, i) in shapes.items()
        )
        return body, matrix_bytes(self.formats.head, s.vocab, s.hidden)

    def kv_bytes(self, tokens: float) -> float:
        s = self.shapes
        return tokens * kv_token_bytes(self.kv, s.layers, s.kv_heads, s.head_dim)

    def _linear_flops(
        self, rows: int, arithmetic: str | None, head_rows: int, head_arithmetic: str | None = None
    ) -> dict[str, float]:
        """Flops of the linears by arithmetic: the decoder's ``rows`` (at ``arithmetic``, or each
        weight's own), and the LM head's ``head_rows`` (at ``head_arithmetic``, or its own)."""
        s = self.shapes
        flops: dict[str, float] = {}
        for layer in self.formats.layers:
            for n, (o, i) in s.layer_linears().items():
                a = arithmetic or weights_arithmetic(layer[n])
                flops[a] = flops.get(a, 0.0) + 2.0 * rows * o * i
        a = head_arithmetic or weights_arithmetic(self.formats.head)
        flops[a] = flops.get(a, 0.0) + 2.0 * head_rows * s.vocab * s.hidden
        return flops

    def _attention_flops(self, queries: int, keys: float) -> float:
        s = self.shapes
        return 4.0 * queries * keys * s.heads * s.head_dim * s.layers

    def decode(
        self, batch: int, context: int, arithmetic: str | None = None
    ) -> tuple[float, dict[str, float]]:
        """(bytes, flops by arithmetic) of one decode step of ``batch`` rows over ``context`` tokens, the
        linears and LM head at ``arithmetic`` (None: the weights' own; "int8": decode_arithmetic int8,
        whose tiles read more bytes than the blocks counted here, so its limit is a lower bound)."""
        body, head = self.weight_bytes()
        flops = self._linear_flops(batch, arithmetic, batch, arithmetic)
        flops["fp32"] = flops.get("fp32", 0.0) + self._attention_flops(batch, context)  # fp32 accumulate
        return body + head + self.kv_bytes(batch * context), flops

    def prefill(self, new: int, cached: int, arithmetic: str | None) -> tuple[float, dict[str, float]]:
        """``new`` tokens over ``cached`` ones, the linears at ``arithmetic`` (None: the weights' own)."""
        body, head = self.weight_bytes()
        flops = self._linear_flops(new, arithmetic, 1)
        flops["fp32"] = flops.get("fp32", 0.0) + self._attention_flops(new, cached + new / 2)
        return body + head + self.kv_bytes(cached + new), flops


# The arithmetic of prefill_arithmetic's choices (None: the weights' own).
PREFILL_ARITHMETIC = {"exact": None, "int8": "int8", "bfloat16": "bf16"}


@dataclass
class Limits:
    """The machine's limits, measured in the run: read bandwidth and each arithmetic's peak."""

    bandwidth_gb_s: float
    peaks_gflop_s: dict[str, float]  # "fp32", and "int8" / "bf16" where measured

    def seconds(self, nbytes: float, flops: Mapping[str, float]) -> float:
        """The least time a step can take: its bytes at the bandwidth, or its arithmetic, each kind
        at its own peak, one after another (the cores run one kind at a time)."""
        missing = set(flops) - set(self.peaks_gflop_s)
        if missing:
            raise ValueError(f"no measured peak for {', '.join(sorted(missing))} arithmetic")
        compute = sum(f / (self.peaks_gflop_s[a] * 1e9) for a, f in flops.items())
        return max(nbytes / (self.bandwidth_gb_s * 1e9), compute)

    def as_json(self) -> dict[str, Any]:
        # peak_gflop_s: the fp32 peak, under the key step_bench wrote before the other arithmetics.
        return {
            "bandwidth_gb_s": self.bandwidth_gb_s,
            "peak_gflop_s": self.peaks_gflop_s["fp32"],
            "peaks_gflop_s": dict(self.peaks_gflop_s),
        }
