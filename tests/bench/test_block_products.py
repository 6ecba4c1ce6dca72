"""``benchmarks/kernels/block_products.py --gguf``: one layer of a real file's weights, as stored, timed
kernel by kernel and totalled by type (llama-quantize's k-quants, Q2_K included, which gguf's writer
cannot make)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.kernels import block_products
from radixserve.kernels import cpu_build, gguf_int8

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "kquant_tiny.gguf"


@pytest.mark.skipif(not cpu_build.load(), reason="no C++ CPU kernels here (they need a compiler)")
def test_a_files_layer_is_timed_by_type(tmp_path: Path) -> None:
    block_products.main(
        ["--gguf", str(FIXTURE), "--layer", "1", "--rows", "8", "--rounds", "1"]
        + ["--out-dir", str(tmp_path), "--name", "bp"]
    )
    doc = json.loads((tmp_path / "bp.json").read_text())
    products = doc["products"]
    # Layer 1 of the fixture: Q5_K q/k/v, a Q3_K output, Q2_K gate and up, an IQ4_NL down.
    assert {(p["type"], p["n"], p["k"]) for p in products if p["kernel"] == "exact"} == {
        ("Q5_K", 256, 256),
        ("Q5_K", 64, 256),
        ("Q3_K", 256, 256),
        ("Q2_K", 160, 256),
        ("IQ4_NL", 256, 160),
    }
    kernels = {p["kernel"] for p in products}
    assert {"exact", "bf16 copy"} <= kernels and ("int8" in kernels) == gguf_int8.available()
    assert all(p["s"] > 0 and p["gflops"] > 0 for p in products)
    table = (tmp_path / "bp.md").read_text()
    assert "kquant_tiny.gguf, layer 1" in table and "| Q2_K | exact |" in table
