"""EngineConfig: every knob of the engine, declared (help, choices, range) and validated once."""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields
from typing import Any

from radixserve.cache.tier_controller import WRITE_POLICIES
from radixserve.kernels.kv_dtype import KV_DTYPES
from radixserve.knobs import knob, problems
from radixserve.model.arithmetic import ARITHMETICS, DECODE_ARITHMETICS
from radixserve.model.attention import BACKENDS
from radixserve.model.quant import QUANTIZATIONS
from radixserve.presets import PRESETS, apply_preset

# The names only: engine/policy.py orders by them (the engine imports this module, never the reverse).
SCHEDULE_POLICIES = ("fcfs", "lpm", "dfs-weight")
EVICTION_POLICIES = ("lru", "lfu", "priority")
DTYPES = ("auto", "float32", "float16", "bfloat16")

logger = logging.getLogger("radixserve.engine")


@dataclass
class EngineConfig:
    """Each field's help, choices and range (``knob``) also make its ``radixserve serve`` flag
    (``--page-size`` for ``page_size``; knobs.py), so the flag, its help and its check cannot drift apart."""

    model: str | None = knob(None, "local HF model folder (default: the embedded SmolLM2-135M-Instruct)")
    device: str = knob("auto", "auto: cuda when available, else cpu")
    # float32 on CPU: this CPU has no bf16 instructions.
    dtype: str = knob("auto", "auto: float32 on CPU, bfloat16 on CUDA", choices=DTYPES)
    # int8: the decoder layers' linear weights as int8 with per-channel scales, on CPU (model/quant.py).
    # Approximate: benchmarks/step/mode_bench.py measures its agreement with fp32 beside its speed.
    # gguf: a GGUF file's own blocks through the C++ gguf_linear op (model/gguf.py); exact, and the
    # default for a .gguf model.
    quantization: str | None = knob(
        None,
        "weight quantization (default: none, the checkpoint's weights)",
        choices=(*QUANTIZATIONS, "gguf"),
    )
    # Cheaper products for steps with more rows than max_running_requests (prefill, extend, long
    # verifications; model/arithmetic.py); decode-only steps stay exact. Approximate: accuracy in
    # tests/model/test_arithmetic.py and benchmarks/step/step_bench.py.
    prefill_arithmetic: str = knob(
        "exact",
        "arithmetic of many-row steps (prefill): exact, int8, bfloat16 (where the CPU runs it), auto",
        choices=ARITHMETICS,
    )
    # int8 for decode steps too, over GGUF blocks (llama.cpp's arithmetic; model/arithmetic.py): the
    # blocks' values stored once as int8 tiles, every product of them int8. Approximate.
    decode_arithmetic: str = knob(
        "exact",
        "arithmetic of decode steps over GGUF weights: exact, or int8 (every step then; needs AVX512-VNNI)",
        choices=DECODE_ARITHMETICS,
    )
    # One flag for a measured combination of the knobs above (presets.py); knobs given explicitly win.
    preset: str | None = knob(
        None,
        "exact (default) or fast: the fastest combination measured for this CPU and model at no worse "
        "top-1 than vLLM bf16 (docs/architecture.md)",
        choices=PRESETS,
    )
    # Set once the preset's knobs are: a copy of the config (the server's engine process gets one)
    # must not resolve, and log, the preset again over knobs that now look given.
    preset_resolved: bool = knob(False, "the preset's knobs are already set", cli=False)
    page_size: int = knob(16, "tokens per KV page", ge=1, le=64, integer=True)
    # auto: the model's dtype (exact). bfloat16 halves the K/V bytes, int8 quarters them (plus a scale
    # per token and head); both approximate, measured in docs/kernels.md.
    kv_cache_dtype: str = knob(
        "auto", "KV cache dtype (auto: the model's, i.e. float32 on CPU)", choices=("auto", *KV_DTYPES)
    )
    kv_cache_gb: float = knob(1.0, "KV cache size in GiB", gt=0)
    num_pages: int | None = knob(None, "KV pages (overrides --kv-cache-gb)", ge=1, integer=True)
    max_running_requests: int = knob(64, "requests decoded together at most", ge=1, integer=True)
    # Per-step token budget; longer prefills are chunked. None: 512 on CPU, where a step's time grows
    # with its tokens and a 512-token chunk already runs the matmuls at full speed, so running decodes
    # stall for at most one such chunk; 8192 on CUDA.
    max_batched_tokens: int | None = knob(
        None,
        "tokens per step; longer prefills are chunked (default: 512 on CPU, 8192 on CUDA)",
        ge=1,
        integer=True,
    )
    max_model_len: int | None = knob(None, "context length (default: the model's)", ge=1, integer=True)
    max_waiting_requests: int = knob(1024, "beyond this, new requests get 429", ge=1, integer=True)
    # A server's bound on a request's wait for its first step (runtime/engine_loop.py): past it the
    # request gets a 429, as a full queue's would, instead of a client's timeout with no answer. Off by
    # default, as in vLLM and SGLang: a batch job may rightly wait long. Set it below the clients'
    # timeout (the soak, benchmarks/soak/soak.py, runs 60 s under its 90 s bound); docs/server.md.
    max_queue_wait_s: float = knob(
        0.0, "a request still unscheduled after this many seconds gets 429 (0: no limit)", ge=0
    )
    prefix_cache: bool = knob(True, "disable prefix caching")  # the flag is --no-prefix-cache
    schedule_policy: str = knob("lpm", "admission order of waiting requests", choices=SCHEDULE_POLICIES)
    eviction_policy: str = knob("lru", "which cached prefixes go first", choices=EVICTION_POLICIES)
    attention_backend: str = knob("auto", "attention kernels", choices=BACKENDS)
    # Run the model step eagerly instead of as a compiled graph (model/compiled.py), which is used
    # where the attention backend allows it (the C++ CPU kernels) and a C++ compiler is found.
    enforce_eager: bool = knob(False, "run the model step eagerly, not as a compiled graph")
    # CUDA graphs of decode-only steps at batch buckets 1, 2, 4, ..., 256 below max_running_requests and
    # that number itself, captured at start-up (model/cuda_graphs.py); on CUDA with the Triton backend.
    cuda_graphs: bool = knob(True, "capture no CUDA graphs: every decode step runs eagerly")
    # The overlapped loop (engine/overlap.py): step N+1 is scheduled and launched before step N's tokens
    # are read. "auto": on CUDA, where the device runs N+1 while the host reads N; off on CPU, where the
    # host is the device and it only delays each token by a step (measured: docs/benchmarks.md).
    overlap_schedule: str = knob(
        "auto",
        "schedule step N+1 before reading step N's tokens (auto: on CUDA only)",
        choices=("auto", "on", "off"),
    )
    aging_s: float = knob(30.0, "seconds of waiting worth one priority level", gt=0)
    # May change outputs: the forced tokens are appended without the model seeing each one first.
    jump_forward: bool = knob(False, "append grammar-forced tokens without a decode step each")
    # Speculative decoding (engine/speculator.py): drafts from the radix tree and prompt lookup, verified in
    # the next forward; greedy output is unchanged token for token, sampling keeps its distribution.
    speculative: str | None = knob(
        None, "speculative decoding: ngram (drafts from the radix tree and the prompt)", choices=("ngram",)
    )
    num_speculative_tokens: int = knob(
        5, "most tokens drafted per request per step with --speculative", ge=1, le=16, integer=True
    )
    # For a cache-aware router (docs/scaling.md): the engine process sends the radix tree's page
    # inserts and removals (cache/events.py) with its step outputs.
    kv_events: bool = knob(False, "publish the prefix cache's page inserts and evictions (KV events)")
    debug_checks: bool = knob(False, "check every cache invariant whenever the engine goes idle (slow)")
    # False: outputs carry token ids only (text None) and stop strings are left to the caller, who
    # detokenizes. The server's engine process always runs with True: it owns text and stop strings.
    detokenize: bool = knob(True, "make the outputs' text", cli=False)
    # Tiers beneath the device pool (docs/cache.md); 0 GB means no such tier.
    host_cache_gb: float = knob(0.0, "host-RAM KV tier beneath the device pool (0: off)", ge=0)
    # 0 with a disk_cache_dir: 10% of the free space on its filesystem, at most 64 GiB (docs/cache.md)
    disk_cache_gb: float = knob(
        0.0,
        "disk KV tier, survives restarts (0 with --disk-cache-dir: 10%% of its free space, <= 64 GiB)",
        ge=0,
    )
    disk_cache_dir: str | None = knob(None, "folder of the disk tier; entries of another model are deleted")
    write_policy: str = knob(
        "write_through",
        "when pages are copied down a tier: on insert, after k hits, or on eviction",
        choices=WRITE_POLICIES,
    )
    write_through_threshold: int = knob(2, "k for write_through_selective", ge=1, integer=True)
    # Cache control (issue 23, cache/pins/): the device pages pins may hold, per tenant with
    # --salt-per-key. A quarter keeps three quarters of the pool for running requests and the ordinary
    # LRU cache (a pinned system prompt rarely needs more), and four tenants cannot pin it all; pins
    # never leave less than one max_model_len request's pages, whatever the fraction.
    max_pinned_fraction: float = knob(
        0.25, "fraction of the device KV pool that pins may hold (per key with --salt-per-key)", ge=0, le=1
    )
    # Document reuse (issue 57, docs/cache.md): a marked document's KV computed once and placed wherever
    # it occurs, this share of its tokens recomputed. Approximate, so off (None) by default.
    document_reuse: float | None = knob(
        None, "reuse marked documents' KV at any position, recomputing this share of them (0-1)", ge=0, le=1
    )
    max_documents: int = knob(64, "most documents one request may mark", ge=1, integer=True)
    # Ranks (processes) the model is split over, each with its share of the cores
    # (engine/tensor_parallel.py); it must divide the query heads (SmolLM2-135M: 1, 3 or 9).
    tensor_parallel_size: int = knob(1, "tensor-parallel ranks the model is split over", ge=1, integer=True)
    # The API server's watchdog (runtime/watchdog.py): an engine process that sends nothing for this long
    # while it has open requests or calls is hung (a SIGSTOP, a deadlock, a rank stuck in a collective):
    # its requests fail with 503 and it is killed and restarted. Its loop sends a message at least every
    # half second except inside one step (or call), so the deadline only has to outlast the longest
    # step: a 512-token prefill chunk (the CPU default of max_batched_tokens) takes ~0.5 s for the
    # default 135M model on 2 cores (benchmarks/results/step_bench.md) and grows with the model, so
    # 60 s covers such a chunk of a ~7B fp32 model on 2 cores or the default model on a machine
    # ~100x oversubscribed. The start-up (model load, compile warm-up) is before Ready and not watched.
    engine_hang_timeout_s: float = knob(
        60.0,
        "kill and restart an engine process that makes no progress this long while it has work (0: off)",
        ge=0,
    )
    # runtime/supervisor.py: a second engine process, loaded and compiled, takes over the moment the
    # serving one dies or hangs, so a restart costs no start-up (load + compile warm-up: ~13 s for the
    # default model on 2 cores). It doubles the engine's memory, and replacing a used standby takes a
    # start-up's CPU beside serving; hence off by default.
    warm_standby: bool = knob(
        False, "keep a warm standby engine process that takes over when the serving one dies or hangs"
    )
    # engine/heap_trim.py: why a trim beats a low mmap threshold
    heap_trim_s: float = knob(
        30.0, "the engine process returns freed heap memory to the OS this often, in seconds (0: never)", ge=0
    )

    def __post_init__(self) -> None:
        for name, why in problems(self):
            raise ValueError(f"{name} {why}")
        apply_preset(self)  # after the checks: the preset sets valid values only
        # Rules between fields, which no single field's spec can say:
        if self.disk_cache_gb > 0 and not self.disk_cache_dir:
            raise ValueError("a disk tier (disk_cache_gb > 0) needs disk_cache_dir")
        if self.model is not None and str(self.model).endswith(".gguf"):
            if self.quantization not in (None, "gguf"):
                raise ValueError(
                    f"quantization {self.quantization} does not apply to the GGUF file {self.model}: its "
                    "weights are GGUF blocks (quantization gguf, the default for a .gguf model)"
                )
            self.quantization = "gguf"
        elif self.model is not None and self.quantization == "gguf":
            raise ValueError(
                f"quantization gguf needs a .gguf model file (or no model: the embedded SmolLM2 Q4_1 file), "
                f"got {self.model}"
            )

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
            f"max_model_len {max_model_len} (--max-model-len) needs {-(-max_model_len // page_size)} KV "
            "pages of "
            f"{page_size} tokens, but the pool has {num_pages}: raise --kv-cache-gb or --num-pages, or lower "
            f"--max-model-len to at most {pool_tokens}"
        )
    logger.warning(
        "the KV pool (%d pages of %d tokens) holds fewer tokens than the model's context of %d: "
        "max_model_len "
        "lowered to %d (raise --kv-cache-gb or --num-pages to serve the whole context)",
        num_pages,
        page_size,
        max_model_len,
        pool_tokens,
    )
    return pool_tokens
