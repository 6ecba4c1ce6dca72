"""The offline engine's walk of a token (issue 55): calls into radixserve per decode step of
``Engine.generate`` on the default model (default knobs), at batch 1 (a token) and at batch 8, within
budgets. Marginal over two run lengths (benchmarks/lib/token_walk.py, ``offline_rates``): what a request
costs once cancels. Counts, not timings.

``python -m benchmarks.step.walk_counts --offline`` prints the same figures and the top functions.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from benchmarks.lib import calltrace, token_walk

pytestmark = pytest.mark.real_model

# At most: the targets (a third of 3c9dc4f's 139.9 calls a token at batch 1 and 482 a step at
# batch 8). Measured after the host-path work: about 45 and 101 (benchmarks/results/walk_counts-after.md).
BATCH1_CALLS_PER_TOKEN = 47
BATCH8_CALLS_PER_STEP = 160


@pytest.fixture(scope="module")
def engine() -> Iterator[Any]:
    from radixserve import Engine

    engine = Engine()
    yield engine
    engine.close()


@pytest.mark.parametrize("batch, budget", [(1, BATCH1_CALLS_PER_TOKEN), (8, BATCH8_CALLS_PER_STEP)])
def test_a_decode_step_costs_at_most_the_budget_of_calls(engine: Any, batch: int, budget: int) -> None:
    r = token_walk.offline_rates(engine, batch)
    assert r.calls.get("engine/engine.py::Engine.step") == 1.0  # the marginal counts whole steps
    top = "\n".join(f"{rate:7.3f} {name}" for name, rate in calltrace.top(r.calls, 30))
    assert r.total <= budget, f"batch {batch}: {r.total:.2f} calls a step > {budget}\n{top}"
