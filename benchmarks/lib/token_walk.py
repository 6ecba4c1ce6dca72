"""Measure the walk of a generated token in calls (issue 55), with the tracer of calltrace.py.

- The offline engine (``offline_rates``): calls into radixserve per decode step of ``Engine.generate``
  at a batch, marginal over two run lengths.
- A real server (``traced_server``, ``served_rates``): ``radixserve serve`` of the default model whose
  API server and engine process trace themselves from their start. ``traced_environment`` puts a
  ``sitecustomize`` first on the server's PYTHONPATH (the engine process inherits the environment); it
  loads calltrace.py by path and calls ``install_dumper``, which names the process in
  ``<folder>/<pid>.hello`` and writes its counts to ``<folder>/<pid>.json`` on each SIGUSR1
  (``request_dump``). Calls per streamed token come from requests of two lengths, each process apart.

``python -m benchmarks.step.walk_counts`` runs both and writes the results;
tests/server/test_token_walk.py and tests/engine/test_token_walk_offline.py hold them to budgets.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.lib import calltrace
from benchmarks.lib.calltrace import CallTracer, Rates, marginal, package_roots

# What traces a served process: the environment variable naming the folder its counts are dumped in.
ENV_DIR = "RADIXSERVE_TEST_CALLTRACE"
ENV_MODULE = "RADIXSERVE_CALLTRACE_MODULE"  # calltrace.py, which the sitecustomize loads by path
ENGINE_MODULE = "radixserve.runtime.engine_process"  # in the engine process's command line


# -- the offline engine -----------------------------------------------------------------------------
# Prompts of one length on the default model's tokenizer, so that a batch is alike.
PROMPTS = tuple(f"Count from {i} to {i + 50} in words, one number a line:" for i in range(1, 65))


def offline_rates(engine: Any, batch: int, short: int = 16, long: int = 48) -> Rates:
    """Calls of each project function per decode step of ``batch`` requests in ``engine.generate``
    (the offline API). Marginal: ``batch`` prompts are generated to ``short`` and then to ``long``
    tokens each (greedy, ignore_eos), and the difference is divided by ``long - short``, so what a
    request costs once (its tokenization, prefill, finish) cancels. A first run to ``long`` tokens
    warms up and leaves the radix tree as both measured runs find and leave it, so their prefix
    matches and inserts are alike. At batch 1 a step is a token."""
    from radixserve.sampling.params import SamplingParams

    prompts = list(PROMPTS[:batch])

    def run(tokens: int) -> None:
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        outs = engine.generate(prompts, params)
        assert all(len(o.outputs[0].token_ids) == tokens for o in outs)

    run(long)
    with CallTracer() as tracer:
        c0, r0, a0 = tracer.snapshot(), tracer.resumptions(), tracer.awaits()
        run(short)
        c1, r1, a1 = tracer.snapshot(), tracer.resumptions(), tracer.awaits()
        run(long)
        c2, r2, a2 = tracer.snapshot(), tracer.resumptions(), tracer.awaits()
    steps = long - short
    return Rates(
        marginal(c1 - c0, c2 - c1, steps),
        marginal(r1 - r0, r2 - r1, steps),
        marginal(a1 - a0, a2 - a1, steps),
        str(package_roots()[0][0]),
    )


# -- a served process, traced from its start ----------------------------------------------------------
SITECUSTOMIZE = f'''"""Traces this process's calls into radixserve (benchmarks/lib/calltrace.py)
when {ENV_DIR} names a folder: written by token_walk.traced_environment, first on the served
processes' PYTHONPATH."""
import os

if os.environ.get("{ENV_DIR}"):
    import importlib.util
    import sys

    _spec = importlib.util.spec_from_file_location("radixserve_calltrace", os.environ["{ENV_MODULE}"])
    assert _spec is not None and _spec.loader is not None
    _module = importlib.util.module_from_spec(_spec)
    sys.modules["radixserve_calltrace"] = _module
    _spec.loader.exec_module(_module)
    _module.install_dumper(os.environ["{ENV_DIR}"])
