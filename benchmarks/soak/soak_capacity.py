"""The soak's capacity (benchmarks/soak/soak.py): answers per second of its mixed load on the idle server,
measured by a ramp of concurrency after a warm-up, which the offered load is then a multiple of."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from benchmarks.soak.soak_outcomes import classify
from benchmarks.soak.soak_records import Record
from benchmarks.soak.soak_traffic import KINDS, Traffic


async def warm_up(traffic: Traffic, rounds: int = 3) -> None:
    """Each kind a few times, alone then together, unrecorded: the first of each (a grammar, prompt
    logprobs, a batch shape) compiles, which would make the ramp's first steps look slow."""
    for _ in range(rounds):
        for kind in KINDS:
            await traffic.send(kind)
    await asyncio.gather(*(traffic.send(kind) for kind in KINDS for _ in range(2)))


async def measure_capacity(traffic: Traffic, step_s: float, max_c: int) -> tuple[float, list[dict[str, Any]]]:
    """Answers per second of the mix (ok or an expected 4xx) at concurrency 1, 2, 4, ... until it grows
    by less than 10%."""
    steps: list[dict[str, Any]] = []
    c = 1
    while c <= max_c:
        records: list[Record] = []

        async def worker(end: float, records: list[Record]) -> None:
            while time.perf_counter() < end:
                records.append(await traffic.send(traffic.pick_kind()))

        start = time.perf_counter()
        await asyncio.gather(*(worker(start + step_s, records) for _ in range(c)))
        span = time.perf_counter() - start
        answered = sum(classify(r, []) in ("ok", "bad_input_4xx") for r in records)
        steps.append({"concurrency": c, "requests": len(records), "answered_per_s": answered / span})
        if len(steps) > 1 and steps[-1]["answered_per_s"] < 1.1 * steps[-2]["answered_per_s"]:
            break
        c *= 2
    return max(s["answered_per_s"] for s in steps), steps
