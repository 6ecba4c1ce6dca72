"""Prefix cache on vs off on the real model, in-process (issue 3's benchmark).

Workloads, each run with the cache on and off, side by side in one invocation:
- rag: D documents of about L tokens, Q questions each, all arriving at once, interleaved;
- chat: C conversations x T turns; a turn is sent when the previous answer is back, with it in the history;
- none: prompts that share nothing (the cache's overhead).
Reports throughput (prompt+output tokens/s and requests/s), TTFT p50/p95 and the prefix hit rate.

    python -m benchmarks.serving.prefix_bench [--docs 6 --doc-tokens 1500 --questions 8 --convs 12 --turns 5]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass, field

import torch

from benchmarks.lib.common import write_results
from benchmarks.lib.workloads import prose
from radixserve import Engine, SamplingParams


@dataclass
class Job:
    """One request to send, optionally followed by another built from its answer (a chat turn)."""

    messages: list[dict[str, str]]
    follow_ups: list[str] = field(default_factory=list)


@dataclass
class RunStats:
    ttft: list[float] = field(default_factory=list)
    tokens: int = 0
    requests: int = 0
    seconds: float = 0.0


def drive(engine: Engine, jobs: list[Job], max_tokens: int) -> RunStats:
    """Feed jobs to the engine, stepping it in this thread; chat follow-ups go in as answers come back."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    stats = RunStats()
    live: dict[str, tuple[Job, float, list[int], int]] = {}

    def submit(job: Job) -> None:
        ids = engine.apply_chat_template(job.messages)
        live[engine.add_request(ids, params)] = (job, time.perf_counter(), [], len(ids))

    start = time.perf_counter()
    for job in jobs:
        submit(job)
    while live:
        for out in engine.step():
            job, t0, tokens, n_prompt = live[out.group_id]
            if not tokens and out.token_ids:
                stats.ttft.append(time.perf_counter() - t0)
            tokens.extend(out.token_ids)
            if out.finish_reason is None:
                continue
            del live[out.group_id]
            stats.requests += 1
            stats.tokens += n_prompt + len(tokens)
            if job.follow_ups:
                answer = str(engine.tokenizer.decode(tokens, skip_special_tokens=True))
                turn = [
                    {"role": "assistant", "content": answer},
                    {"role": "user", "content": job.follow_ups[0]},
                ]
                history = job.messages + turn
                submit(Job(history, job.follow_ups[1:]))
    stats.seconds = time.perf_counter() - start
    return stats


def workloads(engine: Engine, args: argparse.Namespace) -> dict[str, list[Job]]:
    tok = engine.tokenizer
    rng = random.Random(args.seed)
    docs = [prose(tok, args.doc_tokens, seed=d) for d in range(args.docs)]
    asks = [
        "What is the main topic?",
        "Give one example from the text.",
        "Summarise the first paragraph.",
        "Which keyword matters most?",
        "Is anything deprecated?",
        "Who is the audience?",
        "Name a related concept.",
        "What would you ask next?",
    ]
    rag = [
        Job([{"role": "user", "content": f"Document:\n{docs[d]}\n\nQuestion: {asks[q % len(asks)]}"}])
        for q in range(args.questions)
        for d in range(args.docs)
    ]
    topics = [
        "the sea",
        "compilers",
        "bread",
        "trains",
        "chess",
        "rain",
        "jazz",
        "maps",
        "owls",
        "glass",
        "tea",
        "ice",
    ]
    chat = [
        Job(
            [
                {"role": "system", "content": "You are a friendly assistant."},
                {"role": "user", "content": f"Tell me about {topics[c % len(topics)]}."},
            ],
            [f"And more about point {t}?" for t in range(1, args.turns)],
        )
        for c in range(args.convs)
    ]
    unique = [
        # Each opens with its own system line: the template's default system prompt would be shared.
        Job(
            [
                {"role": "system", "content": f"Reader {i}."},
                {"role": "user", "content": prose(tok, args.unique_tokens, seed=1000 + i)},
            ]
        )
        for i in range(args.unique)
    ]
    rng.shuffle(unique)
    return {"rag": rag, "chat": chat, "none": unique}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--docs", type=int, default=6)
    parser.add_argument("--doc-tokens", type=int, default=1500)
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--convs", type=int, default=12)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--unique", type=int, default=24)
    parser.add_argument("--unique-tokens", type=int, default=400)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", nargs="*", default=None, help="run only these workloads")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    engines = {"on": Engine(kv_cache_gb=2.0), "off": Engine(kv_cache_gb=2.0, prefix_cache=False)}
    jobs = workloads(engines["on"], args)
    results: dict[str, dict[str, float]] = {}
    rows = []
    for name, job_list in jobs.items():
        if args.only and name not in args.only:
            continue
        per: dict[str, RunStats] = {}
        for mode, engine in engines.items():
            engine.flush_cache()
            before = engine.stats()
            per[mode] = drive(engine, job_list, args.max_tokens)
            after = engine.stats()
            q = after.prefix_query_tokens - before.prefix_query_tokens
            hit_rate = (after.prefix_hit_tokens - before.prefix_hit_tokens) / q if q else 0.0
            s = per[mode]
            results[f"{name}_{mode}"] = {
                "seconds": s.seconds,
                "requests": s.requests,
                "tok_s": s.tokens / s.seconds,
                "req_s": s.requests / s.seconds,
                "ttft_p50": statistics.median(s.ttft),
                "ttft_p95": statistics.quantiles(s.ttft, n=20)[-1],
                "hit_rate": hit_rate,
            }
            r = results[f"{name}_{mode}"]
            rows.append(
                [name, mode, s.requests, r["req_s"], r["tok_s"], r["ttft_p50"], r["ttft_p95"], hit_rate]
            )
            print(rows[-1], flush=True)
        speedup = results[f"{name}_on"]["tok_s"] / results[f"{name}_off"]["tok_s"]
        results[f"{name}_speedup"] = {"throughput_on_over_off": speedup}
        rows.append([name, "on/off", "", "", speedup, "", "", ""])
    write_results(
        "prefix_bench",
        {"args": vars(args), "results": results},
        rows,
        ["workload", "cache", "requests", "req/s", "tok/s", "TTFT p50 s", "TTFT p95 s", "hit rate"],
        "Prefix cache on vs off (SmolLM2-135M, fp32, CPU, in-process)",
    )


if __name__ == "__main__":
    main()