'''


@dataclass
class Dump:
    calls: Counter[str]
    resumed: Counter[str]
    awaits: Counter[str]


def request_dump(folder: Path, pid: int, timeout_s: float = 120.0) -> Dump:
    """Signal process ``pid`` (traced by ``install_dumper``) and read the counts it writes."""
    path = folder / f"{pid}.json"
    path.unlink(missing_ok=True)
    os.kill(pid, signal.SIGUSR1)
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"process {pid} wrote no counts in {timeout_s:.0f} s")
        time.sleep(0.02)
    doc = json.loads(path.read_text())
    return Dump(Counter(doc["calls"]), Counter(doc["resumed"]), Counter(doc["awaits"]))


def traced_processes(folder: Path) -> dict[int, dict[str, Any]]:
    """The traced processes that are still alive: pid -> what the process said of itself at its
    start (``argv``, its command line; ``package``, the radixserve folder it imports)."""
    alive: dict[int, dict[str, Any]] = {}
    for hello in folder.glob("*.hello"):
        doc = json.loads(hello.read_text())
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(doc["pid"], 0)
            alive[doc["pid"]] = doc
    return alive


@contextlib.contextmanager
def traced_environment(folder: Path, root: Path | None = None) -> Iterator[None]:
    """While the block runs, processes started with ``os.environ`` trace themselves into ``folder``:
    a ``sitecustomize`` first on PYTHONPATH (then ``root``, the tree whose radixserve they import,
    where given), and the variables it reads."""
    site = folder / "site"
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_bytes(SITECUSTOMIZE.encode())
    dumps = folder / "dumps"
    dumps.mkdir(exist_ok=True)
    paths = [str(site), *([str(root)] if root is not None else [])]
    old = {k: os.environ.get(k) for k in ("PYTHONPATH", ENV_DIR, ENV_MODULE)}
    os.environ["PYTHONPATH"] = os.pathsep.join(paths + ([old["PYTHONPATH"]] if old["PYTHONPATH"] else []))
    os.environ[ENV_DIR] = str(dumps)
    os.environ[ENV_MODULE] = str(Path(calltrace.__file__).resolve())
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def traced_server(
    log_dir: Path, root: Path | None = None, up_s: float = 900.0
) -> Iterator[tuple[str, Path, int]]:
    """``radixserve serve`` of the default model, its processes traced from their start; yields its
    URL, the folder of the dumps and the API server's pid, and stops it after. The command is
    benchmarks/lib/servers.py's, with a small pool, no dashboard (its sampler runs on the clock; and
    at 3c9dc4f it looks for its pages in a folder that moved) and one engine thread (the walk is the
    same with more, and one thread keeps a loaded machine's steps short)."""
    from benchmarks.lib import servers

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        port = servers.free_port()
        cmd = servers.radixserve_command(port, "--no-dashboard", kv_cache_gb=0.1, threads=1)
        with traced_environment(folder, root):
            server = servers.Server("radixserve", cmd, port, log_dir)
        try:
            server.wait_ready(up_s, "/health")
            yield server.url, folder / "dumps", server.proc.pid
        finally:
            server.stop()


def stream_chat(http: Any, model: str, max_tokens: int) -> int:
    """One streamed chat completion (greedy, ignore_eos, usage in the last chunk) read to its end;
    the completion tokens it reports."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    tokens = -1
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage")
                if usage:
                    tokens = usage["completion_tokens"]
    return int(tokens)


def served_rates(
    url: str,
    model: str,
    dumps: Path,
    server_pid: int,
    short: int = 16,
    long: int = 80,
    settle_s: float = 1.0,
) -> dict[str, Rates]:
    """Calls per streamed token in the API server (``server_pid``) and in its engine process, both
    traced into ``dumps`` (``traced_server``). A warm-up request to ``long`` tokens, then one to
    ``short`` and one to ``long``, each read to its end and left ``settle_s`` to finish in both
    processes before their counts are read: per token = ((after long - after short) - (after short -
    after warm-up)) / (long - short), so what a request costs once cancels. Every request streams the
    same prompt greedily, so the short one's tokens are the long one's first."""
    import httpx

    traced = traced_processes(dumps)
    engines = [p for p, hello in traced.items() if any(ENGINE_MODULE in a for a in hello["argv"])]
    assert len(engines) == 1, f"expected one traced engine process, found {traced}"
    assert server_pid in traced, "the API server is not traced"
    pids = {"api_server": server_pid, "engine": engines[0]}
    dumps_at: list[dict[str, Dump]] = []
    with httpx.Client(base_url=url, timeout=600, trust_env=False) as http:
        for i, tokens in enumerate((long, short, long)):
            got = stream_chat(http, model, tokens)
            assert got == tokens, f"asked for {tokens} tokens, got {got}"
            if i == 0:  # the first dump names every code object run so far (seconds): not in a phase
                time.sleep(settle_s)
                for pid in pids.values():
                    request_dump(dumps, pid)
            time.sleep(settle_s)
            dumps_at.append({k: request_dump(dumps, pid) for k, pid in pids.items()})
    out: dict[str, Rates] = {}
    for k in pids:
        d0, d1, d2 = (d[k] for d in dumps_at)
        out[k] = Rates(
            marginal(d1.calls - d0.calls, d2.calls - d1.calls, long - short),
            marginal(d1.resumed - d0.resumed, d2.resumed - d1.resumed, long - short),
            marginal(d1.awaits - d0.awaits, d2.awaits - d1.awaits, long - short),
            traced[pids[k]]["package"],
        )
    return out
