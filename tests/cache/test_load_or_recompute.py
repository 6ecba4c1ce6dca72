"""Load or recompute, whichever is faster (issue 56, item 5): a hit in a tier slower than recomputing is
recomputed, one in a faster tier is loaded, and a hit that spans both loads the fast part only. The
decision alone on fed measurements (no clock), then an engine over a host tier and a disk tier whose
reads are slowed to a second a page (the tiny model computes a page in milliseconds)."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
import torch

from radixserve import Engine, SamplingParams
from radixserve.cache.disk_store import DiskStore
from radixserve.cache.load_cost import PROBE_EVERY, LoadCost
from radixserve.cache.tier_controller import TierController
from radixserve.cache.tiers import chain_keys, namespace_key

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
PAGE = 4
HOST, DISK = 0, 1
READ_DELAY_S = 1.0  # a slowed disk page: hundreds of times what the tiny model takes to compute one


class SlowDisk(DiskStore):
    """A disk tier whose every read first sleeps ``READ_DELAY_S``."""

    def get(self, key: bytes) -> torch.Tensor | None:
        time.sleep(READ_DELAY_S)
        return super().get(key)


# -- the decision ----------------------------------------------------------------------------------
def _cost(host_page_s: float, disk_page_s: float, token_s: float) -> LoadCost:
    cost = LoadCost(2)
    cost.note_load([host_page_s, disk_page_s], [1, 1], 100)
    cost.note_prefill(1, token_s)
    return cost


def test_unmeasured_tiers_and_prefill_load_everything() -> None:
    """Before anything is measured every page loads (and so gets measured)."""
    assert LoadCost(2).pages_to_load([HOST, DISK, DISK], PAGE) == 3
    unmeasured_prefill = LoadCost(2)
    unmeasured_prefill.note_load([0.0, 5.0], [0, 1], 100)
    assert unmeasured_prefill.pages_to_load([DISK, DISK], PAGE) == 2
    unmeasured_tier = LoadCost(2)
    unmeasured_tier.note_prefill(64, 0.001)
    assert unmeasured_tier.pages_to_load([DISK, DISK], PAGE) == 2


def test_only_the_pages_that_load_faster_than_they_compute_load() -> None:
    # A page computes in 4 ms; host loads in 1 ms, disk in 10 ms.
    cost = _cost(0.001, 0.010, 0.001)
    assert cost.pages_to_load([HOST, HOST], PAGE) == 2  # fast: loaded
    assert cost.pages_to_load([DISK, DISK], PAGE) == 0  # slow: recomputed
    assert cost.pages_to_load([HOST, HOST, DISK, DISK], PAGE) == 2  # the fast head only
    # A slow page followed by enough fast ones: loading through it saves the most (-3 + 6 - 3 - 3 - 3 ms).
    assert cost.pages_to_load([HOST, DISK, HOST, HOST, HOST], PAGE) == 5
    # Once the prefill is measured slower (a busy device), the disk is worth loading again.
    for _ in range(40):
        cost.note_prefill(1, 0.1)
    assert cost.pages_to_load([DISK, DISK], PAGE) == 2


def test_a_step_whose_time_shows_in_the_next_is_still_counted_right() -> None:
    """On a GPU a chunk that samples nothing returns early and the next step waits for its kernels: per
    token the pair is still 1 ms."""
    cost = LoadCost(1)
    for _ in range(50):
        cost.note_prefill(100, 0.001)  # launched: its kernels run on
        cost.note_prefill(100, 0.199)  # waits for both chunks
    assert cost.token_s == pytest.approx(0.001, rel=0.2)


def test_a_tier_measured_slow_is_measured_again_now_and_then() -> None:
    cost = _cost(0.001, 0.010, 0.001)
    decisions = [cost.pages_to_load([DISK], PAGE) for _ in range(2 * PROBE_EVERY)]
    assert decisions.count(1) == 2 == cost.probes  # every PROBE_EVERY-th declined hit loads
    cost.note_load([0.0, 0.0001], [0, 1], 100)  # the probe found the disk fast now
    for _ in range(10):
        cost.note_load([0.0, 0.0001], [0, 1], 100)
    assert cost.pages_to_load([DISK], PAGE) == 1
    assert cost.stats(DISK)["load_bytes_per_s"] > 0 and cost.prefill_tokens_per_s() == 1000


# -- an engine over a fast host tier and a slowed disk tier -----------------------------------------
# 16-token pages, one per prefill step: a page's recompute is a whole step (milliseconds, more on a
# loaded machine), far above a host page's load (a copy of 16 KB) and far below a slowed disk page's.
ENGINE_PAGE = 16


def _tokens(pages: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 290) for _ in range(pages * ENGINE_PAGE)]


def _keys(ctl: TierController, doc: list[int]) -> list[bytes]:
    return list(chain_keys(namespace_key(ctl.seed, None), doc, 0, len(doc), ENGINE_PAGE))


def test_a_slow_tier_is_recomputed_and_a_fast_one_loaded(tiny_llama: Path, tmp_path: Path) -> None:
    host_only = _tokens(8, 1)  # in the host tier (eight pages: a hiccup of the loader thread is shared)
    disk_first = _tokens(1, 2)  # on the slowed disk only: the first disk hit, measured
    both = _tokens(8, 3)  # 4 pages in the host tier, then 4 on the slowed disk only
    disk_only = _tokens(3, 4)  # on the slowed disk only, after it was measured
    docs = [host_only, disk_first, both, disk_only]
    prompts = [d + [5, 6, 7] for d in docs]
    opts = dict(page_size=ENGINE_PAGE, max_batched_tokens=ENGINE_PAGE)
    off = Engine(str(tiny_llama), num_pages=64, prefix_cache=False, **opts)
    ref = [o.token_ids for o in off.generate(prompts, GREEDY)]
    eng = Engine(
        str(tiny_llama),
        num_pages=24,
        host_cache_gb=0.01,
        disk_cache_gb=0.01,
        disk_cache_dir=str(tmp_path / "kv"),
        **opts,
    )
    ctl = eng.kv_manager.tiers
    assert isinstance(ctl, TierController)
    disk = ctl.stores[DISK]
    assert isinstance(disk, DiskStore)
    ctl.stores[DISK] = SlowDisk(
        disk.dir, disk.stats.capacity_bytes, disk.fingerprint, disk.page_shape, disk.dtype
    )
    for prompt, want in zip(prompts, ref):  # computed; written through to host and disk
        assert eng.generate([prompt], GREEDY)[0].token_ids == want
    seed = 1000
    while any(eng.kv_manager.tree.peek(d).num_tokens for d in docs):  # pushed off the device
        eng.generate([_tokens(8, seed)], GREEDY)
        seed += 1
    ctl.drain()
    ctl.stores[HOST].discard([*_keys(ctl, disk_first), *_keys(ctl, both)[4:], *_keys(ctl, disk_only)])

    def run(i: int) -> dict[str, int]:
        out = eng.generate([prompts[i]], GREEDY)[0]
        assert out.token_ids == ref[i]  # the same tokens, loaded or recomputed
        eng.check_integrity()
        return {t: n // ENGINE_PAGE for t, n in out.cached_tokens_by_tier.items() if n}

    assert run(0) == {"host": 8}  # the host tier: loaded (and measured)
    assert run(1) == {"disk": 1}  # the first disk hit loads, unmeasured, and is measured slow
    disk_page_s = ctl.cost.page_s[DISK]
    assert disk_page_s is not None and disk_page_s >= READ_DELAY_S
    disk_reads = ctl.stores[DISK].stats.hits
    recomputed = eng.stats().tiers["device"]["recomputed_pages"]
    assert run(2) == {"host": 4}  # the host's four pages load; the disk's four are recomputed
    assert run(3) == {}  # all on the slow disk: nothing loads, all of it is computed
    assert ctl.stores[DISK].stats.hits == disk_reads  # not a page read from the slow disk since
    stats = eng.stats().tiers
    assert stats["device"]["recomputed_pages"] == recomputed + 4 + 3
    assert stats["device"]["prefill_tokens_per_s"] > 0
    assert 0 < stats["disk"]["load_bytes_per_s"] < stats["host"]["load_bytes_per_s"]
    eng.close()
