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
import logging
import random
import re
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from benchmarks.lib.bench_models import GPU_SHAPES, shape_folder
from benchmarks.lib.common import RESULTS, args_json, cell, markdown_table, write_results
from benchmarks.lib.loadgen import RunConfig, run_benchmark
from benchmarks.lib.servers import free_port, radixserve_command, serving
from benchmarks.lib.workloads import WorkloadSpec, build_workload, load_tokenizer
from radixserve import Engine, SamplingParams

PARTS = ("graphs", "decode", "tier", "http")
# Nominal HBM bandwidth by device name (the first key found in the name wins), bytes/s: NVIDIA's specs.
NOMINAL_HBM = {"H200": 4.8e12, "H100 NVL": 3.9e12, "H100 PCIe": 2.0e12, "H100": 3.35e12, "A100": 2.0e12}
NOMINAL_LINK = "PCIe 5.0 x16: 64 GB/s each way (H100 and H200)"
CAPTURED = re.compile(r"captured decode CUDA graphs at batch ([\d,]+) in ([\d.]+) s, ([\d.]+) MiB")


# -- the device -------------------------------------------------------------------------------------
def on_cuda(args: argparse.Namespace) -> bool:
    return str(args.device).startswith("cuda")


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def copy_bytes_per_s(src: torch.Tensor, dst: torch.Tensor, repeats: int, moved: int) -> float:
    """The best of ``repeats`` copies of ``src`` into ``dst``: ``moved`` bytes over its seconds."""
    best = float("inf")
    for _ in range(repeats + 1):  # the first is a warm-up
        sync()
        start = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        sync()
        best = min(best, time.perf_counter() - start)
    return moved / best


