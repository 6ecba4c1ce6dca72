"""EngineParts: the wiring of an engine, every collaborator the step loop uses, built from the config.

In build order: the config; the device and dtype; the model (loaded, its prefill arithmetic chosen,
sharded over tensor-parallel ranks) and its tokenizer; the context length and EOS ids; the KV pool,
sized from ``kv_cache_gb``; the attention backend; the cache manager (with its tiers) and the cache
control; the scheduler; the model runner; the speculator. ``Engine`` (``engine/engine.py``) builds
one of these and steps over it; building touches no request.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from radixserve.cache.kv_manager import KVCacheManager
from radixserve.cache.page_pool import KVPool
from radixserve.cache.tier_setup import make_tiers
from radixserve.config import EngineConfig, context_within_pool
from radixserve.engine import tensor_parallel
from radixserve.engine.cache_control import CacheControl
from radixserve.engine.documents import document_reuse
from radixserve.engine.intake import Intake
from radixserve.engine.scheduler import Scheduler
from radixserve.engine.speculator import Speculator
from radixserve.model import arithmetic
from radixserve.model.attention import check_dtypes, select_backend
from radixserve.model.loader import load_model, load_tokenizer, resolve_device_dtype, resolve_model_path
from radixserve.model.runner import ModelRunner
from radixserve.parallel import spawn
from radixserve.sampling.device_sampler import SamplingBuffers

logger = logging.getLogger("radixserve.engine")


class EngineParts:
    def __init__(self, model: str | None = None, **options: Any) -> None:
        self.config = cfg = EngineConfig.from_kwargs(model=model, **options)
        self.device, dtype_name = resolve_device_dtype(cfg.device, cfg.dtype)
        self.dtype = getattr(torch, dtype_name)
        if cfg.decode_arithmetic != "exact" and cfg.tensor_parallel_size > 1:
            raise ValueError(
                "decode_arithmetic int8 with tensor_parallel_size > 1 is not built (tiles are not sharded)"
            )
        self.kv_dtype = dtype_name if cfg.kv_cache_dtype == "auto" else cfg.kv_cache_dtype
        # One backend for the whole engine: attention in the runner, page copies for the tiers. Its
        # dtypes are checked before the model loads (and tensor-parallel ranks start) for nothing.
        backend = select_backend(cfg.attention_backend, self.device)
        check_dtypes(backend, cfg.kv_cache_dtype, self.device, (dtype_name, self.kv_dtype))
        if cfg.tensor_parallel_size > 1:  # before loading a model that a rank re-running a script won't use
            spawn.check_main_script()
        self.model_path = path = resolve_model_path(model, cfg.quantization)
        self.model = load_model(path, self.dtype, self.device, cfg.quantization)
        arithmetic.apply(self.model, cfg.prefill_arithmetic, cfg.max_running_requests, cfg.decode_arithmetic)
        self.tp = tensor_parallel.create(cfg, path, self.model, self.device)  # shards self.model
        self.tokenizer = load_tokenizer(path)
        mcfg = self.model.config
        self.max_model_len = min(
            cfg.max_model_len or mcfg.max_position_embeddings, mcfg.max_position_embeddings
        )
        eos = set(mcfg.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = sorted(eos)
        self.eos = frozenset(eos)
        page_bytes = KVPool.bytes_per_page(
            mcfg.num_layers, cfg.page_size, self.tp.kv_heads, mcfg.head_dim, self.kv_dtype
        )
        num_pages = cfg.num_pages or max(1, int(cfg.kv_cache_gb * 2**30) // page_bytes)
        self.max_model_len = context_within_pool(
            self.max_model_len, cfg.max_model_len is not None, num_pages, cfg.page_size
        )
        shape = (mcfg.num_layers, num_pages, cfg.page_size, self.tp.kv_heads, mcfg.head_dim)
        self.pool = pool = KVPool(*shape, self.kv_dtype, self.device)
        self.model.attention_arithmetic = attention = backend.attention_arithmetic(self.kv_dtype)
        if self.kv_dtype == "bfloat16":  # bf16 where the CPU has AVX512_BF16 (kernels/cpu.py), said once
            logger.info(
                "attention over bfloat16 K/V (%s backend): prefill and extend in %s, decode in fp32",
                backend.name,
                attention,
            )
        tiers = None
        if cfg.prefix_cache:
            tiers = make_tiers(
                self.tp.pages(self.pool),
                backend,
                self.model,
                mcfg,
                model_dtype=self.dtype,
                host_bytes=int(cfg.host_cache_gb * 2**30),
                disk_bytes=int(cfg.disk_cache_gb * 2**30),
                disk_dir=cfg.disk_cache_dir,
                write_policy=cfg.write_policy,
                write_through_threshold=cfg.write_through_threshold,
            )
        self.kv_manager = KVCacheManager(
            num_pages, cfg.page_size, cfg.prefix_cache, cfg.eviction_policy, tiers, page_bytes, pool.scores
        )
        self.cache_control = CacheControl(self.kv_manager, cfg.max_pinned_fraction, self.max_model_len)
        self.max_batched_tokens = cfg.max_batched_tokens or (8192 if self.device.type == "cuda" else 512)
        self.scheduler = Scheduler(
            self.kv_manager,
            cfg.max_running_requests,
            self.max_batched_tokens,
            cfg.schedule_policy,
            cfg.aging_s,
        )
        compile_step = not cfg.enforce_eager and backend.compilable
        # CUDA graphs with one rank only: a captured step would replay without its ranks' collectives.
        graphs = cfg.cuda_graphs and cfg.tensor_parallel_size == 1
        runner = ModelRunner(
            self.model,
            self.pool,
            backend,
            self.device,
            compile_step,
            cuda_graphs=graphs,
            max_batch=cfg.max_running_requests,
        )
        self.runner = self.tp.lead(runner)
        self.documents = document_reuse(
            cfg, self.kv_manager, self.pool, self.model, runner, self.max_model_len
        )
        self.scheduler.documents = self.documents
        self.speculator: Speculator | None = None
        if cfg.speculative == "ngram":
            self.speculator = Speculator(cfg.num_speculative_tokens, self.kv_manager)
        self.overlap = overlapped(cfg, self.device)
        # The overlapped loop samples on the device from preallocated buffers (sampling/device_sampler.py):
        # a row per running request.
        self.sampling_buffers = (
            SamplingBuffers(cfg.max_running_requests, mcfg.vocab_size, self.device) if self.overlap else None
        )
        self.intake = Intake(
            self.tokenizer,
            mcfg.vocab_size,
            self.max_model_len,
            cfg.page_size,
            num_pages,
            self.device,
            cfg.detokenize,
        )


def overlapped(cfg: EngineConfig, device: torch.device) -> bool:
    """Whether the engine runs the overlapped loop (``engine/overlap.py``). Not with speculation, whose
    drafts are made from the token the overlap has not read yet, nor with more than one rank, whose
    workers take each step's token ids from rank 0's host."""
    wanted = cfg.overlap_schedule == "on" or (cfg.overlap_schedule == "auto" and device.type == "cuda")
    if wanted and (cfg.speculative is not None or cfg.tensor_parallel_size > 1):
        if cfg.overlap_schedule == "on":
            logger.info("overlap schedule off: it takes neither speculative decoding nor tensor parallelism")
        return False
    return wanted
