"""The native decode step: every decoder layer of a decode step of 1-8 rows in one C++ call
(``radixserve_cpu::decode_step``, ``kernels/csrc/native_step.cpp``), on one thread team meeting at
barriers.

Why: a torch decode step on CPU runs ~60 ops a layer, each an OpenMP fork/join, a Python call and, for
the small ones, one more pass over the activations; for a 135M model that cost more than the weights'
bytes (issue 31). The native step does the same arithmetic (RMSNorm, QKV with bias, q/k norm and
RoPE, the K/V write into the pages, paged decode attention, o_proj and residual, RMSNorm, gate/up
with SiLU, down and residual) with 5 barriers a layer and no Python between them.

- Where it sits: ``ModelRunner.run`` hands it a step whose sequences all decode one token (1 to
  ``MAX_ROWS`` of them, no prompt logprobs); the torch model (compiled or eager) stays the reference
  and runs everything else: prefill, extend, mixed steps (a step with any extend chunk runs wholly in
  torch; the next decode-only step is native again), and more rows. The embedding, the final norm and
  the LM head stay the model's own modules.
- Chosen once at load (``NativeStep.create``), like an attention backend: each of a layer's q, k, v,
  o, gate, up and down rows must be one weight the kernel streams (``native_rows()``: fp32 or bf16
  ``[N, K]``, GGUF blocks of one type, any of ``gguf_blocks.FORMATS``, or their int8 tiles under
  ``decode_arithmetic`` int8 (approximate; bands of whole tiles); the parts of one fused
  projection may differ in type, as llama.cpp's k-quant mixes have them), the K/V pages float32 or
  bfloat16, the kernels built for AVX-512 or AVX2, one rank; bf16 weights also need AVX512_BF16
  (``vdpbf16ps``, checked at run time: the build targets plain AVX-512). Else one log line says why,
  and every step runs in torch.
- Weights: streamed as the model holds them (already the kernel's layout: rows of fp32 or bf16, or
  rows of GGUF blocks; a part is a row view of its fused projection), so the native step adds no memory.
  A weight with an ``input_order`` (GPTQ act-order on blocks) gets its input gathered in that order,
  each thread its own copy.
- ``RADIXSERVE_NATIVE_STEP=0`` turns it off (the torch step for every decode, as before);
  ``RADIXSERVE_NATIVE_BF16=0`` only for bf16 weights (the fallback a CPU without AVX512_BF16 takes).
- Numbers: fp32 and GGUF weights: fp32 arithmetic in another summation order, equal to the reference
  within fp32 rounding (``tests/model/test_native_step.py``: 1e-4, and greedy token-identical on the
  real model). bf16 weights (``--dtype bfloat16``, approximate): each product's activations rounded to
  bf16 and multiplied by the bf16 weights with fp32 sums, everything between the products in fp32 (the
  torch bf16 model rounds each activation to bf16); within a stated bound of the torch bf16 step, and
  no further from fp32 than it (``tests/model/test_native_step_bf16.py``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Protocol

import torch

from radixserve.cache.page_pool import KVPool
from radixserve.kernels import gguf_int8
from radixserve.model.gguf_blocks import TYPE_NAMES
from radixserve.model.layers import NATIVE_BF16
from radixserve.model.llama import DecoderLayer, LlamaForCausalLM
from radixserve.model.model_config import ModelConfig

logger = logging.getLogger("radixserve.model")

ENV = "RADIXSERVE_NATIVE_STEP"
BF16_ENV = "RADIXSERVE_NATIVE_BF16"  # "0": bf16 weights run in torch, as on a CPU without AVX512_BF16
MAX_ROWS = 8  # the kernel's most rows (its products' register tiles)
ISAS = ("AVX512", "AVX2")  # builds whose vector kernels the step is written for
KV_DTYPES = (torch.float32, torch.bfloat16)
EMPTY = torch.empty(0)


def _layers(model: LlamaForCausalLM) -> list[DecoderLayer]:
    layers = [m for m in model.layers if isinstance(m, DecoderLayer)]
    assert len(layers) == len(model.layers)
    return layers


def _streams(layer: DecoderLayer, cfg: ModelConfig) -> list[tuple[torch.nn.Module, int, int]]:
    """The weights the kernel streams for one layer, in its order (q, k, v, o, gate, up, down): each
    a linear and its output rows ``[start, end)``. A fused projection is streamed by its parts, so its
    parts may be of different GGUF types (llama.cpp's k-quant mixes give attn_v more bits)."""
    attn, mlp = layer.self_attn, layer.mlp
    q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    qkv, gate_up = attn.qkv_proj, mlp.gate_up_proj
    return [
        (qkv, 0, q),
        (qkv, q, q + kv),
        (qkv, q + kv, q + 2 * kv),
        (attn.o_proj, 0, cfg.hidden_size),
        (gate_up, 0, inter),
        (gate_up, inter, 2 * inter),
        (mlp.down_proj, 0, cfg.hidden_size),
    ]


def _input_order(m: torch.nn.Module) -> torch.Tensor:
    """A linear's input order (GPTQ act-order on GGUF blocks: its column j is input channel order[j]),
    empty where it takes its input as it is."""
    order = getattr(m, "input_order", None)
    return EMPTY if order is None else order


def _native_rows(m: torch.nn.Module, start: int, end: int) -> tuple[torch.Tensor, int] | None:
    """What the kernel streams of rows ``[start, end)`` of a linear (its ``native_rows``), None where
    it has none."""
    rows = getattr(m, "native_rows", None)
    return None if rows is None else rows(start, end)  # type: ignore[no-any-return]


def _outliers(m: torch.nn.Module, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The outlier channels of rows ``[start, end)`` of a linear and their fp32 columns
    ``[channels, end - start]`` (model/outliers.py), or two empty tensors where it has none."""
    for (first, last), pair in zip(getattr(m, "group_rows", []), getattr(m, "outliers", [])):
        if pair is not None and first <= start and end <= last:
            channels, columns = pair
            return channels, columns[:, start - first : end - first].contiguous()
    return EMPTY, EMPTY


def bf16_dot_here() -> bool:
    """Whether the kernels take bf16 weights on this CPU: an AVX-512 build where the CPU reports
    AVX512_BF16 (the op asks the CPU itself; the kernels must be loaded)."""
    return bool(torch.ops.radixserve_cpu.decode_step_bf16())


def unsupported(model: LlamaForCausalLM, pool: KVPool) -> str | None:
    """Why the native step cannot run ``model`` over ``pool`` here (None: it can)."""
    if os.environ.get(ENV, "1") == "0":
        return f"{ENV}=0"
    from radixserve.kernels import cpu_build

    if not cpu_build.load():
        return "the C++ CPU kernels are unavailable"
    if cpu_build.isa() not in ISAS:
        return f"this CPU has neither AVX-512 nor AVX2 (torch reports {cpu_build.isa()})"
    if getattr(pool, "shards", 1) != 1:
        return "the pool is sharded over ranks (tensor parallel)"
    if pool.dtype not in KV_DTYPES:
        return f"K/V pages of {str(pool.dtype).removeprefix('torch.')} (it takes float32 and bfloat16)"
    cfg = model.config
    if cfg.head_dim % 16 or cfg.num_heads % cfg.num_kv_heads or cfg.num_heads // cfg.num_kv_heads > 8:
        return f"head_dim {cfg.head_dim} with {cfg.num_heads}/{cfg.num_kv_heads} heads"
    kinds = set()
    for layer in _layers(model):
        for m, start, end in _streams(layer, cfg):
            weight = _native_rows(m, start, end)
            if weight is None:
                qtypes = getattr(m, "qtypes", [])
                if len(qtypes) > 1:
                    names = ", ".join(TYPE_NAMES.get(q, str(q)) for q in qtypes)
                    return f"rows {start}-{end} of a fused GGUF projection span several types ({names})"
                return f"a decoder linear held as {type(m).__name__} of a format it does not stream"
            kinds.add(weight[1])
    if any(k >= gguf_int8.TILES_KIND for k in kinds) and cfg.head_dim % gguf_int8.TILE_ROWS:
        return f"int8 tiles need head_dim a multiple of {gguf_int8.TILE_ROWS} (it is {cfg.head_dim})"
    if NATIVE_BF16 in kinds:
        if os.environ.get(BF16_ENV, "1") == "0":
            return f"{BF16_ENV}=0 (bf16 weights)"
        if not bf16_dot_here():
            return "bf16 weights need AVX512_BF16 (vdpbf16ps), which this CPU does not report"
    if model.embed_tokens.weight.device.type != "cpu":
        return "the model is not on CPU"
    return None


class NativeStep:
    """The decoder layers of ``model`` as one native call per decode step; ``create`` to make one."""

    def __init__(self, model: LlamaForCausalLM, pool: KVPool) -> None:
        self.model, self.pool = model, pool
        cfg = model.config
        weights: list[torch.Tensor] = []
        kinds: list[int] = []
        outliers: list[torch.Tensor] = []
        for layer in _layers(model):
            attn = layer.self_attn
            stream = [_native_rows(m, start, end) for m, start, end in _streams(layer, cfg)]
            assert all(w is not None for w in stream), "checked by unsupported()"
            (q, k, v, o, gate, up, down), layer_kinds = zip(*stream)  # type: ignore[misc]
            bias = attn.qkv_proj.bias
            weights += [
                layer.input_layernorm.weight.detach().float().contiguous(),
                q,
                k,
                v,
                EMPTY if bias is None else bias.detach().float().contiguous(),
                EMPTY if attn.q_norm is None else attn.q_norm.weight.detach().float().contiguous(),
                EMPTY if attn.k_norm is None else attn.k_norm.weight.detach().float().contiguous(),
                o,
                layer.post_attention_layernorm.weight.detach().float().contiguous(),
                gate,
                up,
                down,
                *(
                    _input_order(m)
                    for m in (attn.qkv_proj, attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
                ),
            ]
            kinds += layer_kinds
            for (m, start, end), kind in zip(_streams(layer, cfg), layer_kinds):
                pair = _outliers(m, start, end) if kind >= gguf_int8.TILES_KIND else (EMPTY, EMPTY)
                outliers += pair
        self.weights, self.kinds, self.outliers = weights, kinds, outliers
        self.k_caches = [c.k for c in pool.layers]
        self.v_caches = [c.v for c in pool.layers]
        self.shape = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.intermediate_size,
            cfg.rms_norm_eps,
            cfg.head_dim**-0.5,
        )
        self.op = torch.ops.radixserve_cpu.decode_step
        self.dtype = model.norm.weight.dtype  # the residual stream's in the torch model (bf16 weights: bf16)

    @classmethod
    def create(cls, model: LlamaForCausalLM, pool: KVPool) -> NativeStep | None:
        """The native step for ``model`` over ``pool``, or None after one log line saying why not (a
        WARNING where the CPU lacks the instructions, else INFO: a format it does not cover is a choice)."""
        why = unsupported(model, pool)
        if why is None:
            logger.info("decode steps of 1-%d rows run as one native call per step (native_step)", MAX_ROWS)
            return cls(model, pool)
        level = logging.WARNING if "AVX" in why else logging.INFO
        logger.log(level, "native decode step off: %s; decode steps run the torch model", why)
        return None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        page_table: torch.Tensor,
        seq_lens: torch.Tensor,
        slots: torch.Tensor,
    ) -> torch.Tensor:
        """Final hidden states ``[B, hidden]`` of B decode tokens (``positions``), writing their K/V into
        ``slots`` of the pool; ``page_table [B, W]`` int32 and ``seq_lens [B]`` int32 (with the new token)."""
        x = self.model.embed_tokens(input_ids).float().contiguous()
        cos, sin = self.model.rotary.table(positions)
        heads, kv_heads, head_dim, inter, eps, scale = self.shape
        out: torch.Tensor = self.op(
            x,
            cos.contiguous(),
            sin.contiguous(),
            self.weights,
            self.kinds,
            self.outliers,
            self.k_caches,
            self.v_caches,
            page_table,
            seq_lens,
            slots,
            heads,
            kv_heads,
            head_dim,
            inter,
            eps,
            scale,
        )
        # The final norm and the LM head in the model's dtype, as its own forward runs them.
        hidden: torch.Tensor = self.model.norm(out.to(self.dtype))
        return hidden


class StepChunk(Protocol):
    """What ``covers`` reads of a step's sequence (the runner's ``SeqChunk``)."""

    @property
    def num_new(self) -> int: ...
    @property
    def want_all_logits(self) -> bool: ...


def covers(chunks: Sequence[StepChunk]) -> bool:
    """Whether a step of ``chunks`` is one the native step runs: 1 to MAX_ROWS sequences decoding one
    token each, none asking for the logits of all its positions (prompt logprobs, drafts)."""
    if not 1 <= len(chunks) <= MAX_ROWS:
        return False
    for c in chunks:  # noqa: SIM110 (a loop: a generator in all() is a call per row, every step)
        if c.num_new != 1 or c.want_all_logits:
            return False
    return True
