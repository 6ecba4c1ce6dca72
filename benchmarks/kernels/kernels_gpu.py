"""GPU benchmark of the Triton kernels: achieved HBM bandwidth vs device peak, and time vs baselines.

Baselines: the torch reference (``radixserve.kernels.reference``) always; FlashInfer and flash_attn
paged kernels when importable (their failures are reported, not fatal). Bytes counted are the
compulsory traffic: every K/V byte attended read once, q read and output written once (extend
attention is compute-bound, so its TFLOP/s is reported too). Times are medians from
``triton.testing.do_bench`` (L2 flushed between runs).

Usage: ``python benchmarks/kernels/kernels_gpu.py [--peak-gbps N] [--quick]``; writes
``benchmarks/results/kernels_gpu.{json,md}``. Exits with a message when no CUDA device is present.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from benchmarks.lib.common import write_results

# Peak HBM bandwidth (GB/s) by substring of torch.cuda.get_device_name(); first match wins.
PEAK_GBPS: tuple[tuple[str, float], ...] = (
    ("H200", 4800.0),
    ("H100 PCIe", 2000.0),
    ("H100 NVL", 3900.0),
    ("H100", 3350.0),
    ("H800", 3350.0),
    ("GH200", 4000.0),
    ("B200", 8000.0),
    ("A100-SXM4-80GB", 2039.0),
    ("A100 80GB PCIe", 1935.0),
    ("A100", 1555.0),
    ("A10G", 600.0),
    ("L40S", 864.0),
    ("L4", 300.0),
    ("RTX 4090", 1008.0),
    ("RTX 3090", 936.0),
)


@dataclass
class Row:
    kernel: str
    config: str
    impl: str
    ms: float | None
    gbps: float | None
    peak_pct: float | None
    tflops: float | None = None
    vs_triton: float | None = None  # this impl's time / the Triton kernel's time
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def peak_gbps(name: str, override: float | None) -> float | None:
    if override is not None:
        return override
    return next((gbps for key, gbps in PEAK_GBPS if key in name), None)


class Bench:
    def __init__(self, peak: float | None) -> None:
        self.peak = peak
        self.rows: list[Row] = []

    def measure(
        self,
        kernel: str,
        config: str,
        impls: dict[str, Callable[[], object]],
        nbytes: int,
        flops: float = 0.0,
    ) -> None:
        from triton.testing import do_bench

        triton_ms: float | None = None
        for impl, fn in impls.items():
            try:
                ms = float(do_bench(fn, warmup=10, rep=50, return_mode="median"))
            except Exception as exc:  # a baseline with a different API or unsupported shape
                self.rows.append(
                    Row(
                        kernel, config, impl, None, None, None, note=f"n/a: {type(exc).__name__}: {exc}"[:160]
                    )
                )
                continue
            if impl == "triton":
                triton_ms = ms
            gbps = nbytes / ms / 1e6
            self.rows.append(
                Row(
                    kernel,
                    config,
                    impl,
                    round(ms, 4),
                    round(gbps, 1),
                    round(100 * gbps / self.peak, 1) if self.peak else None,
                    round(flops / ms / 1e9, 1) if flops else None,
                    round(ms / triton_ms, 2) if triton_ms else None,
                )
            )
            print(f"{kernel:9s} {config:48s} {impl:11s} {ms:8.4f} ms {gbps:8.1f} GB/s", flush=True)


def paged_setup(
    seq_lens: list[int], page_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype
) -> dict[str, Any]:
    """A shuffled page pool holding ``seq_lens`` tokens, with the index tensors of every backend."""
    dev = torch.device("cuda")
    counts = [(n + page_size - 1) // page_size for n in seq_lens]
    num_pages = sum(counts)
    k_cache = torch.randn(num_pages, page_size, kv_heads, head_dim, device=dev, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    order = torch.randperm(num_pages, device=dev, dtype=torch.int32)
    table = torch.zeros(len(seq_lens), max(counts), dtype=torch.int32, device=dev)
    indptr = [0]
    for b, n in enumerate(counts):
        table[b, :n] = order[indptr[-1] : indptr[-1] + n]
        indptr.append(indptr[-1] + n)
    return {
        "k_cache": k_cache,
        "v_cache": v_cache,
        "page_table": table,
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32, device=dev),
        "kv_indptr": torch.tensor(indptr, dtype=torch.int32, device=dev),
        "kv_indices": order,
        "last_page_len": torch.tensor(
            [n - (c - 1) * page_size for n, c in zip(seq_lens, counts, strict=True)],
            dtype=torch.int32,
            device=dev,
        ),
    }


def bench_decode(
    bench: Bench,
    batch: int,
    context: int,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    page_size: int,
    dtype: torch.dtype,
) -> None:
    from radixserve.kernels import ops, reference

    p = paged_setup([context] * batch, page_size, kv_heads, head_dim, dtype)
    q = torch.randn(batch, q_heads, head_dim, device="cuda", dtype=dtype)
    scale = head_dim**-0.5
    args = (q, p["k_cache"], p["v_cache"], p["page_table"], p["seq_lens"], scale)
    elt = q.element_size()
    nbytes = 2 * batch * context * kv_heads * head_dim * elt + 2 * q.numel() * elt
    impls: dict[str, Callable[[], object]] = {
        "triton": lambda: ops.decode_attention(*args),
        "torch_ref": lambda: reference.decode_attention(*args),
    }
    try:
        import flashinfer

        workspace = torch.empty(128 * 2**20, dtype=torch.uint8, device="cuda")
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace, "NHD", use_tensor_cores=q_heads != kv_heads
        )
        wrapper.plan(
            p["kv_indptr"],
            p["kv_indices"],
            p["last_page_len"],
            q_heads,
            kv_heads,
            head_dim,
            page_size,
            q_data_type=dtype,
            kv_data_type=dtype,
            sm_scale=scale,
        )
        impls["flashinfer"] = lambda: wrapper.run(q, (p["k_cache"], p["v_cache"]))
    except Exception as exc:
        print(f"flashinfer decode unavailable: {exc}", file=sys.stderr)
    try:
        from flash_attn import flash_attn_with_kvcache

        q4 = q.unsqueeze(1)
        impls["flash_attn"] = lambda: flash_attn_with_kvcache(
            q4,
            p["k_cache"],
            p["v_cache"],
            cache_seqlens=p["seq_lens"],
            block_table=p["page_table"],
            softmax_scale=scale,
        )
    except Exception as exc:
        print(f"flash_attn unavailable: {exc}", file=sys.stderr)
    config = f"B={batch} ctx={context} h={q_heads}/{kv_heads} d={head_dim} page={page_size} {str(dtype)[6:]}"
    bench.measure("decode", config, impls, nbytes, flops=4.0 * batch * q_heads * context * head_dim)


def bench_extend(
    bench: Bench,
    batch: int,
    prefix: int,
    new: int,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    page_size: int,
    dtype: torch.dtype,
) -> None:
    from radixserve.kernels import ops, reference

    p = paged_setup([prefix + new] * batch, page_size, kv_heads, head_dim, dtype)
    q = torch.randn(batch * new, q_heads, head_dim, device="cuda", dtype=dtype)
    cu = torch.arange(0, batch + 1, dtype=torch.int32, device="cuda") * new
    scale = head_dim**-0.5
    args = (q, p["k_cache"], p["v_cache"], p["page_table"], cu, p["seq_lens"], scale)
    elt = q.element_size()
    nbytes = 2 * batch * (prefix + new) * kv_heads * head_dim * elt + 2 * q.numel() * elt
    # Causal: each new token sees the prefix plus half the chunk on average.
    flops = 4.0 * batch * new * q_heads * head_dim * (prefix + (new + 1) / 2)
    impls: dict[str, Callable[[], object]] = {
        "triton": lambda: ops.extend_attention(*args, max_q_len=new),
        "torch_ref": lambda: reference.extend_attention(*args),
    }
    try:
        import flashinfer

        workspace = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
        wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        wrapper.plan(
            cu,
            p["kv_indptr"],
            p["kv_indices"],
            p["last_page_len"],
            q_heads,
            kv_heads,
            head_dim,
            page_size,
            causal=True,
            q_data_type=dtype,
            kv_data_type=dtype,
            sm_scale=scale,
        )
        impls["flashinfer"] = lambda: wrapper.run(q, (p["k_cache"], p["v_cache"]))
    except Exception as exc:
        print(f"flashinfer prefill unavailable: {exc}", file=sys.stderr)
    config = (
        f"B={batch} prefix={prefix} new={new} h={q_heads}/{kv_heads} d={head_dim} page={page_size} "
        f"{str(dtype)[6:]}"
    )
    bench.measure("extend", config, impls, nbytes, flops=flops)


def bench_kv_ops(
    bench: Bench, layers: int, pages: int, page_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype
) -> None:
    from radixserve.kernels import ops, reference

    pool = torch.randn(layers, 4 * pages, page_size, kv_heads, head_dim, device="cuda", dtype=dtype)
    chosen = torch.randperm(4 * pages, device="cuda")[:pages].int()
    packed = ops.gather_pages(pool, chosen)
    nbytes = 2 * packed.numel() * packed.element_size()
    tag = f"L={layers} pages={pages} page={page_size} h={kv_heads} d={head_dim} {str(dtype)[6:]}"
    bench.measure(
        "gather",
        tag,
        {
            "triton": lambda: ops.gather_pages(pool, chosen),
            "torch_ref": lambda: reference.gather_pages(pool, chosen),
        },
        nbytes,
    )
    bench.measure(
        "scatter",
        tag,
        {
            "triton": lambda: ops.scatter_pages(pool, chosen, packed),
            "torch_ref": lambda: reference.scatter_pages(pool, chosen, packed),
        },
        nbytes,
    )

    tokens = pages * page_size
    k = torch.randn(tokens, kv_heads, head_dim, device="cuda", dtype=dtype)
    v = torch.randn_like(k)
    slots = torch.randperm(4 * pages * page_size, device="cuda")[:tokens]
    nbytes = 4 * k.numel() * k.element_size() + slots.numel() * 8
    bench.measure(
        "store_kv",
        f"T={tokens} h={kv_heads} d={head_dim} {str(dtype)[6:]}",
        {
            "triton": lambda: ops.store_kv(pool[0], pool[1], k, v, slots),
            "torch_ref": lambda: reference.store_kv(pool[0], pool[1], k, v, slots),
        },
        nbytes,
    )


def report(bench: Bench, device: str) -> str:
    """The rows as Markdown, under the device and the peak bandwidth used."""
    lines = [
        f"# Triton kernel benchmark on {device}",
        "",
        f"Peak HBM bandwidth used: {bench.peak} GB/s. `vs triton` = impl time / Triton time (>1: Triton "
        "faster).",
        "",
        "| kernel | config | impl | ms | GB/s | % peak | TFLOP/s | vs triton | note |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in bench.rows:
        cells = [r.kernel, r.config, r.impl, r.ms, r.gbps, r.peak_pct, r.tflops, r.vs_triton, r.note]
        lines.append("| " + " | ".join("" if c is None else str(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Benchmark the radixserve Triton kernels on a CUDA GPU.")
    parser.add_argument(
        "--peak-gbps", type=float, default=None, help="device peak HBM GB/s (default: from a table)"
    )
    parser.add_argument("--quick", action="store_true", help="only the headline decode cases")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "kernels_gpu.py needs a CUDA GPU (torch.cuda.is_available() is False); nothing measured.",
            file=sys.stderr,
        )
        return 1
    device = torch.cuda.get_device_name()
    bench = Bench(peak_gbps(device, args.peak_gbps))
    if bench.peak is None:
        print(f"unknown peak bandwidth for {device!r}; pass --peak-gbps for % of peak", file=sys.stderr)
    torch.manual_seed(0)
    for dtype in (torch.float16, torch.bfloat16):
        bench_decode(bench, 64, 4096, 32, 8, 128, 16, dtype)
    if not args.quick:
        bench_decode(bench, 1, 32768, 32, 8, 128, 16, torch.float16)
        bench_decode(bench, 256, 1024, 9, 3, 64, 16, torch.float16)
        bench_decode(bench, 64, 4096, 32, 8, 128, 1, torch.float16)
        bench_decode(bench, 64, 4096, 32, 8, 128, 64, torch.bfloat16)
        bench_extend(bench, 8, 0, 2048, 32, 8, 128, 16, torch.float16)
        bench_extend(bench, 8, 4096, 512, 32, 8, 128, 16, torch.bfloat16)
        bench_kv_ops(bench, 32, 1024, 16, 8, 128, torch.float16)
    payload = {"device": device, "peak_gbps": bench.peak, "rows": [asdict(r) for r in bench.rows]}
    write_results("kernels_gpu", payload, markdown=report(bench, device))
    return 0


if __name__ == "__main__":
    sys.exit(main())
