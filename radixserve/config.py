"""EngineConfig: every knob of the engine, validated once."""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields
from typing import Any

from radixserve.cache.tier_controller import WRITE_POLICIES
from radixserve.engine.policy import POLICIES
from radixserve.model.attention import BACKENDS

EVICTION_POLICIES = ("lru", "lfu", "priority")

logger = logging.getLogger("radixserve.engine")


@dataclass
class EngineConfig:
    model: str | None = None  # a local HF folder; None serves the embedded default (SmolLM2-135M-Instruct)
    device: str = "auto"  # "auto": cuda when available, else cpu
    dtype: str = "auto"  # "auto": float32 on CPU (no bf16 instructions here), bfloat16 on CUDA
    page_size: int = 16
    kv_cache_gb: float = 1.0
    num_pages: int | None = None  # overrides kv_cache_gb (tests use tiny pools)
    max_running_requests: int = 64
    # Per-step token budget; longer prefills are chunked. None: 512 on CPU, where a step's time grows
    # with its tokens and a 512-token chunk already runs the matmuls at full speed, so running decodes
    # stall for at most one such chunk; 8192 on CUDA.
    max_batched_tokens: int | None = None
    max_model_len: int | None = None  # default: the model's context length
    max_waiting_requests: int = 1024
    prefix_cache: bool = True
    schedule_policy: str = "lpm"
    eviction_policy: str = "lru"
    attention_backend: str = "auto"
    # Run the model step eagerly instead of as a compiled graph (model/capture.py), which is used
    # where the attention backend allows it (the C++ CPU kernels) and a C++ compiler is found.
    enforce_eager: bool = False
    aging_s: float = 30.0  # waiting this long is worth one priority level
    jump_forward: bool = False  # append grammar-forced tokens without a decode step each (may change outputs)
    debug_checks: bool = False  # check every cache invariant whenever the engine goes idle
    # False: outputs carry token ids only (text None) and stop strings are left to the caller, who
    # detokenizes; the server's engine process runs so, its front-end makes the text.
    detokenize: bool = True
    # Tiers beneath the device pool (docs/cache.md); 0 GB means no such tier.
    host_cache_gb: float = 0.0
    # 0 with a disk_cache_dir: 10% of the free space on its filesystem, at most 64 GiB (docs/cache.md)
    disk_cache_gb: float = 0.0
    disk_cache_dir: str | None = None  # survives restarts; entries of another model are deleted
    write_policy: str = "write_through"  # write_through | write_through_selective | write_back
    write_through_threshold: int = 2  # hits before write_through_selective copies a node down

    def __post_init__(self) -> None:
        if not 1 <= self.page_size <= 64:
            raise ValueError(f"page_size must be in [1, 64], got {self.page_size}")
        if self.kv_cache_gb <= 0:
            raise ValueError(f"kv_cache_gb must be > 0, got {self.kv_cache_gb}")
        if self.num_pages is not None and self.num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {self.num_pages}")
        if self.max_running_requests < 1:
            raise ValueError(f"max_running_requests must be >= 1, got {self.max_running_requests}")
        if self.max_batched_tokens is not None and self.max_batched_tokens < 1:
            raise ValueError(f"max_batched_tokens must be >= 1, got {self.max_batched_tokens}")
        if self.schedule_policy not in POLICIES:
            raise ValueError(f"schedule_policy must be one of {POLICIES}, got {self.schedule_policy!r}")
        if self.eviction_policy not in EVICTION_POLICIES:
            raise ValueError(
                f"eviction_policy must be one of {EVICTION_POLICIES}, got {self.eviction_policy!r}"
            )
        if self.attention_backend not in BACKENDS:
            raise ValueError(f"attention_backend must be one of {BACKENDS}, got {self.attention_backend!r}")
        if self.host_cache_gb < 0 or self.disk_cache_gb < 0:
            raise ValueError("host_cache_gb and disk_cache_gb must be >= 0")
        if self.disk_cache_gb > 0 and not self.disk_cache_dir:
            raise ValueError("a disk tier (disk_cache_gb > 0) needs disk_cache_dir")
        if self.write_policy not in WRITE_POLICIES:
            raise ValueError(f"write_policy must be one of {WRITE_POLICIES}, got {self.write_policy!r}")
        if self.write_through_threshold < 1:
            raise ValueError(f"write_through_threshold must be >= 1, got {self.write_through_threshold}")
        if self.dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise ValueError(f"dtype must be auto, float32, float16 or bfloat16, got {self.dtype!r}")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(kwargs) - known
        if unknown:
            raise TypeError(f"unknown engine option(s): {', '.join(sorted(unknown))}")
        return cls(**kwargs)


def context_within_pool(max_model_len: int, configured: bool, num_pages: int, page_size: int) -> int:
    """The context length to serve: one request of ``max_model_len`` tokens must fit in the KV pool, so
    that a request that omits max_tokens can always run to its end. A ``configured`` length that does
    not fit is refused (ValueError naming the flags to change); the model's own is lowered, with a warning."""
    pool_tokens = num_pages * page_size
    if pool_tokens >= max_model_len:
        return max_model_len
    if configured:
        raise ValueError(
            f"max_model_len {max_model_len} (--max-model-len) needs {-(-max_model_len // page_size)} KV pages of "
            f"{page_size} tokens, but the pool has {num_pages}: raise --kv-cache-gb or --num-pages, or lower "
            f"--max-model-len to at most {pool_tokens}"
        )  # fmt: skip
    logger.warning(
        "the KV pool (%d pages of %d tokens) holds fewer tokens than the model's context of %d: max_model_len "
        "lowered to %d (raise --kv-cache-gb or --num-pages to serve the whole context)",
        num_pages, page_size, max_model_len, pool_tokens,
    )  # fmt: skip
    return pool_tokens
