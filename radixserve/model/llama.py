"""Llama-family decoder (Llama, Mistral, Qwen2 with qkv bias, Qwen3 with q/k norm) over the paged KV pool.

The model sees a flat batch of new tokens and an AttentionMetadata; it knows nothing of requests.
Each decoder layer is handed its own K/V cache tensors (views of the pool made outside the layer)
and nothing that tells layers apart, so all layers are one function of their inputs: compiled
once, that function serves every layer (``model/compiled.py``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from radixserve.cache.page_pool import KVPool
from radixserve.kernels.kv_dtype import LayerCache
from radixserve.model.attention import AttentionBackend, AttentionMetadata, paged_attention
from radixserve.model.layers import Linear, RMSNorm, RotaryEmbedding, SwiGLU, apply_rotary
from radixserve.model.model_config import ModelConfig

Rope = tuple[torch.Tensor, torch.Tensor]  # cos and sin [T, head_dim / 2] of the step's positions
# HF's separate projections and the fused matrix (and part) each one fills.
FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def target_of(hf_name: str) -> tuple[str, tuple[str, int] | None]:
    """The model's name for the HF tensor (or module) ``hf_name``, and for a part of a fused matrix its
    fused module's local name and part: ``model.layers.0.self_attn.k_proj.weight`` ->
    ``("layers.0.self_attn.qkv_proj.weight", ("qkv_proj", 1))``."""
    name = hf_name.removeprefix("model.")
    for part, (target, shard) in FUSED.items():
        if f".{part}." in f"{name}.":
            return name.replace(part, target), (target, shard)
    return name, None


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = cfg.head_dim**-0.5

    def forward(
        self,
        x: torch.Tensor,
        rope: Rope,
        meta: AttentionMetadata,
        cache: LayerCache,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        q, k, v = self.qkv(x, rope)
        out = paged_attention(backend, q, k, v, cache, meta, self.scale)
        return self.o_proj(out.reshape(-1, self.q_size))

    def qkv(self, x: torch.Tensor, rope: Rope) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x [T, hidden]`` -> q ``[T, Hq, D]``, k and v ``[T, Hkv, D]``, q and k rotated to their
        positions (also what the document blend, ``model/blend.py``, projects with)."""
        qk, v = self.qkv_proj(x).split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        qk = qk.view(-1, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)
        # q and k are adjacent in the fused projection, so one rotation serves both.
        q, k = apply_rotary(qk, *rope).split([self.num_heads, self.num_kv_heads], dim=1)
        return q, k, v.view(-1, self.num_kv_heads, self.head_dim)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def forward(
        self,
        x: torch.Tensor,
        rope: Rope,
        meta: AttentionMetadata,
        cache: LayerCache,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, meta, cache, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    quantization: str | None = None  # "int8": the decoder Linears are int8 (model/quant.py)
    checkpoint_quantization: str | None = None  # a quantized HF checkpoint's scheme (model/hf_quant.py)
    arithmetic: str = "exact"  # of products with many rows (model/arithmetic.py)
    decode_arithmetic: str = "exact"  # of decode steps too (model/arithmetic.py: int8 over GGUF blocks)
    bf16_copy: bool = False  # bfloat16 over GGUF blocks multiplies dense bf16 copies (model/arithmetic.py)
    # of many-row attention over the K/V pages: the backend's ``attention_arithmetic`` (engine/builder.py)
    attention_arithmetic: str = "fp32"
    outlier_channels: int = 0  # of int8 products over GGUF blocks, multiplied in fp32 (model/outliers.py)

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.rotary = RotaryEmbedding(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling
        )
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        pool: KVPool,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """Flat new tokens ``[T]`` -> final hidden states ``[T, hidden]``, writing their K/V into ``pool``."""
        x = self.embed_tokens(input_ids)
        rope = self.rotary.table(positions)
        for layer, cache in zip(self.layers, pool.layers):
            x = layer(x, rope, meta, cache, backend)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def prepack(self) -> None:
        """Make the CPU matmul copies of every Linear weight (see ``layers.Linear``), and pick each
        int8 Linear's kernel (``quant.Int8Linear``); after loading."""
        for m in self.modules():
            prepack = getattr(m, "prepack", None)
            if prepack is not None and m is not self:
                prepack()

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], skip: frozenset[str] = frozenset()
    ) -> None:
        """Load HF-named tensors, packing q/k/v and gate/up into their fused matrices. Tensors bound for
        a parameter named in ``skip`` (e.g. ``layers.0.mlp.down_proj.weight``) are passed over: their
        module gets them elsewhere (an int8 copy, ``model/quant.py``)."""
        params = dict(self.named_parameters())
        seen: set[str] = set()
        for hf_name, tensor in weights:
            name, fused = target_of(hf_name)
            if "rotary_emb" in name or (name == "lm_head.weight" and self.config.tie_word_embeddings):
                continue
            if fused is not None:
                if name not in skip:
                    self._fused_slice(params[name], *fused).copy_(tensor)
            else:
                if name in skip:
                    continue
                if name not in params:
                    raise ValueError(f"unexpected weight {hf_name!r} in checkpoint")
                params[name].data.copy_(tensor)
            seen.add(name)
        tied = {"lm_head.weight"} if self.config.tie_word_embeddings else set()
        missing = set(params) - seen - skip - tied
        if missing:
            raise ValueError(f"checkpoint lacks weights: {sorted(missing)[:5]}")

    def _fused_slice(self, param: torch.Tensor, target: str, shard: int) -> torch.Tensor:
        """The rows of the fused ``param`` (or any tensor with its rows) that part ``shard`` fills."""
        cfg = self.config
        if target == "qkv_proj":
            sizes = [
                cfg.num_heads * cfg.head_dim,
                cfg.num_kv_heads * cfg.head_dim,
                cfg.num_kv_heads * cfg.head_dim,
            ]
        else:
            sizes = [cfg.intermediate_size, cfg.intermediate_size]
        start = sum(sizes[:shard])
        return param.data.narrow(0, start, sizes[shard])
