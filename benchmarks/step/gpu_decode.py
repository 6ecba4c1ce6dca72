"""Decode on a CUDA GPU as issue 56 asks it measured: CUDA graphs, the overlapped loop, the HBM byte
limit, the server over HTTP and the host tier's load into HBM. One part per step of
``benchmarks/gpu_check.sh`` (``--parts``), each writing ``<name>-<part>.{json,md}``:

- ``graphs``: greedy tokens with CUDA graphs on and off (``cuda_graphs=False``, ``--no-cuda-graphs``)
  in float32, the exact mode: ``--probe`` prompts (6: a padded bucket of 8) x ``--probe-tokens`` tokens
  each, whole sequences identical or not, and each engine's capture (seconds, pool MiB, buckets, from
  the line ``model/cuda_graphs.py`` logs at start-up).
- ``decode``: bf16, graphs on, the overlapped loop on and off on one engine (``Engine.overlap``, switched
  between runs): B prompts of ``--prompt-len`` tokens, ``--new-tokens`` greedy tokens each (EOS
  ignored); the steps after every request has its first token are timed (decode only): tok/s, ms a
  step, and the step's bytes (the weights once, the LM head's included, plus each row's K/V at its
  mean context in the window) over the step time, as a share of the device's peak: a device-to-device
  copy measured in this run (read + write bytes over time, best of a few), the nominal spec named
  beside it. Also the TTFT of a ``--tier-prefix``-token prompt computed in full (the ``tier`` part's
  recompute, on this engine, which has no tier below it).
- ``tier`` (the ``--served-shape`` only): an engine with a host tier (``host_cache_gb``): the prefix
  computed once (written through to host RAM), its device copy evicted, then hit: the TTFT of the hit,
  the load's bytes per second (the tier controller's own measurement of that load: the host store's
  reads plus the write into the pool, ``cache/load_cost.py``) against a pinned host-to-device copy
  measured in this run, and what the controller decides once it has measured both (pages it would
  load of the prefix's).
- ``http``: ``radixserve serve`` on 127.0.0.1 with the ``--served-shape`` folder (the 1B shape), bf16,
  its defaults (graphs, overlapped loop); ``--http-concurrency`` streamed chat requests at a time through
  the benchmarks' client (``lib/loadgen.py``, httpx, SSE): TTFT and ITL p50/p95, beside the engine's
  own decode step at that batch from the ``decode`` part's JSON (``--engine-json``) where it ran.

Models: random-weight HF folders of SmolLM2-135M's and Llama-3.2-1B's shapes with SmolLM2's tokenizer
(``--tokenizer-dir``), written once into ``--models-dir`` (``bench_models.shape_folder``), as
``gpu_engine.py`` uses them. ``--model DIR`` runs one existing folder instead.

Dry run (no figures; CI's ``tests/bench/test_gpu_decode.py``): ``--device cpu --model <tiny folder>``
with small ``--batches``, ``--prompt-len`` and token counts runs every part's code on the CPU (the
torch steps, no graphs; the copies' "peaks" are host memcpys, and no pinned copy).

    python -m benchmarks.step.gpu_decode --tokenizer-dir DIR --models-dir DIR --parts graphs decode
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.lib.bench_models import GPU_SHAPES, shape_folder
from benchmarks.lib.common import RESULTS, args_json, write_results
from benchmarks.lib.gpu_device import (
    capture_log,
    hbm_peak,
    link_peak,
    on_cuda,
    sync,
)
from benchmarks.lib.gpu_http import http_part
from benchmarks.lib.gpu_report import report
from radixserve import Engine, SamplingParams

PARTS = ("graphs", "decode", "tier", "http")


# -- the engines ------------------------------------------------------------------------------------
def folders(args: argparse.Namespace) -> list[tuple[str, Path]]:
    """(label, HF folder) of each shape, written once into ``--models-dir``; or ``--model`` alone."""
    if args.model is not None:
        return [(args.model.name, args.model)]
    if args.tokenizer_dir is None:
        raise SystemExit("--tokenizer-dir is needed to write the shapes' folders (or give --model)")
    out = []
    for name in args.shapes:
        start = time.perf_counter()
        out.append((name, shape_folder(GPU_SHAPES[name], args.models_dir, args.tokenizer_dir)))
        print(f"{name}: folder ready in {time.perf_counter() - start:.1f} s", flush=True)
    return out


def make_engine(folder: Path, args: argparse.Namespace, **options: Any) -> Engine:
    """The engine under test: Triton attention on CUDA; on the CPU (a dry run) the default backend,
    eager steps (no compile)."""
    free_memory()  # the engine before this one, dropped by its caller
    extra: dict[str, Any] = {"attention_backend": "triton"} if on_cuda(args) else {"enforce_eager": True}
    return Engine(str(folder), device=args.device, **({"kv_cache_gb": args.kv_cache_gb} | extra | options))


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def prompts(count: int, length: int, seed: int, vocab: int) -> list[list[int]]:
    """Random token ids, away from the lowest ids (special tokens in most vocabularies)."""
    rng = random.Random(seed)
    low = min(100, vocab // 4)
    return [[rng.randrange(low, vocab) for _ in range(length)] for _ in range(count)]


def vocab(engine: Engine) -> int:
    return int(engine.model.config.vocab_size)


def greedy(engine: Engine, batch: list[list[int]], new: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in engine.generate(batch, params)]


def weight_bytes(engine: Engine) -> int:
    """Bytes of weights a decode step reads: every parameter once (a tied LM head is the embedding,
    read whole), less an untied input embedding (a step reads only its rows)."""
    model = engine.model
    seen = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    embed = model.embed_tokens.weight
    if embed.data_ptr() != model.lm_head.weight.data_ptr():
        seen.pop(embed.data_ptr(), None)
    return sum(seen.values())


def kv_bytes_per_token(engine: Engine) -> float:
    """Bytes of K and V (every layer, scales included) one token of context holds."""
    return float(engine.kv_manager.page_bytes / engine.config.page_size)


# -- graphs: on and off, float32 --------------------------------------------------------------------
def graphs_part(label: str, folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"shape": label, "tokens": {}, "captures": {}}
    for graphs in (True, False):
        with capture_log() as log:
            engine = make_engine(
                folder,
                args,
                dtype="float32",
                cuda_graphs=graphs,
                max_running_requests=8,
                kv_cache_gb=min(args.kv_cache_gb, 1.0),
            )
        batch = prompts(args.probe, args.prompt_len, 1234, vocab(engine))
        out["tokens"]["on" if graphs else "off"] = greedy(engine, batch, args.probe_tokens)
        out["captures"]["on" if graphs else "off"] = log.captures
        engine.close()
        del engine
    on, off = out["tokens"]["on"], out["tokens"]["off"]
    out["identical"] = sum(a == b for a, b in zip(on, off)) / len(on)
    print(f"{label}: graphs on/off float32, {out['identical']:.0%} identical", flush=True)
    return out


# -- decode: tok/s and the byte limit ---------------------------------------------------------------
def decode_run(engine: Engine, batch: int, args: argparse.Namespace, overlap: bool) -> dict[str, Any]:
    """One run of ``batch`` requests; the steps after every request has its first token are timed."""
    engine.overlap = overlap
    engine.flush_cache()
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
    for ids in prompts(batch, args.prompt_len, batch, vocab(engine)):
        engine.add_request(ids, params)
    started: set[str] = set()
    produced = 0
    while len(started) < batch and engine.has_unfinished():
        for out in engine.step():
            if out.token_ids:
                started.add(out.group_id)
                produced += len(out.token_ids)
    sync()
    start, steps, tokens = time.perf_counter(), engine.num_steps, 0
    while engine.has_unfinished():
        tokens += sum(len(out.token_ids) for out in engine.step())
    sync()
    seconds, steps = time.perf_counter() - start, engine.num_steps - steps
    # each row's context over the window: from after its first tokens to its last
    context = args.prompt_len + (produced / batch + args.new_tokens) / 2
    if not steps:
        raise ValueError(f"no decode step after the first tokens: raise --new-tokens ({args.new_tokens})")
    step_s = seconds / steps
    step_bytes = weight_bytes(engine) + batch * context * kv_bytes_per_token(engine)
    return {
        "batch": batch,
        "overlap": overlap,
        "tok_s": tokens / seconds,
        "step_ms": 1e3 * step_s,
        "steps": steps,
        "tokens": tokens,
        "mean_context": context,
        "step_bytes": step_bytes,
        "bytes_per_s": step_bytes / step_s,
    }


def ttft(engine: Engine, ids: list[int]) -> tuple[float, int]:
    """Seconds to the first token (max_tokens=1: the whole request) and the tokens found cached."""
    sync()
    start = time.perf_counter()
    out = engine.generate([ids], SamplingParams(max_tokens=1, temperature=0))[0]
    sync()
    return time.perf_counter() - start, out.cached_tokens


def tier_prompts(engine: Engine, args: argparse.Namespace) -> dict[str, list[int]]:
    """The ``tier`` part's prompts, the same for the ``decode`` part's recompute: two long prefixes
    and short questions after them."""
    size = vocab(engine)
    (a, b), asks = prompts(2, args.tier_prefix, 77, size), prompts(4, 8, 78, size)
    return {"a": a, "b": b, **{f"ask{i}": q for i, q in enumerate(asks)}}


def decode_part(label: str, folder: Path, args: argparse.Namespace, peak: dict[str, Any]) -> dict[str, Any]:
    biggest = max(args.batches)
    with capture_log() as log:
        engine = make_engine(
            folder,
            args,
            dtype=args.dtype,
            max_running_requests=biggest,
            max_batched_tokens=max(8192, biggest * args.prompt_len),
            overlap_schedule="on",
        )
    greedy(engine, prompts(2, args.prompt_len, 99, vocab(engine)), 4)  # warm-up: prefill kernels compiled
    rows = []
    for b in args.batches:
        for overlap in (True, False) if b % 2 else (False, True):  # alternate which goes first
            for _ in range(args.rounds):
                rows.append(decode_run(engine, b, args, overlap))
                r = rows[-1]
                print(
                    f"{label} B={b} overlap={'on' if overlap else 'off'}: {r['tok_s']:.0f} tok/s, "
                    f"{r['step_ms']:.2f} ms/step, {r['bytes_per_s'] / 1e9:.0f} GB/s",
                    flush=True,
                )
    ref = peak["copy_bytes_per_s"]
    for r in rows:
        r["pct_of_copy_peak"] = 100 * r["bytes_per_s"] / ref
        nominal = peak["nominal_bytes_per_s"]
        r["pct_of_nominal"] = 100 * r["bytes_per_s"] / nominal if nominal else None
    engine.flush_cache()
    p = tier_prompts(engine, args)
    recompute = [ttft(engine, p[k] + p["ask0"])[0] for k in ("a", "b")]  # each prefix new to the cache
    out = {
        "shape": label,
        "weight_bytes": weight_bytes(engine),
        "kv_bytes_per_token": kv_bytes_per_token(engine),
        "captures": log.captures,
        "rows": rows,
        "recompute_ttft_ms": [1e3 * s for s in recompute],
    }
    engine.close()
    return out


# -- tier: a prefix hit from host RAM into HBM ------------------------------------------------------
def drop_device_copies(engine: Engine) -> int:
    """Evict every unlocked page from the device pool (write-through: each has its copy below)."""
    tree = engine.kv_manager.tree
    assert tree is not None
    pages = tree.evictable_pages
    tree.evict(pages)
    engine.kv_manager.tiers.drain()
    return int(pages)


def tier_part(label: str, folder: Path, args: argparse.Namespace, link: dict[str, Any]) -> dict[str, Any]:
    engine = make_engine(
        folder,
        args,
        dtype=args.dtype,
        host_cache_gb=args.host_cache_gb,
        kv_cache_gb=min(args.kv_cache_gb, 2.0),
    )
    tiers = engine.kv_manager.tiers
    p = tier_prompts(engine, args)
    greedy(engine, prompts(1, args.tier_prefix, 5, vocab(engine)), 1)  # warm-up, and a prefill measured
    hits: list[dict[str, Any]] = []
    for doc, ask in (("a", "ask1"), ("b", "ask2")):
        ttft(engine, p[doc] + p["ask0"])  # computed in full; written through to the host tier
        evicted = drop_device_copies(engine)
        before = engine.stats().tiers["host"]
        tiers.cost.page_s[0] = None  # this load's figure alone (an unmeasured tier always loads)
        seconds, cached = ttft(engine, p[doc] + p[ask])
        after = engine.stats().tiers["host"]
        pages = after["hits"] - before["hits"]
        n = len(p[doc]) // engine.config.page_size
        hits.append(
            {
                "ttft_ms": 1e3 * seconds,
                "cached_tokens": cached,
                "evicted_pages": evicted,
                "host_pages": pages,
                "load_bytes": after["bytes_out"] - before["bytes_out"],
                "load_bytes_per_s": after["load_bytes_per_s"],
                "recomputed_pages": engine.stats().tiers["device"]["recomputed_pages"],
                "would_load_pages": tiers.cost.pages_to_load([0] * n, engine.config.page_size),
                "prefix_pages": n,
            }
        )
        print(f"{label} host hit: {hits[-1]}", flush=True)
    pinned: float | None = link["pinned_bytes_per_s"]
    for h in hits:
        h["pct_of_pinned_copy"] = 100 * h["load_bytes_per_s"] / pinned if pinned else None
    out = {
        "shape": label,
        "prefix_tokens": args.tier_prefix,
        "hits": hits,
        "prefill_tokens_per_s": tiers.cost.prefill_tokens_per_s(),
    }
    engine.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS)
    ap.add_argument("--tokenizer-dir", type=Path, help="SmolLM2's tokenizer files, for the shapes' folders")
    ap.add_argument("--models-dir", type=Path, default=Path("/tmp/gpu-models"))
    ap.add_argument("--shapes", nargs="+", default=list(GPU_SHAPES), choices=list(GPU_SHAPES))
    ap.add_argument("--model", type=Path, help="one existing HF folder instead of the shapes (a dry run's)")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of this code, no figures")
    ap.add_argument("--dtype", default="bfloat16", help="the decode, tier and http parts' dtype")
    ap.add_argument("--kv-cache-gb", type=float, default=4.0, help="the decode and http parts' pool")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=1, help="runs of each (batch, overlap)")
    ap.add_argument("--probe", type=int, default=6, help="prompts of the graphs on/off comparison")
    ap.add_argument("--probe-tokens", type=int, default=32)
    ap.add_argument("--copy-mib", type=int, default=1024, help="size of the bandwidth copies")
    ap.add_argument("--tier-prefix", type=int, default=4096, help="tokens of the host-tier hit's prefix")
    ap.add_argument("--host-cache-gb", type=float, default=2.0)
    ap.add_argument("--served-shape", choices=list(GPU_SHAPES), default="llama-3.2-1b")
    ap.add_argument("--http-concurrency", type=int, default=8)
    ap.add_argument("--http-requests", type=int, default=16)
    ap.add_argument("--http-prompt", type=int, default=256)
    ap.add_argument("--http-tokens", type=int, default=128)
    ap.add_argument("--http-duration", type=float, default=60.0, help="seconds of requests at most")
    ap.add_argument("--server-timeout", type=float, default=120.0, help="seconds to wait for the server")
    ap.add_argument("--engine-json", type=Path, help="the decode part's JSON, for the http part's step time")
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    ap.add_argument("--name", default="gpu_decode")
    args = ap.parse_args(argv)
    if on_cuda(args) and not torch.cuda.is_available():
        print("gpu_decode.py needs a CUDA GPU (--device cpu: a dry run); nothing measured.")
        return 1
    device = torch.cuda.get_device_name() if on_cuda(args) else "cpu (dry run: no figures)"
    if args.engine_json is None:
        args.engine_json = args.out_dir / f"{args.name}-decode.json"
    shapes = folders(args)
    for part in args.parts:
        payload: dict[str, Any] = {"device": device, "dtype": args.dtype, "args": args_json(args)}
        chosen = [s for s in shapes if args.model is not None or s[0] == args.served_shape]
        if part == "graphs":
            payload["results"] = [graphs_part(label, folder, args) for label, folder in shapes]
        elif part == "decode":
            payload["hbm"] = peak = hbm_peak(args.device, args.copy_mib)
            payload["results"] = [decode_part(label, folder, args, peak) for label, folder in shapes]
        elif part == "tier":
            payload["link"] = link = link_peak(args.device, args.copy_mib)
            payload["results"] = [tier_part(label, folder, args, link) for label, folder in chosen]
            recompute = args.out_dir / f"{args.name}-decode.json"  # the same prompts, computed in full
            if recompute.is_file():
                done = {
                    r["shape"]: r["recompute_ttft_ms"] for r in json.loads(recompute.read_text())["results"]
                }
                for r in payload["results"]:
                    r["recompute_ttft_ms"] = done.get(r["shape"])
        else:
            payload["results"] = [http_part(label, folder, args) for label, folder in chosen]
        write_results(f"{args.name}-{part}", payload, markdown=report(part, payload), out_dir=args.out_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
