"""The engine loop's host time per step, with the model's forward taken out (issue 55, item 4).

A stub replaces ``ModelRunner.run`` (here only): a step returns fixed logits, a row per chunk, whose
greedy pick is " the"; no layer runs. The 135M model is loaded (config, tokenizer, detokenizer) but
never run. Requests: greedy, ``ignore_eos``, ``max_tokens`` past the timed window. Each tree under
test runs in fresh processes (``PYTHONPATH`` and cwd: the tree), trees in turn, the order flipped
each round; medians over steps (or streams), then over rounds:
- offline: ms per step in steady decode of ``Engine.step()`` (wall; and CPU of the stepping thread,
  which load on a shared machine inflates less) and of ``EngineLoop._step`` (the engine process's
  step: the step, its stats, the StepReport encoded and sent over ipc).
- HTTP: ``radixserve serve --no-dashboard`` (3c9dc4f cannot load its pages), its engine process
  stubbed by a sitecustomize.py on its ``PYTHONPATH``; B concurrent streaming /v1/completions here.
  Per step: a stream's (last - first chunk) / (max_tokens - 1); ITL p50 over the gaps between a
  stream's chunks (steps read in one burst: near-zero gaps).
- the real model (no stub; one round): ``Engine.step()`` and its forward (``runner.run``) in steady
  decode, at 135M and at the 1B shape (benchmarks/step/big_model.py).

    git worktree add --detach /tmp/host_before 3c9dc4f
    python -m benchmarks.step.host_step --trees before=/tmp/host_before,after=.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import torch
import zmq

# radixserve is imported inside the functions that run in a tree's process, benchmarks.lib inside the
# parent's: this file runs under every tree under test, and as a sitecustomize hook.
HERE = Path(__file__).resolve()
STUB_ENV = "RADIXSERVE_HOST_STEP_STUB"  # set (to the token id greedy picks): the forward is a stub
THE = 260  # " the" in SmolLM2's tokenizer: not EOS, one token, plain text
PROMPT = "Request {}: tell me a story about the sea."
SITECUSTOMIZE = f"""import os
if os.environ.get({STUB_ENV!r}):  # the API server imports torch anyway; the engine process, the runner
    import importlib.util, sys
    spec = importlib.util.spec_from_file_location("_host_step", {str(HERE)!r})
    host_step = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(host_step)
    import radixserve.model.runner as runner
    host_step.stub_forward(runner.ModelRunner, int(os.environ[{STUB_ENV!r}]))
    print("host_step: stubbed forward, radixserve from", runner.__file__, file=sys.stderr)
