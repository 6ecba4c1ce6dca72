"""The tier controller: each write policy copies pages on its own event only, page copies go through the
engine's attention backend, and a disk directory given alone gets a default size."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from radixserve import Engine, SamplingParams
from radixserve.cache import tier_controller, tier_setup
from radixserve.cache.disk_store import DiskStore
from radixserve.cache.listener import CachedChunk
from radixserve.cache.page_pool import KVPool
from radixserve.cache.radix.tree import RadixCache
from radixserve.cache.tier_controller import TierController, WritePolicy
from radixserve.cache.tier_setup import DISK_DEFAULT_MAX_BYTES, default_disk_bytes
from radixserve.cache.tiers import HostStore
from radixserve.config import EngineConfig
from radixserve.engine.request import Request
from radixserve.model.attention import TorchBackend, get_backend

GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
PAGE = 2


def _controller(policy: WritePolicy, threshold: int = 2) -> TierController:
    pool = KVPool(2, 16, PAGE, 1, 4, torch.float32)
    pool.k_buffer.normal_()
    pool.v_buffer.normal_()
    host = HostStore(64 * pool.page_bytes, (pool.page_bytes,), torch.uint8)
    return TierController([host], b"s" * 16, pool, get_backend("torch"), policy, threshold)


def _held(ctl: TierController, pages: list[int], keys: list[bytes]) -> bool:
    """Every key is in the host store, holding exactly the device page's K and V."""
    host = ctl.stores[0]
    for page, key in zip(pages, keys):
        got = host.get(key)
        if got is None:
            return False
        # a page's record: its K of every layer, then its V, as bytes, then its prompt scores
        pool = ctl.pool
        assert isinstance(pool, KVPool)
        want = torch.cat((pool.k_buffer[:, page].flatten(), pool.v_buffer[:, page].flatten()))
        scores = pool.scores.read_pages(torch.tensor([page]))[0]
        assert torch.equal(got, torch.cat((want.view(torch.uint8), scores))), "a copied page differs"
    return True


@pytest.mark.parametrize("policy", list(WritePolicy))
def test_each_policy_copies_on_its_own_event_only(policy: WritePolicy) -> None:
    """Each policy sees the same three events; only its own makes a copy below."""
    copied_on = []
    # A computed chunk enters the tree (write_through's event).
    ctl = _controller(policy)
    tree = RadixCache(PAGE, on_free=lambda pages: None, tiers=ctl)
    node = tree.insert([1, 2, 3, 4], [5, 6]).node
    keys, pages = list(node.hashes), list(node.pages)
    req = Request("r", "r", 0, [1, 2, 3, 4], 4, SamplingParams())
    ctl.on_cached(CachedChunk(req, node, 4, added_pages=True, duplicates=[], kept=[]))
    if _held(ctl, pages, keys):
        copied_on.append("cached")
        assert node.backed_up
    # A path is hit, once and then twice (write_through_selective's, with threshold 2).
    ctl = _controller(policy)
    tree = RadixCache(PAGE, on_free=lambda pages: None, tiers=ctl)
    tree.insert([1, 2, 3, 4], [5, 6])
    m = tree.match_prefix([1, 2, 3, 4])
    ctl.on_hit(list(tree.path(m.node)))
    assert not _held(ctl, m.pages, m.node.hashes), "copied below the threshold"
    m = tree.match_prefix([1, 2, 3, 4])
    ctl.on_hit(list(tree.path(m.node)))
    if _held(ctl, m.pages, m.node.hashes):
        copied_on.append("hit")
    # The device evicts pages that have no copy below (write_back's).
    ctl = _controller(policy)
    tree = RadixCache(PAGE, on_free=lambda pages: None, tiers=ctl)
    node = tree.insert([1, 2, 3, 4], [5, 6]).node
    keys = list(node.hashes)
    evicted = tree.evict(2)
    assert evicted.unbacked_pages == [5, 6] and evicted.unbacked_keys == keys
    ctl.on_evicted(evicted, by_prefix=False)
    if _held(ctl, [5, 6], keys):
        copied_on.append("evicted")
    expected = {
        WritePolicy.WRITE_THROUGH: ["cached"],
        WritePolicy.WRITE_THROUGH_SELECTIVE: ["hit"],
        WritePolicy.WRITE_BACK: ["evicted"],
    }
    assert copied_on == expected[policy]
    ctl.close()


