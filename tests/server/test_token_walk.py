"""The walk of one streamed token (issue 55): the project functions a token of a streamed chat request
passes through in steady state, in the API server and in the engine process, counted on a real server
of the default model, within budgets, and equal to the lists in docs/architecture.md ("The walk of one
streamed token").

How it counts (benchmarks/lib/token_walk.py over calltrace.py): both processes trace themselves from
their start (a ``sitecustomize`` first on the server's PYTHONPATH, inherited by the engine process) and
dump their counts on SIGUSR1. A warm-up request, then streamed chat requests of 16 and 80 tokens
(greedy, ignore_eos); calls per token = the difference of the two requests' counts / 64, so what a
request costs once cancels. A call is a frame entered (a call, or a generator resumed after a yield;
not a wake-up after an await, which depends on timing). The walk: the functions at 0.5 calls a token
or more, less the clock-driven ones (calltrace.CLOCK_DRIVEN). Counts, not timings: a loaded machine
moves them by a few hundredths of a call.

After changing the path, print the lists to paste into the docs with
``python -m benchmarks.step.walk_counts --served --print-doc`` (and lower the budgets below).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.lib import calltrace, servers, token_walk

pytestmark = pytest.mark.real_model

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
# Calls per streamed token, and functions in the walk, at most. The API server: 6 calls in 6 functions
# since the stream's rework (a stream is one object a token, no generator behind it; the SSE framing in
# the response's own send loop; no reply parser where there is nothing to split), and a half for the
# fractions a loaded machine adds. The engine process: measured at e0d3732, the host-path work done (56
# calls in 47 functions), plus room for the engine's counters, which a StepReport carries every 16 steps
# or second (about 25 calls each: more often a token on a loaded machine, whose steps are slower). At
# 3c9dc4f, before that work: API server 17.0 in 16, engine process 172 in 107; the target is a
# third of those.
API_SERVER_CALLS = 6.5
API_SERVER_FUNCTIONS = 6
ENGINE_CALLS = 72
ENGINE_FUNCTIONS = 52
BUDGETS = {"api_server": (API_SERVER_CALLS, API_SERVER_FUNCTIONS), "engine": (ENGINE_CALLS, ENGINE_FUNCTIONS)}
# A documented rate may differ from the traced one by less than this: a rate is a whole number of calls
# a token (or a fraction, for once every few tokens), and on a loaded machine the engine loop's idle
# polls and heartbeats (clock-driven) add a few hundredths; a call more or less a token is a change.
RATE_TOLERANCE = 0.5
HOW = "python -m benchmarks.step.walk_counts --served --print-doc prints the lists"


@pytest.fixture(scope="module")
def rates(tmp_path_factory: pytest.TempPathFactory) -> dict[str, calltrace.Rates]:
    with token_walk.traced_server(tmp_path_factory.mktemp("walk"), ROOT) as (url, dumps, pid):
        return token_walk.served_rates(url, servers.SERVED_NAME, dumps, pid)


def test_both_processes_were_traced_on_this_tree(rates: dict[str, calltrace.Rates]) -> None:
    for key in BUDGETS:
        assert Path(rates[key].package) == ROOT / "radixserve", rates[key].package
    assert rates["engine"].calls.get("engine/engine.py::Engine.step") == 1.0  # a step a token
    assert rates["api_server"].calls.get("engine/deltas.py::OutputAssembler.add") == 1.0  # a delta a token


@pytest.mark.parametrize("process", list(BUDGETS))
def test_a_token_walks_the_documented_functions(rates: dict[str, calltrace.Rates], process: str) -> None:
    traced = rates[process].walk
    documented = calltrace.documented_walks(DOC.read_text())[process]
    missing, extra = sorted(set(traced) - set(documented)), sorted(set(documented) - set(traced))
    assert not missing and not extra, (
        f"{process}: traced but not in docs/architecture.md: {missing}; documented but not traced: "
        f"{extra} ({HOW})\n{calltrace.walk_table(traced)}"
    )
    moved = {
        n: (documented[n], round(r, 2)) for n, r in traced.items() if abs(r - documented[n]) >= RATE_TOLERANCE
    }
    assert not moved, f"{process}: calls a token (documented, traced): {moved} ({HOW})"


@pytest.mark.parametrize("process", list(BUDGETS))
def test_a_token_costs_at_most_the_budget_of_calls(rates: dict[str, calltrace.Rates], process: str) -> None:
    calls, functions = BUDGETS[process]
    r = rates[process]
    top = "\n".join(f"{rate:7.3f} {name}" for name, rate in calltrace.top(r.calls, 30))
    assert r.total <= calls, f"{process}: {r.total:.2f} calls a token > {calls}\n{top}"
    assert len(r.walk) <= functions, f"{process}: {len(r.walk)} functions a token > {functions}\n{top}"
