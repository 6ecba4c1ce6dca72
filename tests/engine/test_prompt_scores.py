"""Scoring from the cache (issue 24): prompt logprobs reuse cached prefixes, on a tiny random model.

Every answer is checked against an engine without a prefix cache (``prefix_cache=False``), which
computes every prompt position itself; computed tokens are counted from the engine's stats.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from tiny_models import make_tiny_model

from radixserve import Engine, SamplingParams
from radixserve.cache.scores import TOP_K
from radixserve.outputs import TokenLogprob

PAGE = 16
OPTIONS = dict(page_size=PAGE, num_pages=512, max_batched_tokens=256, debug_checks=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("scores"), "llama", context=2048)


@pytest.fixture(scope="module")
def reference(model: Path) -> Engine:
    return Engine(str(model), prefix_cache=False, **OPTIONS)


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 290) for _ in range(n)]


PREFIX = _tokens(600, 1)
SUFFIXES = [_tokens(n, 10 + n) for n in (5, 17, 40)]


def _score(engine: Engine, prompt: list[int], k: int = 0, start: int = 0) -> list[TokenLogprob | None]:
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=k, prompt_logprobs_start=start)
    [out] = engine.generate([prompt], params)
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt)
    return out.prompt_logprobs


def _same(got: list[TokenLogprob | None], want: list[TokenLogprob | None]) -> None:
    assert len(got) == len(want)
    for j, (g, w) in enumerate(zip(got, want, strict=True)):
        assert (g is None) == (w is None), f"position {j}: {g} vs {w}"
        if g is None or w is None:
            continue
        assert g.token_id == w.token_id and g.logprob == pytest.approx(w.logprob, abs=1e-5), f"position {j}"
        assert list(g.top) == list(w.top), f"position {j}: top ids"
        assert list(g.top.values()) == pytest.approx(list(w.top.values()), abs=1e-5), f"position {j}"


def _computed(engine: Engine, run: object) -> int:
    before = engine.stats().prompt_tokens
    assert callable(run)
    run()
    return engine.stats().prompt_tokens - before


@pytest.mark.parametrize("k", [0, 3])
def test_shared_prefix_scores_equal_no_cache_and_compute_only_the_suffix(
    model: Path, reference: Engine, k: int
) -> None:
    engine = Engine(str(model), **OPTIONS)
    first = PREFIX + SUFFIXES[0]
    n = _computed(engine, lambda: _same(_score(engine, first, k), _score(reference, first, k)))
    assert n == len(first)
    for suffix in SUFFIXES[1:]:
        prompt = PREFIX + suffix
        got: list[TokenLogprob | None] = []
        n = _computed(engine, lambda p=prompt, out=got: out.extend(_score(engine, p, k)))  # type: ignore[misc]
        _same(got, _score(reference, prompt, k))
        # Only the suffix and the rest of the prefix's last, partly shared page are computed.
        assert n == len(prompt) - len(PREFIX) // PAGE * PAGE
        boundary = len(PREFIX) // PAGE * PAGE  # its logprob came from the cached page before it
        entry = got[boundary]
        assert entry is not None and entry.logprob < 0


def test_a_page_diverging_at_its_boundary_reads_the_top_k_or_recomputes(
    model: Path, reference: Engine
) -> None:
    engine = Engine(str(model), **OPTIONS)
    base = PREFIX[:320]
    _score(engine, base + [7] * 20)
    # The token after page 20 differs from the writer's: its logprob is in the stored top-k or is
    # recomputed from the page before; either way it equals the no-cache answer.
    for t in range(3, 40):
        prompt = base + [t] + _tokens(9, t)
        _same(_score(engine, prompt, 2), _score(reference, prompt, 2))


def test_more_alternatives_than_stored_and_unscored_pages_recompute(model: Path, reference: Engine) -> None:
    engine = Engine(str(model), **OPTIONS)
    prompt = PREFIX + SUFFIXES[1]
    ordinary = SamplingParams(max_tokens=2, temperature=0)
    engine.generate([prompt], ordinary)  # KV cached, no scores: the pages' logprobs are unknown
    n = _computed(engine, lambda: _same(_score(engine, prompt), _score(reference, prompt)))
    assert n == len(prompt)
    k = TOP_K + 2
    n = _computed(engine, lambda: _same(_score(engine, prompt, k), _score(reference, prompt, k)))
    assert n == len(prompt)
    n = _computed(engine, lambda: _same(_score(engine, prompt, 2), _score(reference, prompt, 2)))
    assert n == len(prompt) % PAGE or n == PAGE  # now stored: only the last page


def test_prompt_logprobs_start_is_honoured(model: Path, reference: Engine) -> None:
    engine = Engine(str(model), **OPTIONS)
    prompt = PREFIX + SUFFIXES[2]
    start = 610
    want = _score(reference, prompt, 1, start)
    assert all(x is None for x in want[:start]) and all(x is not None for x in want[start:])
    engine.generate([PREFIX], SamplingParams(max_tokens=1))  # KV only: enough for positions < start
    n = _computed(engine, lambda: _same(_score(engine, prompt, 1, start), want))
    assert n == len(prompt) - len(PREFIX) // PAGE * PAGE
    assert _score(reference, prompt, 0, len(prompt) + 5) == [None] * len(prompt)


def test_scores_follow_pages_through_host_and_disk_and_a_restart(
    model: Path, reference: Engine, tmp_path: Path
) -> None:
    tiers = dict(OPTIONS, num_pages=64, host_cache_gb=0.001, disk_cache_gb=0.05, disk_cache_dir=str(tmp_path))
    engine = Engine(str(model), **tiers)
    first = PREFIX + SUFFIXES[0]
    _score(engine, first, 2)
    for i in range(4):  # push the prefix out of the device pool (and the small host tier)
        engine.generate([_tokens(900, 100 + i)], SamplingParams(max_tokens=1))
    assert engine.kv_manager.tree is not None
    assert engine.kv_manager.tree.peek(PREFIX, None).num_tokens < len(PREFIX) // PAGE * PAGE
    engine.kv_manager.tiers.drain()  # type: ignore[union-attr]
    prompt = PREFIX + SUFFIXES[1]
    want = _score(reference, prompt, 2)
    got: list[TokenLogprob | None] = []
    n = _computed(engine, lambda: got.extend(_score(engine, prompt, 2)))
    _same(got, want)
    assert n == len(prompt) - len(PREFIX) // PAGE * PAGE
    engine.kv_manager.tiers.drain()  # type: ignore[union-attr]
    engine.close()
    restarted = Engine(str(model), **tiers)  # a new process would see the same: the disk tier alone
    prompt = PREFIX + SUFFIXES[2]
    got = []
    n = _computed(restarted, lambda: got.extend(_score(restarted, prompt, 2)))
    _same(got, _score(reference, prompt, 2))
    assert n == len(prompt) - len(PREFIX) // PAGE * PAGE
    restarted.close()
