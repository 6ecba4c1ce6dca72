"""``radixserve serve --replicas 2`` (a local Ray instance of its own) ends on SIGTERM as the single-engine
server does: it drains and exits 0. Ray's core worker used to turn SIGTERM into a native stack trace and
an abort of the driver (scale/launch.py)."""

from __future__ import annotations

import signal
from pathlib import Path

from ray_util import require_ray
from server_util import serve_cli

require_ray()


def test_sigterm_with_two_replicas_drains_and_exits_0(tiny_llama: Path, tmp_path: Path) -> None:
    log = tmp_path / "serve.log"
    flags = ("--model", str(tiny_llama), "--replicas", "2", "--engine-threads", "1", "--enforce-eager")
    with serve_cli(log, *flags, "--page-size", "4", "--num-pages", "256", up_s=300) as (proc, c):
        body = {"model": tiny_llama.name, "prompt": "Hello", "max_tokens": 4, "temperature": 0}
        assert c.post("/v1/completions", json=body).status_code == 200
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    out = log.read_text()
    assert proc.returncode == 0, out[-3000:]
    assert "Aborted" not in out and "SIGTERM received" not in out, out[-3000:]
