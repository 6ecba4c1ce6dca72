"""Every kernel variant the engine launches compiles to PTX and cubin for sm_80 and sm_90, without a GPU.

Compilation needs the real JIT functions, so it runs ``python -m radixserve.kernels.aot`` in
subprocesses with ``TRITON_INTERPRET`` removed (this session runs the interpreter).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

KERNELS = {
    "_store_kv_kernel",
    "_copy_pages_kernel",
    "_decode_stage1_kernel",
    "_decode_stage2_kernel",
    "_extend_kernel",
}
ARCHS = (80, 90)


def test_all_variants_compile_for_sm80_and_sm90(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # cwd outside the repo: from its root, the source tree's radixserve/ would shadow the installed package.
    runs = {
        arch: subprocess.Popen(
            [sys.executable, "-m", "radixserve.kernels.aot", "--arch", str(arch)],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for arch in ARCHS
    }
    for arch, proc in runs.items():
        stdout, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, stderr[-4000:]
        records = [json.loads(line) for line in stdout.splitlines()]
        assert {r["kernel"] for r in records} == KERNELS
        assert {dt for r in records for dt in r["pointers"].values()} >= {"fp16", "bf16"}
        for r in records:
            assert r["arch"] == arch
            assert r["ptx_target"].startswith(f"sm_{arch}"), r
            assert r["ptx_bytes"] > 0 and r["cubin_bytes"] > 0, r
