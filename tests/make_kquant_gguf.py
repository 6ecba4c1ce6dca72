"""Makes ``tests/data/kquant_tiny.gguf``: a tiny random Llama (``gguf_files.KQUANT_DIMS``, tied LM head)
written in F32 by gguf's writer, then quantized by llama.cpp's own ``llama-quantize`` to Q4_K_M, with
per-tensor overrides in layer 1 so that the file holds blocks of Q4_K, Q5_K, Q6_K, Q5_0, Q2_K, Q3_K and
IQ4_NL from a real producer (the fallback of Q4_K for down_proj's 160-wide rows gives Q5_0; the tied
embedding, quantized as an output tensor, Q6_K).

Why llama.cpp and not gguf's writer: gguf's Python package cannot quantize the k-quants, and what
users serve is what llama-quantize writes. The committed file is a few hundred KB; CI only reads it.

    python tests/make_kquant_gguf.py /work/peers/llama.cpp-build/bin/llama-quantize
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

from gguf import GGMLQuantizationType, GGUFReader
from gguf_files import KQUANT_DIMS, write_tiny_gguf

FIXTURE = Path(__file__).resolve().parent / "data" / "kquant_tiny.gguf"
# Layer 1: each fused projection (q/k/v, gate/up) one type, so the native decode step serves it too.
OVERRIDES = {
    r"blk\.1\.attn_[qkv]": "q5_k",
    r"blk\.1\.attn_output": "q3_k",
    r"blk\.1\.ffn_(gate|up)": "q2_k",
    r"blk\.1\.ffn_down": "iq4_nl",
}


def make(quantize: Path, out: Path = FIXTURE) -> dict[str, str]:
    """Write the fixture with ``quantize`` (llama-quantize); returns each tensor's type."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        f32 = Path(tmp) / "f32.gguf"
        write_tiny_gguf(f32, GGMLQuantizationType.F32, GGMLQuantizationType.F32, None, 1, KQUANT_DIMS)
        args = [str(quantize)]
        for pattern, qtype in OVERRIDES.items():
            args += ["--tensor-type", f"{pattern}={qtype}"]
        subprocess.run([*args, str(f32), str(out), "Q4_K_M"], check=True)
    return {t.name: t.tensor_type.name for t in GGUFReader(out).tensors}


if __name__ == "__main__":
    types = make(Path(sys.argv[1]))
    for name, qtype in types.items():
        print(f"{name:32s} {qtype}")
    print(f"{FIXTURE}: {FIXTURE.stat().st_size} bytes")
