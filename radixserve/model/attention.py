"""Paged attention over the KV pool, behind one small backend interface.

A backend is any object with the functions of ``radixserve.kernels.reference`` (store_kv,
plan_decode, decode_attention, plan_extend, extend_attention, gather_pages, scatter_pages), all with
the same signatures: the C++ kernels (``radixserve.kernels.cpu``) on CPU, the torch reference where
they cannot be built, the Triton kernels on CUDA. The plans hold the index work of one step (which
pages each sequence reads, masks, work lists), done once and reused by every layer.

One step's tokens are flattened: the extend sequences (prefill chunks) come first, then the decode
sequences (one token each). Attention stores the step's new K/V into their slots, then each part
reads its whole context through the page table.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from radixserve.kernels import reference

BACKENDS = ("auto", "torch", "cpu", "triton")


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: where each new token's K/V goes
    num_extend_tokens: int  # rows [0, num_extend_tokens) belong to extend sequences
    extend_page_table: torch.Tensor  # [B_ext, max_pages] int32
    extend_cu_q_lens: torch.Tensor  # [B_ext + 1] int32
    extend_seq_lens: torch.Tensor  # [B_ext] int32, new tokens included
    decode_page_table: torch.Tensor  # [B_dec, max_pages] int32
    decode_seq_lens: torch.Tensor  # [B_dec] int32, the new token included
    extend_plan: object = None  # the backend's plan_extend(...) of this step
    decode_plan: object = None  # the backend's plan_decode(...) of this step

    @property
    def num_decode(self) -> int:
        return int(self.decode_seq_lens.shape[0])


def select_backend(name: str, device: torch.device) -> ModuleType:
    """The kernels for ``device``: ``auto`` picks Triton on CUDA, else the C++ CPU kernels (``cpu``),
    built on first use, or the torch reference (``torch``) where they cannot be built (logged once)."""
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {name!r}")
    if name == "torch":
        return reference
    if name == "triton" or (name == "auto" and device.type == "cuda"):
        from radixserve.kernels import ops  # Triton is imported only when asked for

        return ops
    if device.type != "cpu":
        raise ValueError(f"the cpu attention backend runs on CPU tensors, not {device.type}")
    from radixserve.kernels import cpu_build

    if not cpu_build.load():  # no compiler, or the build failed: one warning, then the reference
        return reference
    from radixserve.kernels import cpu

    return cpu


def paged_attention(
    backend: ModuleType,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """``q [T, Hq, D]``, ``k``/``v [T, Hkv, D]`` of the step's new tokens -> attention output ``[T, Hq, D]``."""
    backend.store_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    n_ext = meta.num_extend_tokens
    if meta.num_decode == 0:
        return backend.extend_attention(
            q, k_cache, v_cache, meta.extend_page_table, meta.extend_cu_q_lens, meta.extend_seq_lens, scale,
            plan=meta.extend_plan,
        )  # fmt: skip
    if n_ext == 0:
        return backend.decode_attention(
            q, k_cache, v_cache, meta.decode_page_table, meta.decode_seq_lens, scale, plan=meta.decode_plan
        )
    out = torch.empty_like(q)
    out[:n_ext] = backend.extend_attention(
        q[:n_ext],
        k_cache,
        v_cache,
        meta.extend_page_table,
        meta.extend_cu_q_lens,
        meta.extend_seq_lens,
        scale,
        plan=meta.extend_plan,
    )
    out[n_ext:] = backend.decode_attention(
        q[n_ext:],
        k_cache,
        v_cache,
        meta.decode_page_table,
        meta.decode_seq_lens,
        scale,
        plan=meta.decode_plan,
    )
    return out
