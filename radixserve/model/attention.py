"""Paged attention over the KV pool, behind one stated contract: ``AttentionBackend``.

A backend runs a step's attention over the pool's pages and copies pages for the tiers. Three are
registered (``REGISTRY``): ``torch`` (the pure-torch reference, ``kernels/reference.py``, the ground
truth), ``cpu`` (the C++ kernels, ``kernels/cpu.py``, built on first use when the backend is made)
and ``triton`` (CUDA, ``kernels/ops.py``, imported only when asked for). ``select_backend`` picks one
for a device; the engine makes one per process and hands the same object to the runner (attention)
and the tier controller (page copies).

One step's tokens are flattened: the extend sequences (prefill chunks) come first, then the decode
sequences (one token each). The plan (``plan_step``) holds the step's index work (which pages each
sequence reads, masks, work lists), done once and reused by every layer. Attention stores the
step's new K/V into their slots, then every new token reads its sequence's context through the page
table, in whatever way is fastest on the backend's hardware (one ragged op on CPU, an extend and a
decode kernel on CUDA).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import ClassVar, Protocol, TypeAlias, runtime_checkable

import torch

from radixserve.kernels import cpu, reference
from radixserve.kernels.kv_dtype import KV_DTYPES, LayerCache
from radixserve.kernels.parts import PartsPlan

# A step's plan: the C++ kernels' one ragged work list, or an extend and a decode part (reference, Triton).
StepPlan: TypeAlias = cpu.StepPlan | PartsPlan


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: where each new token's K/V goes (negative: nowhere)
    plan: StepPlan  # the backend's plan_step(...) of this step, made once and read by every layer


@runtime_checkable
class AttentionBackend(Protocol):
    """The seam between the model and the kernels. Layouts are those of ``kernels/reference.py``.

    Invariants: a backend holds no per-step state (the plan carries it), so one object serves every
    layer, step and thread; each method works on tensors of the device it was selected for.
    """

    name: ClassVar[str]
    compilable: ClassVar[bool]
    """Whether ``attention`` (with ``plan``'s tensors as inputs) traces under ``torch.compile`` with
    ``fullgraph=True``: only real torch ops, with fake kernels, and no host syncs. The engine captures
    the model step only with such a backend (``model/compiled.py``)."""
    kv_dtypes: ClassVar[tuple[str, ...]]
    """The KV cache dtypes (``kernels/kv_dtype.py``) whose pages ``attention`` reads and writes."""

    def plan_step(
        self,
        page_table: torch.Tensor,
        cu_q_lens: torch.Tensor,
        seq_lens: torch.Tensor,
        num_extend: int,
        page_size: int,
    ) -> StepPlan:
        """Plan a step once, before its first layer: ``page_table [B, W]`` int32, ``cu_q_lens [B + 1]``
        int32 (sequence b's new tokens are rows ``cu_q_lens[b]:cu_q_lens[b + 1]``), ``seq_lens [B]`` int32
        (cached plus new tokens), sequences ``[0, num_extend)`` extend and the rest decode one token."""
        ...

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: LayerCache,
        slot_mapping: torch.Tensor,
        plan: StepPlan,
        scale: float,
    ) -> torch.Tensor:
        """One layer's attention of the planned step: store the new ``k``/``v [T, kv_heads, head_dim]``
        into ``slot_mapping``'s slots of ``cache`` (negative slots skipped; int8 pages quantized with
        their scales), then attend ``q [T, q_heads, head_dim]`` causally over each sequence's context
        -> ``[T, q_heads, head_dim]`` in q's dtype, accumulated in fp32."""
        ...

    def attention_arithmetic(self, kv_dtype: str) -> str:
        """How ``attention``'s many-row (prefill, extend) work over ``kv_dtype`` pages multiplies:
        "fp32", or "bf16" (q and the probabilities rounded to bf16: other outputs, so other K/V in
        later layers, which the disk tier's key includes)."""
        ...

    def gather_pages(self, buffer: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
        """Copy ``pages`` of every layer out of a pool buffer ``[num_layers, num_pages, ...]`` (K, V or
        their int8 scales) into a new contiguous ``[num_layers, len(pages), ...]``: the tiers' page copies."""
        ...

    def scatter_pages(self, buffer: torch.Tensor, pages: torch.Tensor, src: torch.Tensor) -> None:
        """The inverse of ``gather_pages``: write ``src`` into ``pages`` of every layer of ``buffer``."""
        ...


class KernelsBackend:
    """A backend over a kernels module (``ops``) whose functions have the reference's names and
    signatures: every method hands its call to the module, with the layer's int8 scales as keywords.
    The subclasses only say which module, what it needs first, and what it takes."""

    name: ClassVar[str]
    compilable: ClassVar[bool] = False
    kv_dtypes: ClassVar[tuple[str, ...]] = KV_DTYPES
    plan_type: ClassVar[type] = PartsPlan  # what this module's plan_step makes
    ops: ModuleType

    def plan_step(
        self,
        page_table: torch.Tensor,
        cu_q_lens: torch.Tensor,
        seq_lens: torch.Tensor,
        num_extend: int,
        page_size: int,
    ) -> StepPlan:
        plan: StepPlan = self.ops.plan_step(page_table, cu_q_lens, seq_lens, num_extend, page_size)
        return plan

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: LayerCache,
        slot_mapping: torch.Tensor,
        plan: StepPlan,
        scale: float,
    ) -> torch.Tensor:
        assert isinstance(plan, self.plan_type), "a plan made by another backend"
        out: torch.Tensor = self.ops.attention(
            q, k, v, cache.k, cache.v, slot_mapping, plan, scale, k_scale=cache.k_scale, v_scale=cache.v_scale
        )
        return out

    def attention_arithmetic(self, kv_dtype: str) -> str:
        return "fp32"

    def gather_pages(self, buffer: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.ops.gather_pages(buffer, pages)
        return out

    def scatter_pages(self, buffer: torch.Tensor, pages: torch.Tensor, src: torch.Tensor) -> None:
        self.ops.scatter_pages(buffer, pages, src)


class TorchBackend(KernelsBackend):
    """The pure-torch reference kernels: any device, every KV dtype; eager only (host-side plans)."""

    name: ClassVar[str] = "torch"
    ops = reference


class CpuBackend(KernelsBackend):
    """The C++ kernels on CPU tensors (pages read in place, one ragged op per layer); compilable.
    Making one builds or loads the ops (``cpu.ensure_loaded``), RuntimeError where they cannot be.
    Its page copies are the reference's (``kernels/cpu.py`` re-exports them)."""

    name: ClassVar[str] = "cpu"
    compilable: ClassVar[bool] = True  # real torch ops with fake kernels (kernels/cpu_build.py)
    plan_type: ClassVar[type] = cpu.StepPlan
    ops = cpu

    def __init__(self) -> None:
        cpu.ensure_loaded()

    def attention_arithmetic(self, kv_dtype: str) -> str:
        return "bf16" if kv_dtype == "bfloat16" and cpu.bf16_attention() else "fp32"


class TritonBackend(KernelsBackend):
    """The Triton kernels on CUDA (device-side plans). Triton is imported when one is made."""

    name: ClassVar[str] = "triton"

    def __init__(self) -> None:
        from radixserve.kernels import ops

        self.ops = ops


REGISTRY: dict[str, Callable[[], AttentionBackend]] = {
    "torch": TorchBackend,
    "cpu": CpuBackend,
    "triton": TritonBackend,
}
BACKENDS = ("auto", *REGISTRY)  # the attention_backend knob's choices
_made: dict[str, AttentionBackend] = {}  # one object per backend and process


def get_backend(name: str) -> AttentionBackend:
    """The registered backend ``name``, made on first use (building what it needs) and then reused."""
    if name not in REGISTRY:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {name!r}")
    if name not in _made:
        _made[name] = REGISTRY[name]()
    return _made[name]


def select_backend(name: str, device: torch.device) -> AttentionBackend:
    """The backend for ``device``: ``auto`` picks Triton on CUDA, else the C++ CPU kernels (``cpu``),
    built on first use, or the torch reference (``torch``) where they cannot be built (logged once)."""
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {name!r}")
    if name == "torch":
        return get_backend("torch")
    if name == "triton" or (name == "auto" and device.type == "cuda"):
        return get_backend("triton")
    if device.type != "cpu":
        raise ValueError(f"the cpu attention backend runs on CPU tensors, not {device.type}")
    from radixserve.kernels import cpu_build

    if not cpu_build.load():  # no compiler, or the build failed: one warning, then the reference
        return get_backend("torch")
    return get_backend("cpu")


def paged_attention(
    backend: AttentionBackend,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: LayerCache,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """``q [T, Hq, D]``, ``k``/``v [T, Hkv, D]`` of the step's new tokens -> attention output ``[T, Hq, D]``;
    their K/V go into one layer's ``cache`` first."""
    return backend.attention(q, k, v, cache, meta.slot_mapping, meta.plan, scale)


def check_dtypes(
    backend: AttentionBackend, kv_dtype: str, device: torch.device, dtypes: tuple[str, ...]
) -> None:
    """Refuse what ``backend``'s kernels would get wrong, with a message that names the way out:
    - a KV dtype asked for (``kv_dtype``) that they do not take (``kv_dtypes``); ``auto`` (the model's
      dtype) is not refused: a dtype the kernels lack runs the reference;
    - Triton on CPU tensors (Triton's interpreter) with bfloat16 among ``dtypes`` (the model's and the
      KV pool's): the interpreter's ``tl.dot`` over bfloat16 operands returns wrong values (triton
      3.7.1, ``tests/kernels/test_kernel_engine.py`` checks it still does), so the tokens would be
      garbage. On CUDA the same kernels are right (``tests/kernels/test_kernel_gpu.py``)."""
    if kv_dtype != "auto" and kv_dtype not in backend.kv_dtypes:
        raise ValueError(
            f"kv_cache_dtype {kv_dtype} is not taken by the {backend.name} attention backend "
            f"(it takes {', '.join(backend.kv_dtypes)})"
        )
    if backend.name == "triton" and device.type == "cpu" and "bfloat16" in dtypes:
        raise ValueError(
            "the triton attention backend on CPU runs in Triton's interpreter, whose dots over bfloat16 "
            "are wrong: use dtype and kv_cache_dtype float32 with it, or the cpu or torch backend"
        )
