"""The overlapped loop against the plain loop on this machine (issue 56, item 3; engine/overlap.py).

One engine (the default model, float32, the exact default), three loops in turn on the same engine
(``Engine.overlap`` and ``Engine.sampling_buffers`` switched between runs, the cache flushed before
each), the order rotated each round: the plain loop; the overlapped loop sampling through
``device_sampler`` (as it runs where it is on); the overlapped loop sampling through ``Sampler``.
B greedy requests (``ignore_eos``, ``max_tokens`` tokens each) are driven by ``Engine.step()``
here; per run: output tok/s over the run, TTFT (first output of a request after the run's start) and
ITL (the gaps between a request's outputs), medians over rounds. A "stops" case ends a third of the
requests early with a stop token (the overlapped loop's one wasted row each).

    python -m benchmarks.step.overlap_bench [--batches 1,8,32] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from benchmarks.lib.common import RESULTS, cpu_model, write_results
from benchmarks.lib.plots import plot_bars
from radixserve import Engine, SamplingParams

PROMPT = "Request {}: tell me a story about the sea, with a ship, a storm and a harbour at the end."


def run(engine: Engine, batch: int, max_tokens: int, stops: bool) -> dict[str, float]:
    """One run of ``batch`` requests; returns tok/s, TTFT p50 and ITL p50 (ms)."""
    engine.flush_cache()
    plain = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    # " the" (260 in SmolLM2's vocabulary) stops a request at its first one: early, at different steps
    early = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, stop_token_ids=[260])
    start = time.perf_counter()
    for i in range(batch):
        engine.add_request(PROMPT.format(i), early if stops and i % 3 == 0 else plain)
    last: dict[str, float] = {}
    ttft: list[float] = []
    gaps: list[float] = []
    tokens = 0
    while engine.has_unfinished():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            tokens += len(out.token_ids)
            if out.group_id not in last:
                ttft.append(now - start)
            else:
                gaps.append(now - last[out.group_id])
            last[out.group_id] = now
    wall = time.perf_counter() - start
    return {
        "tok_s": tokens / wall,
        "ttft_p50_ms": 1e3 * statistics.median(ttft),
        "itl_p50_ms": 1e3 * statistics.median(gaps) if gaps else 0.0,
        "steps": float(engine.num_steps),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--name", default="overlap-cpu")
    args = ap.parse_args()
    engine = Engine(overlap_schedule="on")
    loops = {
        "plain": (False, None),
        "overlapped": (True, engine.sampling_buffers),
        "overlapped, Sampler": (True, None),
    }
    batches = [int(b) for b in args.batches.split(",")]
    cases = [(b, False) for b in batches] + [(max(batches), True)]
    results: dict[str, dict[str, list[dict[str, float]]]] = {}
    for batch, stops in cases:
        label = f"B={batch}" + (" stops" if stops else "")
        results[label] = {name: [] for name in loops}
        run(engine, batch, 8, stops)  # warm: the first steps of a new batch size
        for rnd in range(args.rounds):
            names = list(loops)
            for name in names[rnd % 3 :] + names[: rnd % 3]:
                engine.overlap, engine.sampling_buffers = loops[name]
                steps = engine.num_steps
                r = run(engine, batch, args.max_tokens, stops)
                r["steps"] -= steps
                results[label][name].append(r)
                print(label, name, {k: round(v, 2) for k, v in r.items()}, flush=True)
    table: list[list[Any]] = []
    bars: dict[str, dict[str, float | None]] = {}
    summary: dict[str, Any] = {}
    for label, runs in results.items():
        med = {loop: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for loop, rs in runs.items()}
        summary[label] = med
        plain = med["plain"]
        for name, m in med.items():
            table.append(
                [
                    label,
                    name,
                    m["tok_s"],
                    m["tok_s"] / plain["tok_s"],
                    m["ttft_p50_ms"],
                    m["itl_p50_ms"],
                    m["steps"],
                ]
            )
        bars[label] = {name: m["tok_s"] / plain["tok_s"] for name, m in med.items() if name != "plain"}
    header = ["case", "loop", "tok/s", "/ plain", "TTFT p50 ms", "ITL p50 ms", "steps"]
    title = f"overlapped / plain loop, output tok/s, {cpu_model()}"
    plots = plot_bars(bars, RESULTS / f"{args.name}.png", "ratio", title)
    write_results(
        args.name,
        {"args": vars(args), "runs": results, "medians": summary},
        table,
        header,
        f"The overlapped loop against the plain loop, SmolLM2-135M float32, {args.rounds} rounds (medians)",
        plots=plots,
    )


if __name__ == "__main__":
    main()