"""


def stub_forward(runner_cls: Any, token: int) -> None:
    """``runner_cls.run`` returns fixed logits (a preallocated table's first rows, one per chunk) where
    ``token`` wins greedy; the model is never called. The sampler indexes the rows (a copy)."""
    output = sys.modules[runner_cls.__module__].RunnerOutput

    def run(self: Any, chunks: list[Any], pending: Any = None) -> Any:
        table = self.__dict__.get("_stub_logits")
        if table is None or table.shape[0] < len(chunks):
            table = torch.zeros(max(256, len(chunks)), self.model.config.vocab_size)
            table[:, token] = 10.0
            self._stub_logits = table
        return output(table[: len(chunks)], {})

    runner_cls.run = run


# -- in a tree's process ------------------------------------------------------------------------------
def decode_steps(engine: Any, batch: int, steps: int, loop: Any, reader: zmq.Socket) -> dict[str, Any]:
    """Median ms per step of ``Engine.step()`` and of ``loop._step()`` with ``batch`` decoding."""
    from radixserve import SamplingParams

    params = SamplingParams(max_tokens=2 * steps + 64, temperature=0.0, ignore_eos=True)
    rids = [engine.add_request(PROMPT.format(i), params) for i in range(batch)]
    started: set[str] = set()
    for _ in range(batch + 100):  # prefill: until every request has its first token
        started |= {o.group_id for o in engine.step()}
        if len(started) == batch:
            break
    assert len(started) == batch, f"{batch - len(started)} of {batch} requests never started"
    for _ in range(4):
        engine.step()
    out: dict[str, Any] = {}
    for name, step in (("step", engine.step), ("loop_step", loop._step)):
        wall, cpu = [], []
        for _ in range(steps):
            t, c = time.perf_counter(), time.thread_time()
            step()
            wall.append((time.perf_counter() - t) * 1e3)
            cpu.append((time.thread_time() - c) * 1e3)
            while reader.poll(0):  # what the loop sent
                reader.recv()
        out |= {f"{name}_ms": statistics.median(wall), f"{name}_cpu_ms": statistics.median(cpu)}
    assert len(engine.scheduler.running) == batch, "the batch did not stay full"
    for rid in rids:
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    return out


def offline(model: str | None, batches: list[int], steps: int, stub: int | None, threads: int) -> dict:
    """Build an engine (its forward stubbed when ``stub`` is a token id) and time its steps."""
    import radixserve
    from radixserve.engine.engine import Engine
    from radixserve.model.runner import ModelRunner
    from radixserve.runtime.engine_loop import EngineLoop

    torch.set_num_threads(threads or len(os.sched_getaffinity(0)))  # as the engine process does
    if stub is not None:
        stub_forward(ModelRunner, stub)
    pages = max(batches) * -(-(2 * steps + 96) // 16) + 64
    engine = Engine(model, max_running_requests=max(batches), num_pages=pages)
    calls: list[Any] = []  # the model's modules called (the torch and the native step end in lm_head)
    for module in engine.model.modules() if stub is not None else ():
        module.register_forward_pre_hook(lambda *_: calls.append(None))
    forward_ms: list[float] = []
    run = engine.runner.run

    def timed_run(chunks: Any, pending: Any = None) -> Any:  # the forward's share of a real step
        t = time.perf_counter()
        out = run(chunks, pending)
        forward_ms.append((time.perf_counter() - t) * 1e3)
        return out

    engine.runner.run = timed_run  # type: ignore[method-assign]
    ctx, addr = zmq.Context(), f"ipc://{tempfile.mkdtemp()}/host_step"
    outbox, reader, inbox = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL), ctx.socket(zmq.PULL)
    outbox.bind(addr)
    reader.connect(addr)
    loop = EngineLoop(engine, inbox, outbox, threading.Event())

    result: dict[str, Any] = {"radixserve": radixserve.__file__, "threads": torch.get_num_threads()}
    for b in batches:
        calls.clear()
        forward_ms.clear()
        row = result[str(b)] = decode_steps(engine, b, steps, loop, reader)
        row["model_calls"] = len(calls)
        if stub is None:
            row["forward_ms"] = statistics.median(forward_ms[-2 * steps :])  # the two timed runs, the last
    ctx.destroy(linger=0)
    engine.close()
    return result


def child(tree: str, **kwargs: Any) -> dict[str, Any]:
    """``offline(**kwargs)`` in a fresh process that imports radixserve from ``tree``."""
    cmd = [sys.executable, "-c", f"import runpy; runpy.run_path({str(HERE)!r}, run_name='__main__')"]
    env = {k: v for k, v in os.environ.items() if k != STUB_ENV} | {"PYTHONPATH": tree}
    cmd += ["--child", json.dumps(kwargs)]
    out = subprocess.run(cmd, cwd=tree, env=env, stdout=subprocess.PIPE, check=True).stdout
    result: dict[str, Any] = json.loads(out.decode().splitlines()[-1])
    assert Path(result["radixserve"]).is_relative_to(tree), (result["radixserve"], tree)
    return result


# -- through HTTP (this process: the clients) ---------------------------------------------------------
async def stream_batch(url: str, batch: int, max_tokens: int) -> dict[str, float]:
    """``batch`` concurrent streams: ms per step and ITL p50 (the module's docstring)."""
    from benchmarks.lib.servers import SERVED_NAME

    body = {"model": SERVED_NAME, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}

    async def one(http: httpx.AsyncClient, i: int) -> list[float]:
        times, finished = [], False
        request = body | {"prompt": PROMPT.format(i), "stream": True}
        async with http.stream("POST", "/v1/completions", json=request) as r:
            r.raise_for_status()
            async for chunk in r.aiter_bytes():
                if b'"text"' in chunk:
                    times.append(time.perf_counter())
                finished = finished or b'"length"' in chunk
        assert finished, "the stream did not run to max_tokens"
        return times

    limits = httpx.Limits(max_connections=batch + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits, trust_env=False) as http:
        streams = await asyncio.gather(*(one(http, i) for i in range(batch)))
    gaps = [(b - a) * 1e3 for ts in streams for a, b in zip(ts, ts[1:])]
    per_step = [(ts[-1] - ts[0]) * 1e3 / (max_tokens - 1) for ts in streams]
    return {"http_step_ms": statistics.median(per_step), "http_itl_p50_ms": statistics.median(gaps)}


def http(tree: str, batches: list[int], max_tokens: int, threads: int, logs: Path) -> dict[str, Any]:
    """A server from ``tree`` whose engine process has the stub; the streams of each batch in turn."""
    from benchmarks.lib.servers import free_port, radixserve_command, serving

    site = tempfile.mkdtemp()
    with open(Path(site) / "sitecustomize.py", "w") as f:  # the stub's hook, not a result
        f.write(SITECUSTOMIZE)
    port, pages = free_port(), max(batches) * -(-(max_tokens + 32) // 16) + 64
    flags = ["--max-running-requests", str(max(batches)), "--num-pages", str(pages), "--no-dashboard"]
    env = ["env", "-C", tree, f"PYTHONPATH={site}:{tree}", f"{STUB_ENV}={THE}"]  # -m imports from cwd
    cmd = env + radixserve_command(port, *flags, threads=threads)
    with serving(Path(tree).name, cmd, port, logs) as url:
        log = (logs / f"{Path(tree).name}.log").read_text().splitlines()
        stubbed = [line for line in log if "host_step: stubbed" in line]
        assert stubbed and all(tree in line for line in stubbed), f"no stub from {tree}: {log}"
        asyncio.run(stream_batch(url, 4, 16))  # warm-up
        return {str(b): asyncio.run(stream_batch(url, b, max_tokens)) for b in batches}


# -- the report ---------------------------------------------------------------------------------------
MEASURES = {
    "step_ms": "stub: Engine.step ms",
    "step_cpu_ms": "stub: Engine.step CPU ms (stepping thread)",
    "loop_step_ms": "stub: EngineLoop._step ms",
    "http_step_ms": "stub: HTTP ms per step",
    "http_itl_p50_ms": "stub: HTTP ITL p50 ms",
}
for _m in ("135m", "1b"):  # the real model's step (one round), and its forward's share of it
    MEASURES |= {f"{_m}_step_ms": f"{_m} real: Engine.step ms", f"{_m}_forward_ms": f"{_m} real: forward ms"}


def report(args: argparse.Namespace, trees: dict[str, str], runs: dict[str, list[dict[str, Any]]]) -> None:
    from benchmarks.lib.common import RESULTS, cpu_flags, cpu_model, write_results
    from benchmarks.lib.plots import plot_bars

    def median(tree: str, batch: int, key: str) -> float | None:
        values = [r[str(batch)][key] for r in runs[tree] if key in r.get(str(batch), {})]
        return statistics.median(values) if values else None

    names, rows = list(trees), []
    for b in sorted({int(b) for r in runs[names[0]] for b in r if b.isdigit()}):
        for key, label in MEASURES.items():
            ms = [median(t, b, key) for t in names]
            if any(ms):
                rows.append([b, label, *ms, ms[-1] / ms[0] if ms[0] and ms[-1] else None])
    header = ["batch", "measure", *names, f"{names[-1]}/{names[0]}"]
    notes = f"\nTrees: {json.dumps(trees)}; {args.rounds} rounds (real model: one), medians over rounds; "
    notes += f"{args.steps} timed offline steps; HTTP max_tokens {args.max_tokens}; torch threads: "
    notes += f"{args.threads or 'one per core'}. The docstring says what each measure times.\n"
    plotted = [(b, k) for b in args.batches for k in ("step_ms", "http_step_ms")]
    values = {f"B={b} {MEASURES[k]}": {t: median(t, b, k) for t in names} for b, k in plotted}
    cpu = cpu_model()
    tag = "zen4" if cpu_flags()["avx512_bf16"] else f"{cpu.split()[-1].lower()}-avx2"  # epyc-avx2 here
    name = args.name or f"host_step-{tag}"
    plots = plot_bars(values, RESULTS / f"{name}.png", "ms per step", "host time per step, stub forward")
    title = f"Engine host time per step with a stub forward ({cpu}, {os.cpu_count()} cores)"
    payload = {"trees": trees, "args": vars(args), "runs": runs}
    write_results(name, payload, rows, header, title, notes=notes, plots=plots)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--trees", default=f"after={Path.cwd()}", help="name=path,... (the trees under test)")
    p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 64, 256])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=64, help="timed offline steps per batch")
    p.add_argument("--max-tokens", type=int, default=128, help="per HTTP stream")
    p.add_argument("--threads", type=int, default=0, help="the engine's torch threads (0: one per core)")
    p.add_argument("--real", default="135m:1,8,64;1b:1,8", help="model:batches;... of real steps ('': none)")
    p.add_argument("--real-steps", type=int, default=8)
    p.add_argument("--name", default=None, help="result name (default: host_step-<cpu>)")
    args = p.parse_args()
    if args.child is not None:  # in a tree's process
        print(json.dumps(offline(**json.loads(args.child))), flush=True)
        return
    trees = {n: str(Path(t).resolve()) for n, t in (x.split("=") for x in args.trees.split(","))}
    runs: dict[str, list[dict[str, Any]]] = {t: [] for t in trees}
    logs = Path(tempfile.mkdtemp(prefix="host_step-"))
    common = {"batches": args.batches, "steps": args.steps, "threads": args.threads}
    for r in range(args.rounds):
        order = list(trees) if r % 2 == 0 else list(reversed(trees))
        for t in order:
            print(f"round {r}: {t} offline", file=sys.stderr, flush=True)
            got = child(trees[t], model=None, stub=THE, **common)
            assert all(got[str(b)]["model_calls"] == 0 for b in args.batches), "the stub ran the model"
            runs[t].append(got)
        for t in order:
            print(f"round {r}: {t} http", file=sys.stderr, flush=True)
            got = http(trees[t], args.batches, args.max_tokens, args.threads, logs / f"{t}-{r}")
            for b, v in got.items():
                runs[t][-1][b] |= v
    for spec in filter(None, args.real.split(";")):
        from benchmarks.lib.bench_models import LLAMA_1B, build

        m, batches = spec.split(":")
        model = None if m == "135m" else str(build(LLAMA_1B))
        for t in trees:
            print(f"real {m}: {t}", file=sys.stderr, flush=True)
            kw = common | {"batches": [int(b) for b in batches.split(",")], "steps": args.real_steps}
            got = child(trees[t], model=model, stub=None, **kw)
            for b, v in got.items():
                if b.isdigit():
                    runs[t][0].setdefault(b, {}).update({f"{m}_{k}": v[k] for k in ("step_ms", "forward_ms")})
    report(args, trees, runs)


if __name__ == "__main__":
    main()
