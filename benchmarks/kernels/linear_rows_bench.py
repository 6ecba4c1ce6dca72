"""Many-row products on padded row counts against the row counts as they come, in one process.

``radixserve_cpu::linear`` pads a product of more than 8 rows with zero rows up to one of a few counts
(``kernels/csrc/linear.cpp``: 8 counts per doubling), because oneDNN keeps a primitive (its JIT code
and plan) per distinct shape, up to 1024 of them, and a prefill's row count takes any value: the
engine's memory grew by hundreds of MB over a soak. This measures what the padding costs and saves on
one decoder layer's products of SmolLM2-135M (qkv, o, gate_up, down; random fp32 weights, prepacked as
the engine does), over ``--counts`` row counts drawn from 9 to ``--max-rows``:

- ``first``: each count's first product (a new count makes new primitives);
- ``again``: the same counts again, the two ways taken alternately (caches warm: the padding's extra rows);
- ``MB``: glibc's bytes in use after the first pass, less before it.

The unpadded side calls oneDNN's packed product directly (the engine's path before), on counts that
are not themselves padded counts, so neither side finds the other's primitives cached.

    python -m benchmarks.kernels.linear_rows_bench [--counts 200] [--max-rows 1024] [--repeats 5]

Writes benchmarks/results/<name>.{json,md}.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.lib.common import alternate, machine, markdown_table, write_results
from radixserve.engine.heap_trim import malloc_in_use_bytes
from radixserve.model.layers import Linear, padded_rows

SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576)}  # (in, out)


def in_use_mb() -> float:
    got = malloc_in_use_bytes()
    if got is None:
        raise SystemExit("needs glibc's mallinfo2 to count the memory in use")
    return got / 2**20


def run(counts: int, max_rows: int, repeats: int, seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    layers = {name: Linear(k, n, bias=False) for name, (k, n) in SHAPES.items()}
    for lin in layers.values():
        lin.prepack()
        if lin.packed is None or lin.packed_linear is None:
            raise SystemExit("needs oneDNN and the C++ CPU kernels (radixserve_cpu::linear)")
    candidates = [m for m in range(9, max_rows + 1) if padded_rows(m) != m]
    rows = random.Random(seed).sample(candidates, min(counts, len(candidates)))
    xs = {name: torch.randn(max_rows, k) for name, (k, _) in SHAPES.items()}

    def padded() -> None:
        for m in rows:
            for name, lin in layers.items():
                lin(xs[name][:m])

    def unpadded() -> None:
        for m in rows:
            for name, lin in layers.items():
                torch.ops.mkldnn._linear_pointwise(xs[name][:m], lin.packed, None, "none", [], "")

    ways: dict[str, Callable[[], None]] = {"padded": padded, "unpadded": unpadded}
    first: dict[str, float] = {}
    grew: dict[str, float] = {}
    with torch.no_grad():
        for name, fn in ways.items():
            before, start = in_use_mb(), time.perf_counter()
            fn()
            first[name], grew[name] = time.perf_counter() - start, in_use_mb() - before
        again = alternate(ways, repeats)
    distinct = {"padded": len({padded_rows(m) for m in rows}), "unpadded": len(rows)}
    return {
        "row_counts": sorted(rows),
        "ways": [
            {
                "way": name,
                "distinct_counts": distinct[name],
                "first_s": first[name],
                "again_s": again[name],
                "mb_grew": grew[name],
            }
            for name in ways
        ],
        "padded_vs_unpadded_first": first["unpadded"] / first["padded"],
        "padded_vs_unpadded_again": again["unpadded"] / again["padded"],
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--counts", type=int, default=200)
    p.add_argument("--max-rows", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--name", default="linear_rows_bench")
    args = p.parse_args(argv)
    result = run(args.counts, args.max_rows, args.repeats, args.seed)
    rows = [
        [w["way"], w["distinct_counts"], w["first_s"] * 1e3, w["again_s"] * 1e3, w["mb_grew"]]
        for w in result["ways"]
    ]
    header = ["way", "distinct row counts", "first pass ms", "again ms (median)", "MB in use grew"]
    md = "\n".join(
        [
            f"# One layer's products (SmolLM2-135M shapes) over {len(result['row_counts'])} row counts, "
            f"9-{args.max_rows}",
            "",
            f"Machine: {machine()}",
            "",
            *markdown_table(header, rows),
            "",
            f"Unpadded / padded time: first pass {result['padded_vs_unpadded_first']:.2f}x, "
            f"again {result['padded_vs_unpadded_again']:.2f}x (above 1: padded is faster).",
        ]
    )
    write_results(args.name, {"args": vars(args), **result}, markdown=md)


if __name__ == "__main__":
    main()
