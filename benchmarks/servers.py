"""Server processes for the benchmarks: one engine at a time on a free loopback port."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

# The model name every benchmark server serves under (run_vllm.sh and run_llama_server.sh use it too).
SERVED_NAME = "smollm2"


def radixserve_command(port: int, kv_cache_gb: float, *flags: str) -> list[str]:
    """``radixserve serve`` on ``port`` as the benchmarks run it: served as "bench", warnings only."""
    return [
        sys.executable,
        "-m",
        "radixserve.cli",
        "serve",
        "--port",
        str(port),
        "--served-model-name",
        "bench",
        "--log-level",
        "warning",
        "--kv-cache-gb",
        str(kv_cache_gb),
        *flags,
    ]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """One engine's server process (in its own process group) on 127.0.0.1:port."""

    def __init__(self, engine: str, cmd: list[str], port: int, log_dir: Path) -> None:
        log_dir.mkdir(parents=True, exist_ok=True)
        self.engine = engine
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_dir / f"{engine}.log"
        self._log = self.log_path.open("w")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True, env=env
        )

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with httpx.Client(base_url=self.url, trust_env=False, timeout=5) as http:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"{self.engine} exited with {self.proc.returncode}; see {self.log_path}"
                    )
                try:
                    if http.get("/v1/models").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(1.0)
        raise RuntimeError(f"{self.engine} not ready after {timeout_s:.0f} s; see {self.log_path}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        self._log.close()


@contextlib.contextmanager
def serving(name: str, cmd: list[str], port: int, log_dir: Path, timeout_s: float = 300.0) -> Iterator[str]:
    """Start ``cmd`` (which must listen on ``port``), wait until it answers, yield its URL, stop it."""
    server = Server(name, cmd, port, log_dir)
    try:
        server.wait_ready(timeout_s)
        yield server.url
    finally:
        server.stop()
