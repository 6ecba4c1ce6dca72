"""HTTP overhead on a multi-turn trace: the server against the offline engine given the same trace.

The trace is the ``multiturn`` workload (benchmarks/lib/workloads.py): S conversations of T turns, each
turn sent when the conversation's previous answer came back, so every request extends a prefix the
cache holds and arrivals follow completions. Both sides do the same work: greedy, ``ignore_eos``,
the same ``max_tokens`` per turn, answers fed back into the next turn's messages, a fresh prefix
cache.

- HTTP: ``radixserve serve`` in its own processes (front-end + engine), driven by the benchmark's
  streaming client (``serve_bench``, /v1/chat/completions, closed loop with one worker per
  conversation).
- Offline: the ``Engine`` in this process, built and stepped on one worker thread (as the engine
  process does; see model/runner.py for why one thread), replaying the same conversations: a conversation's
  next turn is added when its previous answer finished.

The offline run happens after the server has exited, so the two never compete for the CPU.
Throughput is output tokens over wall time; the overhead is 1 - HTTP / offline.

    python -m benchmarks.serving.http_overhead [--sessions 8] [--turns 4] [--turn-tokens 128] \
        [--output-tokens 64]

Writes benchmarks/results/http_overhead.{json,md}.
"""

from __future__ import annotations

import argparse
import threading
import time
from typing import Any

from benchmarks.lib.common import RESULTS, machine, write_results
from benchmarks.lib.loadgen import RunConfig, run_benchmark
from benchmarks.lib.servers import free_port, radixserve_command, serving
from benchmarks.lib.workloads import Corpus, Workload, WorkloadSpec, build_workload, load_tokenizer
from radixserve import Engine, SamplingParams
from radixserve.engine.deltas import OutputAssembler


def workload(args: argparse.Namespace, tokenizer: Any, corpus: Corpus) -> Workload:
    spec = WorkloadSpec(
        "multiturn",
        seed=args.seed,
        output_tokens=args.output_tokens,
        num_sessions=args.sessions,
        turns=args.turns,
        turn_tokens=args.turn_tokens,
    )
    return build_workload(spec, tokenizer, corpus)


def run_http(args: argparse.Namespace, trace: Workload, tokenizer: Any) -> dict[str, Any]:
    port = free_port()
    cmd = radixserve_command(port, *args.server_args, kv_cache_gb=args.kv_cache_gb)
    with serving("radixserve", cmd, port, RESULTS / "logs") as url:
        cfg = RunConfig(
            url,
            request_rate=None,
            concurrency=args.sessions,
            max_requests=trace.num_turns,
            max_duration_s=args.max_duration,
            label="http",
        )
        doc = run_benchmark(cfg, trace, tokenizer, progress=False)
    s = doc["summary"]
    return {
        "output_tokens": s["output_tokens"],
        "wall_s": s["duration_s"],
        "tokens_per_s": s["output_throughput"],
        "ttft_p50_ms": s["ttft"]["p50_ms"],
        "errors": s["errors"],
    }


def run_offline(args: argparse.Namespace, trace: Workload) -> dict[str, Any]:
    result: dict[str, Any] = {}

    def build_and_replay() -> None:
        # On a worker thread, as in the engine process, which also builds the engine on the thread
        # that steps it (two threads running model code make every step slower: model/runner.py).
        engine = Engine(kv_cache_gb=args.kv_cache_gb)
        engine.generate(
            ["Say hello."], SamplingParams(max_tokens=4, temperature=0)
        )  # warm-up, as the client does
        engine.flush_cache()
        result.update(replay(engine, trace))

    worker = threading.Thread(target=build_and_replay)
    worker.start()
    worker.join()
    return result


def replay(engine: Engine, trace: Workload) -> dict[str, Any]:
    """Every conversation at once; a conversation's next turn goes in when its answer is out."""
    open_: dict[str, tuple[int, int, OutputAssembler]] = {}
    ttfts: list[float] = []

    def add(session: int, turn: int) -> None:
        s = trace.sessions[session]
        ids = engine.apply_chat_template(s.messages(turn))
        params = SamplingParams(max_tokens=s.turns[turn].max_tokens, temperature=0, ignore_eos=True)
        rid = engine.add_request(ids, params)
        open_[rid] = (session, turn, OutputAssembler(rid, None, ids, 1, time.monotonic()))

    start = time.perf_counter()
    for i in range(len(trace.sessions)):
        add(i, 0)
    tokens = 0
    while open_:
        for out in engine.step():
            session, turn, asm = open_[out.group_id]
            asm.add(out)
            if not asm.finished:
                continue
            del open_[out.group_id]
            res = asm.result
            tokens += len(res.token_ids)
            ttfts.append((res.first_token_time or res.arrival_time) - res.arrival_time)
            trace.sessions[session].answers.append(res.text)
            if turn + 1 < len(trace.sessions[session].turns):
                add(session, turn + 1)
    wall = time.perf_counter() - start
    return {
        "output_tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "ttft_p50_ms": sorted(ttfts)[len(ttfts) // 2] * 1e3,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--turn-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--kv-cache-gb", type=float, default=1.0)
    ap.add_argument("--max-duration", type=float, default=600.0)
    ap.add_argument("--seed", type=int, default=2)
    ap.add_argument(
        "--server-args", nargs=argparse.REMAINDER, default=[], help="extra `radixserve serve` flags"
    )
    args = ap.parse_args()
    from radixserve.model.default_model import prepare_default_model

    tokenizer = load_tokenizer(str(prepare_default_model(progress=False)))
    corpus = Corpus(tokenizer)
    http = run_http(args, workload(args, tokenizer, corpus), tokenizer)
    offline = run_offline(args, workload(args, tokenizer, corpus))
    ratio = http["tokens_per_s"] / offline["tokens_per_s"]
    m = machine()
    result = {
        "machine": m,
        "args": vars(args),
        "http": http,
        "offline": offline,
        "http_over_offline": ratio,
        "overhead_pct": (1 - ratio) * 100,
    }
    md = (
        f"# HTTP overhead on a multi-turn trace ({args.sessions} conversations x {args.turns} turns of "
        f"{args.turn_tokens} tokens, {args.output_tokens}-token answers, greedy)\n\n"
        f"Machine: {m['cpu']} ({m['cpus']} cores), torch {m['torch']}, {m['date']}\n\n"
        "| path | output tokens | wall (s) | tokens/s | TTFT p50 (ms) |\n|---|---:|---:|---:|---:|\n"
        f"| HTTP /v1/chat/completions (SSE), engine process | {http['output_tokens']} | {http['wall_s']:.2f} "
        "| "
        f"{http['tokens_per_s']:.1f} | {http['ttft_p50_ms']:.0f} |\n"
        f"| offline Engine, same trace | {offline['output_tokens']} | {offline['wall_s']:.2f} | "
        f"{offline['tokens_per_s']:.1f} | {offline['ttft_p50_ms']:.0f} |\n\n"
        f"HTTP / offline throughput: {ratio:.3f} (overhead {result['overhead_pct']:.1f}%; target <= 10%)\n"
    )
    write_results("http_overhead", result, markdown=md)


if __name__ == "__main__":
    main()
