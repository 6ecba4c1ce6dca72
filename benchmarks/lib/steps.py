"""An engine's runner stepped directly over its own paged pool, and the machine's limits to set its
steps against: the shared measuring parts of step_bench, step_bench --modes and mode_bench.

``Steps`` runs decode and prefill steps of one engine's ``ModelRunner`` (no scheduler, sampler or
HTTP) over scattered pages of its pool; ``measure_limits`` measures, in the same process, the read
bandwidth over a buffer larger than the last-level cache and the GFLOP/s peak of each arithmetic.
"""

from __future__ import annotations

import random
import subprocess
import sys
from collections.abc import Callable, Iterable

import torch

from benchmarks.lib.common import median_of
from benchmarks.lib.modes import Limits
from radixserve import Engine
from radixserve.model.runner import SeqChunk


def runs_in_subprocess(code: str) -> bool:
    """Whether ``code`` runs in a fresh interpreter: an instruction the CPU lists but traps on (AMX on
    some VMs) kills that process, not this one."""
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=300)
    except subprocess.TimeoutExpired:
        return False
    return proc.returncode == 0


PEAK_PROBES = {
    "int8": "import torch; a = torch.ones(64, 64, dtype=torch.int8); torch._int_mm(a, a)",
    "bf16": "import torch; a = torch.ones(64, 64, dtype=torch.bfloat16); a @ a",
}


def measure_limits(repeats: int = 5, arithmetics: Iterable[str] = ("fp32",)) -> Limits:
    """Read bandwidth and the peak of each of ``arithmetics`` (fp32 always; int8 ``torch._int_mm``
    and bf16 matmul where asked and where they run) on 2048^3 products."""
    buf = torch.ones(2**30 // 4)  # 1 GiB: well beyond any cache
    bw = buf.numel() * 4 / min(median_of(buf.sum, repeats), median_of(lambda: buf.max(), repeats)) / 1e9
    n = 2048
    a, b = torch.randn(n, n), torch.randn(n, n)
    peaks = {"fp32": 2 * n**3 / median_of(lambda: a @ b, repeats) / 1e9}
    if "int8" in arithmetics and runs_in_subprocess(PEAK_PROBES["int8"]):
        qa, qb = (torch.randint(-127, 128, (n, n), dtype=torch.int8) for _ in range(2))
        peaks["int8"] = 2 * n**3 / median_of(lambda: torch._int_mm(qa, qb), repeats) / 1e9
    if "bf16" in arithmetics and runs_in_subprocess(PEAK_PROBES["bf16"]):
        ha, hb = a.bfloat16(), b.bfloat16()
        peaks["bf16"] = 2 * n**3 / median_of(lambda: ha @ hb, repeats) / 1e9
    return Limits(bw, peaks)


class Steps:
    """Decode and prefill steps of one engine's runner over scattered pages of its pool."""

    def __init__(self, engine: Engine, seed: int = 0) -> None:
        self.engine, self.runner, self.page_size = engine, engine.runner, engine.config.page_size
        self.rng = random.Random(seed)
        self.free = list(range(engine.kv_manager.num_pages))
        self.rng.shuffle(self.free)  # scattered pages, as after a while of serving
        # Token ids to draw from: ordinary ones of SmolLM2's vocabulary, within a smaller model's.
        self.hi = min(40000, engine.model.config.vocab_size)
        self.lo = min(100, self.hi // 2)

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(self.lo, self.hi) for _ in range(n)]

    def pages(self, n_tokens: int) -> list[int]:
        return [self.free.pop() for _ in range(-(-n_tokens // self.page_size))]

    def release(self, tables: list[list[int]]) -> None:
        for t in tables:
            self.free.extend(t)

    def decode_step(
        self, batch: int, context: int, max_steps: int, prefill: bool = True
    ) -> tuple[Callable[[], None], list[list[int]]]:
        """A call that runs one more decode step of ``batch`` sequences of ``context`` tokens (at most
        ``max_steps`` calls), and the page tables to ``release`` after. ``prefill``: compute the
        context's K/V first; else the pages hold what they hold, which changes no kernel's work."""
        seqs = [self.tokens(context) for _ in range(batch)]
        tables = [self.pages(context + max_steps + 2) for _ in range(batch)]
        if prefill:
            for s, t in zip(seqs, tables):  # one at a time: each in its own chunks
                self.runner.run([SeqChunk(s, 0, len(s), t)])

        def step() -> None:
            for s in seqs:
                s.append(self.rng.randrange(self.lo, self.hi))
            self.runner.run([SeqChunk(s, len(s) - 1, 1, t) for s, t in zip(seqs, tables)])

        return step, tables

    def decode(self, batch: int, context: int, repeats: int, prefill: bool = True) -> float:
        step, tables = self.decode_step(batch, context, repeats + 1, prefill)
        seconds = median_of(step, repeats)
        self.release(tables)
        return seconds

    def extend_step(self, new: int, cached: int) -> tuple[Callable[[], None], list[list[int]]]:
        """A call that runs ``new`` tokens over ``cached`` ones already in the pages (recomputed into
        the same slots each call), and the page tables to ``release`` after."""
        seq = self.tokens(cached + new)
        table = self.pages(cached + new)
        if cached:
            self.runner.run([SeqChunk(seq, 0, cached, table)])

        def step() -> None:
            self.runner.run([SeqChunk(seq, cached, new, table)])

        return step, [table]

    def extend(self, new: int, cached: int, repeats: int) -> float:
        """``new`` tokens over ``cached`` ones already in the pages (recomputed into the same slots)."""
        step, tables = self.extend_step(new, cached)
        seconds = median_of(step, repeats)
        self.release(tables)
        return seconds