class _SpyBackend(TorchBackend):
    """The torch reference backend, with its page copies counted."""

    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def gather_pages(self, buffer: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
        self.calls.append("gather")
        return super().gather_pages(buffer, pages)

    def scatter_pages(self, buffer: torch.Tensor, pages: torch.Tensor, src: torch.Tensor) -> None:
        self.calls.append("scatter")
        super().scatter_pages(buffer, pages, src)


def _spy_backend(calls: list[str]) -> _SpyBackend:
    return _SpyBackend(calls)


def test_tier_page_copies_go_through_the_selected_backend(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    spy = _spy_backend(calls)
    monkeypatch.setattr("radixserve.engine.builder.select_backend", lambda name, device: spy)
    eng = Engine(str(tiny_llama), page_size=4, num_pages=40, host_cache_gb=200 * 1024 / 2**30)
    tiers = eng.kv_manager.tiers
    assert isinstance(tiers, TierController) and tiers.backend is spy and eng.runner.backend is spy
    prompt = list(range(10, 90)) + [5]
    first = eng.generate([prompt], GREEDY)[0]
    assert "gather" in calls and "scatter" not in calls  # write-through copied the prefix down
    tree = eng.kv_manager.tree
    assert tree is not None
    seed = 0
    while tree.peek(prompt).num_tokens:  # push the prefix off the device
        eng.generate([[100 + (seed * 7 + i) % 180 for i in range(60)]], GREEDY)
        seed += 1
    again = eng.generate([prompt], GREEDY)[0]
    assert "scatter" in calls  # the load wrote the pages back through the backend
    assert again.cached_tokens == 80 and again.token_ids == first.token_ids
    eng.check_integrity()
    eng.close()


def _free_space(monkeypatch: pytest.MonkeyPatch, free: int) -> None:
    usage = shutil._ntuple_diskusage(10 * free, 9 * free, free)  # type: ignore[attr-defined]
    monkeypatch.setattr(tier_setup.shutil, "disk_usage", lambda path: usage)


def test_disk_dir_alone_gets_a_share_of_the_free_space(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    EngineConfig(disk_cache_dir=str(tmp_path))  # not a start-up error
    with pytest.raises(ValueError, match="needs disk_cache_dir"):
        EngineConfig(disk_cache_gb=1.0)
    _free_space(monkeypatch, 50 * 2**20)
    assert default_disk_bytes(tmp_path / "not" / "made" / "yet") == 5 * 2**20  # a tenth of the free space
    _free_space(monkeypatch, 2**40)
    assert default_disk_bytes(tmp_path) == DISK_DEFAULT_MAX_BYTES == 64 * 2**30  # capped
    _free_space(monkeypatch, 50 * 2**20)
    eng = Engine(str(tiny_llama), page_size=4, num_pages=40, disk_cache_dir=str(tmp_path / "kv"))
    tiers = eng.kv_manager.tiers
    assert isinstance(tiers, TierController)
    (disk,) = tiers.stores
    assert isinstance(disk, DiskStore) and disk.stats.capacity_bytes == 5 * 2**20
    out = eng.generate([list(range(10, 50))], GREEDY)[0]
    tiers.drain()
    # 40 prompt + 3 computed output tokens: 10 whole pages, each written to disk
    assert out.finish_reason == "length" and len(list((tmp_path / "kv").glob("*.kv"))) == 10
    eng.close()


def test_unknown_write_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="write_policy must be one of"):
        EngineConfig(write_policy="write_sometimes")
    assert [p.value for p in WritePolicy] == list(tier_controller.WRITE_POLICIES)


def test_a_full_disk_drops_the_write_and_leaves_no_partial_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ENOSPC while a page is written (found by benchmarks/soak/soak.py's disk-full fault): the page is not
    stored, the write counts as dropped, its temporary file goes at once (it used to stay until the
    next start, holding the space), and the disk takes pages again once it has room."""
    import errno

    pool = KVPool(2, 16, PAGE, 1, 4, torch.float32)
    disk = DiskStore(tmp_path, 1 << 20, b"f" * 16, (pool.page_bytes,), torch.uint8)
    ctl = TierController([disk], b"s" * 16, pool, get_backend("torch"))
    page, keys = torch.zeros(pool.page_bytes, dtype=torch.uint8), [b"a" * 16, b"b" * 16]

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(tier_controller.DiskStore.__module__ + ".os.fsync", full)
        ctl._store(0, keys[0], page)
        ctl.drain()
    assert not disk.contains(keys[0]) and list(tmp_path.glob("*.kv*")) == []  # the ledger stays
    assert ctl.stats()["disk"]["dropped_writes"] == 1
    ctl._store(0, keys[1], page)
    ctl.drain()
    assert disk.contains(keys[1]) and disk.get(keys[1]) is not None
    disk.check_integrity()
    ctl.close()
