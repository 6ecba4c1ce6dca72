"""Pinning a shared system prompt (issue 23's benchmark), over HTTP on loopback.

A chat workload with a long system prompt (default 1,500 tokens) shared by every "system" request,
and unrelated "filler" chats between them that fill the KV pool. The pool is sized to hold the pinned
system prompt plus one request of the longest context and little more (``pool_pages``), and each round
sends enough fillers to fill the whole pool (``fillers_for``), so the LRU evicts the unpinned system
prompt every round: without a pin each system request recomputes it; with ``cache_control`` on the
system block it stays on device.

Two phases in one run, each on a fresh server with the same flags (one server at a time, so they do
not compete for the cores): ``unpinned`` (the system block without ``cache_control``) and ``pinned``
(the same block with ``cache_control: {"type": "ephemeral", "ttl": "1h"}``). Requests are sequential,
so the eviction order is the same in both. Each phase starts with one untimed system request (it
computes the prompt, and pins it in the pinned phase); every timed system request follows a round of
fillers. TTFT is measured at the first streamed content token.

    python -m benchmarks.serving.pin_bench [--system-tokens 1500 --filler-tokens 700 --rounds 6]

Results: ``benchmarks/results/pin_bench.{json,md}`` and ``pin_bench.png``, with the CPU and the
machine's load average during each phase.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from benchmarks.lib.common import RESULTS, args_json, cpu_model, write_results
from benchmarks.lib.metrics import percentile
from benchmarks.lib.plots import plot_series_and_percentiles
from benchmarks.lib.servers import SERVED_NAME, free_port, radixserve_command, serving
from benchmarks.lib.workloads import prose

PHASES = ("unpinned", "pinned")
PIN = {"type": "ephemeral", "ttl": "1h"}
# The chat template's tokens around a message, the question and the few generated tokens.
TEMPLATE_TOKENS = 128


@dataclass(frozen=True)
class Workload:
    system: str
    questions: list[str]  # one per timed round, plus the untimed first
    fillers: list[list[str]]  # per timed round: the unrelated user messages sent before its question


@dataclass
class Sample:
    kind: str  # "system" or "filler"
    round: int  # -1: the untimed first system request
    ttft_ms: float | None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    cache_write_tokens: int | None = None
    error: str | None = None


def context_tokens(system_tokens: int, filler_tokens: int) -> int:
    """``--max-model-len``: the longer of a system request and a filler, with room to spare."""
    return max(system_tokens, filler_tokens) + 2 * TEMPLATE_TOKENS


def pool_pages(system_tokens: int, filler_tokens: int, page_size: int) -> int:
    """A pool that holds the pinned system prompt and one request of ``context_tokens`` beside it (the
    pin budget never takes that request's room), and little more."""
    tokens = system_tokens + TEMPLATE_TOKENS + context_tokens(system_tokens, filler_tokens)
    return -(-tokens // page_size)


def fillers_for(num_pages: int, page_size: int, filler_tokens: int) -> int:
    """Fillers per round whose prompts alone fill the pool: the LRU then evicts every unpinned page of
    the older system prompt (a partial eviction would leave its head cached, a partial hit)."""
    return math.ceil(num_pages * page_size / filler_tokens) + 1


def build_workload(
    tokenizer: Any, system_tokens: int, filler_tokens: int, rounds: int, fillers: int
) -> Workload:
    """The system prompt and every filler are distinct prose (Python's reference docs), ``rounds`` of
    ``fillers`` fillers; calibrated in the model's tokens."""
    system = "You answer questions about Python. Reference:\n" + prose(tokenizer, system_tokens, seed=1)
    questions = [f"Question {i}: which statement does this describe first?" for i in range(rounds + 1)]
    fillers_by_round = [
        [
            f"Summarise this ({r}.{f}):\n" + prose(tokenizer, filler_tokens, seed=100 + r * fillers + f)
            for f in range(fillers)
        ]
        for r in range(rounds)
    ]
    return Workload(system, questions, fillers_by_round)


def system_messages(workload: Workload, question: str, pin: bool) -> list[dict[str, Any]]:
    """The system block as a content part (the shape LangChain and Anthropic clients send), with
    ``cache_control`` when pinned; the rendered prompt is the same either way."""
    part: dict[str, Any] = {"type": "text", "text": workload.system}
    if pin:
        part["cache_control"] = PIN
    return [{"role": "system", "content": [part]}, {"role": "user", "content": question}]


def chat(
    client: httpx.Client, messages: list[dict[str, Any]], kind: str, round_: int, max_tokens: int
) -> Sample:
    """One streamed chat request: the time to its first content token, and its usage."""
    body = {
        "model": SERVED_NAME,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    first: float | None = None
    usage: dict[str, Any] | None = None
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            r.read()
            return Sample(kind, round_, None, error=f"{r.status_code}: {r.text[:300]}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return Sample(kind, round_, None, error=str(chunk["error"].get("message")))
            choices = chunk.get("choices") or []
            if first is None and choices and (choices[0].get("delta") or {}).get("content"):
                first = time.perf_counter()
            if chunk.get("usage"):
                usage = chunk["usage"]
    ttft = None if first is None else (first - start) * 1000
    if usage is None:
        return Sample(kind, round_, ttft, error="no usage in the stream")
    details = usage.get("prompt_tokens_details") or {}
    return Sample(
        kind,
        round_,
        ttft,
        prompt_tokens=int(usage["prompt_tokens"]),
        cached_tokens=int(details.get("cached_tokens") or 0),
        cached_tokens_by_tier=dict(details.get("cached_tokens_by_tier") or {}),
        cache_write_tokens=details.get("cache_write_tokens"),
    )


def run_phase(url: str, workload: Workload, pin: bool, max_tokens: int = 4) -> list[Sample]:
    """The untimed first system request, then each round's fillers and its system request, in order."""
    samples: list[Sample] = []
    with httpx.Client(base_url=url, timeout=600, trust_env=False) as client:
        samples.append(
            chat(client, system_messages(workload, workload.questions[0], pin), "system", -1, max_tokens)
        )
        for r, fillers in enumerate(workload.fillers):
            for text in fillers:
                samples.append(chat(client, [{"role": "user", "content": text}], "filler", r, max_tokens))
            question = workload.questions[r + 1]
            samples.append(chat(client, system_messages(workload, question, pin), "system", r, max_tokens))
    return samples


def summarize(samples: Sequence[Sample]) -> dict[str, Any]:
    """TTFT p50/p95 (ms) and the mean cached fraction of the timed system requests and of the fillers."""
    out: dict[str, Any] = {"errors": [s.error for s in samples if s.error is not None]}
    for kind in ("system", "filler"):
        timed = [s for s in samples if s.kind == kind and s.round >= 0 and s.error is None]
        ttfts = [s.ttft_ms for s in timed if s.ttft_ms is not None]
        out[kind] = {
            "requests": len(timed),
            "ttft_p50_ms": percentile(ttfts, 50),
            "ttft_p95_ms": percentile(ttfts, 95),
            "cached_fraction": (
                sum(s.cached_tokens for s in timed) / sum(s.prompt_tokens for s in timed) if timed else None
            ),
        }
    return out


def server_flags(args: argparse.Namespace) -> list[str]:
    """The pool and pin budget both phases' servers run with."""
    flags = ["--page-size", str(args.page_size), "--num-pages", str(args.num_pages)]
    flags += ["--max-model-len", str(context_tokens(args.system_tokens, args.filler_tokens))]
    return flags + ["--max-pinned-fraction", str(args.max_pinned_fraction)]


def plot(phases: dict[str, list[Sample]], path: Path, title: str) -> list[Path]:
    """Left: TTFT of each timed system request by round, per phase; right: p50 and p95 bars."""
    series = {}
    for name, samples in phases.items():
        timed = [s for s in samples if s.kind == "system" and s.round >= 0 and s.ttft_ms is not None]
        series[name] = ([float(s.round) for s in timed], [s.ttft_ms for s in timed if s.ttft_ms is not None])
    return plot_series_and_percentiles(
        series,
        path,
        "round (after the fillers that fill the pool)",
        "TTFT of the system-prompt request (ms)",
        title,
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    a = parser.add_argument
    a("--model", default=None, help="model folder (default: the embedded SmolLM2-135M-Instruct)")
    a("--system-tokens", type=int, default=1500)
    a("--filler-tokens", type=int, default=700)
    a("--rounds", type=int, default=6, help="timed system requests per phase")
    a("--fillers", type=int, default=None, help="fillers per round (default: enough to fill the pool)")
    a("--page-size", type=int, default=16)
    a("--num-pages", type=int, default=None, help="device pool (default: pool_pages)")
    a(
        "--max-pinned-fraction",
        type=float,
        default=0.6,
        help="both servers (the default 0.25 is too small for a system prompt of half the pool)",
    )
    a("--max-tokens", type=int, default=4)
    a("--engine-threads", type=int, default=None, help="torch threads of each engine process")
    a("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    from radixserve.model.default_model import prepare_default_model
    from radixserve.model.loader import load_tokenizer

    model = args.model or str(prepare_default_model(progress=False))
    if args.num_pages is None:
        args.num_pages = pool_pages(args.system_tokens, args.filler_tokens, args.page_size)
    if args.fillers is None:
        args.fillers = fillers_for(args.num_pages, args.page_size, args.filler_tokens)
    workload = build_workload(
        load_tokenizer(Path(model)), args.system_tokens, args.filler_tokens, args.rounds, args.fillers
    )
    phases: dict[str, list[Sample]] = {}
    load: dict[str, dict[str, float]] = {}
    started = time.time()
    for name in PHASES:
        port = free_port()
        cmd = radixserve_command(port, *server_flags(args), model=model, threads=args.engine_threads)
        with serving(f"pin_bench-{name}", cmd, port, args.out / "logs") as url:
            before = os.getloadavg()[0]
            phases[name] = run_phase(url, workload, pin=name == "pinned", max_tokens=args.max_tokens)
            load[name] = {"load1_before": before, "load1_after": os.getloadavg()[0]}
        print(name, summarize(phases[name]), flush=True)
    summaries = {name: summarize(samples) for name, samples in phases.items()}
    cpu = cpu_model()
    title = (
        f"Pinned vs unpinned {args.system_tokens}-token system prompt, {args.fillers} fillers of "
        f"{args.filler_tokens} tokens per round, {args.num_pages} pages of {args.page_size}; {cpu}"
    )
    plot(phases, args.out / "pin_bench.png", title)
    rows: list[list[Any]] = []
    for name in PHASES:
        s = summaries[name]
        rows.append(
            [
                name,
                s["system"]["requests"],
                s["system"]["ttft_p50_ms"],
                s["system"]["ttft_p95_ms"],
                s["system"]["cached_fraction"],
                s["filler"]["ttft_p50_ms"],
                f"{load[name]['load1_before']:.2f} -> {load[name]['load1_after']:.2f}",
            ]
        )
    write_results(
        "pin_bench",
        {
            "args": args_json(args),
            "duration_s": time.time() - started,
            "load": load,
            "summary": summaries,
            "samples": {name: [asdict(s) for s in samples] for name, samples in phases.items()},
        },
        rows,
        [
            "phase",
            "system requests",
            "system TTFT p50 ms",
            "system TTFT p95 ms",
            "system cached fraction",
            "filler TTFT p50 ms",
            f"load avg 1 min, before -> after ({os.cpu_count()} cores)",
        ],
        f"Pinning a shared system prompt (SmolLM2-135M, fp32, HTTP on loopback, {cpu})",
        args.out,
    )


if __name__ == "__main__":
    main()