def hbm_peak(device: str, mib: int) -> dict[str, Any]:
    """A device-to-device copy of ``mib`` MiB (read and write: twice its bytes moved), and the nominal
    figure where the device's name is known."""
    src = torch.ones(mib * 2**18, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    measured = copy_bytes_per_s(src, dst, 5, 2 * src.numel() * 4)
    name = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
    nominal = next((v for k, v in NOMINAL_HBM.items() if k in name), None)
    del src, dst
    return {"device": name, "copy_bytes_per_s": measured, "copy_mib": mib, "nominal_bytes_per_s": nominal}


def link_peak(device: str, mib: int) -> dict[str, Any]:
    """Host-to-device copies of ``mib`` MiB from pinned and from pageable memory (None off CUDA)."""
    if not device.startswith("cuda"):
        return {"pinned_bytes_per_s": None, "pageable_bytes_per_s": None, "nominal": NOMINAL_LINK}
    dst = torch.empty(mib * 2**18, dtype=torch.float32, device=device)
    pinned = torch.ones(dst.numel(), dtype=torch.float32).pin_memory()
    pageable = torch.ones(dst.numel(), dtype=torch.float32)
    moved = dst.numel() * 4
    return {
        "pinned_bytes_per_s": copy_bytes_per_s(pinned, dst, 5, moved),
        "pageable_bytes_per_s": copy_bytes_per_s(pageable, dst, 3, moved),
        "copy_mib": mib,
        "nominal": NOMINAL_LINK,
    }


class CaptureLog(logging.Handler):
    """Keeps the capture line ``model/cuda_graphs.py`` logs at start-up, as numbers."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.captures: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        found = parse_capture(record.getMessage())
        if found:
            self.captures.extend(found)


def parse_capture(text: str) -> list[dict[str, Any]]:
    """Every capture line in ``text`` (a log): buckets, seconds and the graphs' pool in MiB."""
    return [
        {"buckets": [int(b) for b in m[1].split(",")], "seconds": float(m[2]), "pool_mib": float(m[3])}
        for m in CAPTURED.finditer(text)
    ]


@contextmanager
def capture_log() -> Iterator[CaptureLog]:
    logger = logging.getLogger("radixserve.model")
    handler, level = CaptureLog(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


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


# -- http: the server itself ------------------------------------------------------------------------
def engine_step_ms(path: Path | None, label: str, batch: int) -> float | None:
    """The ``decode`` part's step time at ``batch`` with the overlapped loop (the server's default)."""
    if path is None or not path.is_file():
        return None
    for res in json.loads(path.read_text())["results"]:
        if res["shape"] == label:
            times = [r["step_ms"] for r in res["rows"] if r["batch"] == batch and r["overlap"]]
            return statistics.median(times) if times else None
    return None


def http_part(label: str, folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    port, conc = free_port(), args.http_concurrency
    flags = ["--log-level", "info", "--device", args.device, "--dtype", args.dtype]
    flags += ["--attention-backend", "triton"] if on_cuda(args) else ["--enforce-eager"]
    cmd = radixserve_command(port, *flags, model=str(folder), kv_cache_gb=args.kv_cache_gb)
    tokenizer = load_tokenizer(str(folder))
    spec = WorkloadSpec(
        "nosharing",
        output_tokens=args.http_tokens,
        num_requests=args.http_requests,
        prompt_tokens=args.http_prompt,
    )
    logs = args.out_dir / "logs"
    start = time.perf_counter()
    with serving("gpu-http", cmd, port, logs, timeout_s=args.server_timeout) as url:
        ready_s = time.perf_counter() - start
        cfg = RunConfig(
            url,
            request_rate=None,
            concurrency=conc,
            max_requests=args.http_requests,
            max_duration_s=args.http_duration,
        )
        doc = run_benchmark(cfg, build_workload(spec, tokenizer), tokenizer, progress=False)
    s = doc["summary"]
    step = engine_step_ms(args.engine_json, label, conc)
    itl = s["itl"]["p50_ms"]
    return {
        "shape": label,
        "concurrency": conc,
        "server_ready_s": ready_s,
        "captures": parse_capture((logs / "gpu-http.log").read_text()),
        "requests": s["requests"],
        "errors": s["errors"],
        "error_messages": s["error_messages"],
        "output_tok_s": s["output_throughput"],
        "ttft_ms": {k: s["ttft"][k] for k in ("p50_ms", "p95_ms")},
        "itl_ms": {k: s["itl"][k] for k in ("p50_ms", "p95_ms")},
        "engine_step_ms": step,
        "itl_p50_over_step": itl / step if itl is not None and step else None,
    }


# -- the report -------------------------------------------------------------------------------------
def gb(x: float | None) -> float | None:
    return None if x is None else x / 1e9


def capture_cells(captures: list[dict[str, Any]]) -> str:
    return "; ".join(
        f"{c['seconds']:.2f} s, {c['pool_mib']:.0f} MiB at {c['buckets']}" for c in captures
    ) or ("none logged (no CUDA graphs here)")


def graphs_report(payload: dict[str, Any]) -> list[str]:
    rows = [
        [r["shape"], f"{r['identical']:.0%}", capture_cells(r["captures"]["on"])] for r in payload["results"]
    ]
    return [
        "Greedy tokens with CUDA graphs on and off, float32, random weights of real shapes.",
        "",
        *markdown_table(["shape", "identical sequences", "capture (graphs on)"], rows),
    ]


def decode_report(payload: dict[str, Any]) -> list[str]:
    peak, args = payload["hbm"], payload["args"]
    rows = [
        [r["shape"] if i == 0 else "", x["batch"], "on" if x["overlap"] else "off", x["tok_s"], x["step_ms"]]
        + [x["step_bytes"] / 2**20, x["pct_of_copy_peak"], x["pct_of_nominal"]]
        for r in payload["results"]
        for i, x in enumerate(r["rows"])
    ]
    header = ["shape", "B", "overlap", "tok/s", "ms/step", "MiB/step", "% of copy peak", "% of nominal"]
    return [
        f"{payload['dtype']}, CUDA graphs on; prompts of {args['prompt_len']} tokens, {args['new_tokens']} "
        "new tokens each; the decode steps only. HBM byte limit: the weights + each row's K/V at its mean "
        "context, over the step's time, against a device-to-device copy measured here "
        f"({cell(gb(peak['copy_bytes_per_s']))} GB/s; nominal {cell(gb(peak['nominal_bytes_per_s']))} GB/s "
        f"for {peak['device']}).",
        "",
        *markdown_table(header, rows),
        "",
        *(f"- {r['shape']}: capture {capture_cells(r['captures'])}" for r in payload["results"]),
    ]


def tier_report(payload: dict[str, Any]) -> list[str]:
    link = payload["link"]
    rows = [
        [r["shape"], h["ttft_ms"], h["cached_tokens"], gb(h["load_bytes_per_s"]), h["pct_of_pinned_copy"]]
        + [f"{h['would_load_pages']} of {h['prefix_pages']}"]
        for r in payload["results"]
        for h in r["hits"]
    ]
    header = ["shape", "host-hit TTFT ms", "cached tokens", "load GB/s", "% of pinned copy", "would load"]
    recompute = [
        f"- {r['shape']}: the same prefixes computed in full (decode part): "
        + ", ".join(f"{t:.1f}" for t in r["recompute_ttft_ms"])
        + " ms TTFT"
        for r in payload["results"]
        if r.get("recompute_ttft_ms")
    ]
    return [
        f"A {payload['args']['tier_prefix']}-token prefix served from the host tier into HBM, its device "
        "copy evicted first. Host-to-device copies measured here: pinned "
        f"{cell(gb(link['pinned_bytes_per_s']))} GB/s, pageable {cell(gb(link['pageable_bytes_per_s']))} "
        f"GB/s ({link['nominal']}).",
        "",
        *markdown_table(header, rows),
        "",
        *(recompute or ["- recompute: the decode part did not run"]),
    ]


def http_report(payload: dict[str, Any]) -> list[str]:
    rows = [
        [r["shape"], r["concurrency"], r["requests"], r["errors"], r["ttft_ms"]["p50_ms"]]
        + [r["ttft_ms"]["p95_ms"], r["itl_ms"]["p50_ms"], r["itl_ms"]["p95_ms"], r["engine_step_ms"]]
        + [r["itl_p50_over_step"], capture_cells(r["captures"])]
        for r in payload["results"]
    ]
    header = ["shape", "concurrent", "requests", "errors", "TTFT p50 ms", "TTFT p95 ms", "ITL p50 ms"]
    header += ["ITL p95 ms", "engine step ms (decode part)", "ITL p50 / step", "server's capture"]
    return [
        "`radixserve serve` on 127.0.0.1, streamed chat completions (SSE, httpx), closed loop; the "
        "engine's step at that batch from the decode part's JSON of this run ('-': it did not run).",
        "",
        *markdown_table(header, rows),
    ]


REPORTS = {"graphs": graphs_report, "decode": decode_report, "tier": tier_report, "http": http_report}


def report(part: str, payload: dict[str, Any]) -> str:
    title = f"# issue 56 on {payload['device']}: {part} (benchmarks/step/gpu_decode.py, measured in this run)"
    return "\n".join([title, "", *REPORTS[part](payload)]) + "\n"


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
