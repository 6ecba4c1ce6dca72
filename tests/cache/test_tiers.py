"""The tiered KV cache (host RAM, disk) beneath the device pool: exactness per tier, restart, faults,
capacity, integrity under churn, loads that do not hold up others (tiny model)."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_models import make_tiny_model

from radixserve import Engine, SamplingParams
from radixserve.cache.disk_store import DiskStore
from radixserve.cache.radix.node import EvictResult
from radixserve.cache.radix.tree import RadixCache
from radixserve.cache.scores import ScoreTable
from radixserve.cache.tiers import HostStore, chain_keys, namespace_key, page_key

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
PAGE = 4
PAGE_BYTES = 2 * 2 * PAGE * 2 * 16 * 4  # K+V, 2 layers, 4 tokens, 2 kv heads, head_dim 16, float32
RECORD_BYTES = PAGE_BYTES + ScoreTable.record_bytes(PAGE)  # a page in the tiers: its KV, then its scores


def gb(pages: int) -> float:
    return pages * RECORD_BYTES / 2**30


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 290) for _ in range(n)]


def engine(model: Path, num_pages: int = 40, **options: Any) -> Engine:
    return Engine(str(model), page_size=PAGE, num_pages=num_pages, **options)


def reference(model: Path, prompts: list[list[int]], **options: Any) -> list[list[int]]:
    off = engine(model, 512, prefix_cache=False, **options)
    return [o.token_ids for o in off.generate(prompts, GREEDY)]


def evict_from_device(eng: Engine, doc: list[int]) -> None:
    """Fill the device pool with other prompts until no page of ``doc`` is left on it."""
    seed = 1000
    while eng.kv_manager.tree is not None and eng.kv_manager.tree.peek(doc).num_tokens:
        eng.generate([tokens(100, seed)], GREEDY)
        seed += 1
    if eng.kv_manager.tiers is not None:
        eng.kv_manager.tiers.drain()


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Any:
    """Tiny models on a shared, loaded machine: intra-op threads only add waits."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def long_llama(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path) -> Path:
    """The tiny llama with a 2,048-token context (the weights don't depend on it)."""
    path = tmp_path_factory.mktemp("long") / "tiny-llama-long"
    shutil.copytree(tiny_llama, path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["max_position_embeddings"] = 2048
    (path / "config.json").write_text(json.dumps(cfg))
    return path


TIER_SETUPS: dict[str, dict[str, Any]] = {
    "host": dict(host_cache_gb=gb(400)),
    "host-write-back": dict(host_cache_gb=gb(400), write_policy="write_back"),
    "host-selective": dict(
        host_cache_gb=gb(400), write_policy="write_through_selective", write_through_threshold=1
    ),
    "disk": dict(disk_cache_gb=gb(400)),
    "host-spills-to-disk": dict(host_cache_gb=gb(8), disk_cache_gb=gb(400), write_policy="write_back"),
}


@pytest.mark.parametrize(
    ("setup", "kv_dtype"),
    [(setup, "float32") for setup in sorted(TIER_SETUPS)]
    + [(setup, kv) for setup in ("host", "disk") for kv in ("bfloat16", "int8")],
)
def test_outputs_identical_from_every_tier(
    setup: str, kv_dtype: str, tiny_llama: Path, tmp_path: Path
) -> None:
    """From every tier and at every KV dtype: the same greedy tokens as with no cache at that dtype."""
    doc = tokens(100, 1)
    prompt = doc + [5, 6, 7]
    (ref,) = reference(tiny_llama, [prompt], kv_cache_dtype=kv_dtype)
    options = dict(TIER_SETUPS[setup], kv_cache_dtype=kv_dtype)
    if "disk_cache_gb" in options:
        options["disk_cache_dir"] = str(tmp_path / "kv")
    eng = engine(tiny_llama, **options)
    fresh = eng.generate([prompt], GREEDY)[0]
    device_hit = eng.generate([prompt], GREEDY)[0]
    assert (fresh.cached_tokens, device_hit.cached_tokens) == (0, 100)
    evict_from_device(eng, doc)
    before = eng.stats().tiers
    lower = eng.generate([prompt], GREEDY)[0]
    after = eng.stats().tiers
    assert lower.cached_tokens == 100  # every whole page of the document came back from below
    assert fresh.token_ids == device_hit.token_ids == lower.token_ids == ref
    hits = {t: after[t]["hits"] - before[t]["hits"] for t in after if t != "device"}
    assert sum(hits.values()) == 25 and after["device"]["loads"] == before["device"]["loads"] + 1
    assert after["device"]["hits"] == before["device"]["hits"]  # loaded pages are not device hits
    if setup == "disk":
        assert hits == {"disk": 25}
    if setup == "host-spills-to-disk":
        assert hits["disk"] > 0 and after["host"]["evicted"] > 0  # pushed out of a full host, then loaded
    eng.check_integrity()
    eng.close()


def test_restart_serves_a_long_prefix_from_disk(long_llama: Path, tmp_path: Path) -> None:
    doc = tokens(1000, 2)
    prompt = doc + [9, 8, 7]
    opts = dict(disk_cache_gb=gb(600), disk_cache_dir=str(tmp_path / "kv"), max_batched_tokens=512)
    first = engine(long_llama, 512, **opts)
    out1 = first.generate([prompt], GREEDY)[0]
    first.close()
    assert out1.cached_tokens == 0
    second = engine(long_llama, 512, **opts)
    out2 = second.generate([prompt], GREEDY)[0]
    assert out2.cached_tokens == 1000
    assert out2.token_ids == out1.token_ids
    assert second.stats().tiers["disk"]["hits"] == 250
    second.check_integrity()
    second.close()


WRITER = """
import random, sys
from radixserve import Engine, SamplingParams
e = Engine(sys.argv[1], page_size=4, num_pages=128, disk_cache_gb=float(sys.argv[3]),
           disk_cache_dir=sys.argv[2])
i = 0
while True:
    rng = random.Random(i)
    e.generate([[rng.randrange(3, 290) for _ in range(120)]], SamplingParams(max_tokens=1, temperature=0))
    i += 1
"""


def test_kill_9_while_writing_then_restart(tiny_llama: Path, tmp_path: Path) -> None:
    kv = tmp_path / "kv"
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tiny_llama), str(kv), str(gb(2000))])
    try:
        deadline = time.monotonic() + 120
        while len(list(kv.glob("*.kv"))) < 60 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
    finally:
        proc.kill()  # SIGKILL, in the middle of a stream of page writes
        proc.wait()
    assert len(list(kv.glob("*.kv"))) >= 60
    (kv / f"{'ab' * 16}.kv.{proc.pid}.2.tmp").write_bytes(b"half a page")  # as a kill mid-write leaves it
    prompt = tokens(120, 0) + [4, 4]  # the writer's first prompt, so its pages are on disk
    (ref,) = reference(tiny_llama, [prompt])
    eng = engine(tiny_llama, disk_cache_gb=gb(2000), disk_cache_dir=str(kv))
    assert not list(kv.glob("*.tmp"))  # interrupted writes are cleaned up
    out = eng.generate([prompt], GREEDY)[0]
    assert out.token_ids == ref
    assert out.cached_tokens == 120
    eng.check_integrity()
    eng.close()


def _write_doc_to_disk(model: Path, kv: Path, prompt: list[int]) -> None:
    eng = engine(model, 512, disk_cache_gb=gb(600), disk_cache_dir=str(kv))
    eng.generate([prompt], GREEDY)
    eng.close()


def _page_file(model: Path, kv: Path, doc: list[int], page: int) -> Path:
    """The disk file of page ``page`` of ``doc`` (keys from a throwaway engine's tree: same model, same
    chain)."""
    tree = engine(model, 8, host_cache_gb=gb(1)).kv_manager.tree
    assert tree is not None
    keys = list(chain_keys(tree._last_key(tree._root(None)), doc, 0, len(doc), tree.page_size))
    return kv / f"{keys[page].hex()}.kv"


def test_truncated_page_file_is_dropped_at_start(tiny_llama: Path, tmp_path: Path) -> None:
    kv, doc = tmp_path / "kv", tokens(100, 3)
    prompt = doc + [1, 2]
    (ref,) = reference(tiny_llama, [prompt])
    _write_doc_to_disk(tiny_llama, kv, prompt)
    path = _page_file(tiny_llama, kv, doc, 10)
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)  # a torn write
    eng = engine(tiny_llama, 512, disk_cache_gb=gb(600), disk_cache_dir=str(kv))
    assert eng.stats().tiers["disk"]["rejected"] == 1 and not path.exists()
    out = eng.generate([prompt], GREEDY)[0]
    assert out.token_ids == ref
    assert out.cached_tokens == 40  # pages 0-9 from disk; page 10 and after recomputed
    eng.check_integrity()


def test_flipped_byte_fails_the_load_and_the_engine_recomputes(tiny_llama: Path, tmp_path: Path) -> None:
    kv, doc = tmp_path / "kv", tokens(100, 4)
    prompt = doc + [1, 2]
    (ref,) = reference(tiny_llama, [prompt])
    _write_doc_to_disk(tiny_llama, kv, prompt)
    eng = engine(tiny_llama, 512, disk_cache_gb=gb(600), disk_cache_dir=str(kv))
    path = _page_file(tiny_llama, kv, doc, 7)
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x01  # inside the K/V payload: only the checksum can tell
    path.write_bytes(bytes(data))
    out = eng.generate([prompt], GREEDY)[0]
    assert out.token_ids == ref
    assert out.cached_tokens == 0  # all or nothing: the load failed, the whole prefix was recomputed
    stats = eng.stats().tiers
    assert stats["device"]["failed_loads"] == 1 and stats["disk"]["rejected"] == 1
    eng.check_integrity()


def test_another_model_fingerprint_is_never_served(tiny_llama: Path, tmp_path: Path) -> None:
    kv, doc = tmp_path / "kv", tokens(100, 5)
    prompt = doc + [1, 2]
    _write_doc_to_disk(tiny_llama, kv, prompt)
    written = len(list(kv.glob("*.kv")))
    other = make_tiny_model(tmp_path, "llama", seed=1)  # same architecture, other weights
    (ref,) = reference(other, [prompt])
    eng = engine(other, 512, disk_cache_gb=gb(600), disk_cache_dir=str(kv))
    assert eng.stats().tiers["disk"]["rejected"] == written >= 25
    out = eng.generate([prompt], GREEDY)[0]
    assert out.token_ids == ref and out.cached_tokens == 0
    eng.check_integrity()


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "int8"])
def test_disk_round_trip_at_each_kv_dtype_and_no_hits_at_another(
    kv_dtype: str, tiny_llama: Path, tmp_path: Path
) -> None:
    """A restart at the same KV dtype serves the prefix from disk (the same tokens); one at another dtype
    finds no page it may read: the files are of another fingerprint, dropped, and nothing is a hit."""
    kv, doc = tmp_path / "kv", tokens(100, 6)
    prompt = doc + [1, 2]
    opts = dict(disk_cache_gb=gb(600), disk_cache_dir=str(kv))
    first = engine(tiny_llama, 512, kv_cache_dtype=kv_dtype, **opts)
    want = first.generate([prompt], GREEDY)[0]
    first.close()
    written = len(list(kv.glob("*.kv")))
    again = engine(tiny_llama, 512, kv_cache_dtype=kv_dtype, **opts)
    out = again.generate([prompt], GREEDY)[0]
    assert out.cached_tokens == 100 and out.token_ids == want.token_ids
    assert again.stats().tiers["disk"]["hits"] == 25
    again.close()
    other = "float32" if kv_dtype == "int8" else "int8"
    (ref,) = reference(tiny_llama, [prompt], kv_cache_dtype=other)
    eng = engine(tiny_llama, 512, kv_cache_dtype=other, **opts)
    assert eng.stats().tiers["disk"]["rejected"] == written >= 25
    out = eng.generate([prompt], GREEDY)[0]
    assert out.cached_tokens == 0 and out.token_ids == ref
    assert eng.stats().tiers["disk"]["hits"] == 0
    eng.check_integrity()
    eng.close()


@pytest.mark.parametrize("policy", ["write_through", "write_back", "write_through_selective"])
def test_every_tier_stays_within_its_capacity(policy: str, tiny_llama: Path, tmp_path: Path) -> None:
    kv = tmp_path / "kv"
    eng = engine(
        tiny_llama,
        40,
        host_cache_gb=gb(20),
        disk_cache_gb=gb(30),
        disk_cache_dir=str(kv),
        write_policy=policy,
        write_through_threshold=1,
    )
    prompts = [tokens(60, 100 + i) for i in range(12)]  # 12 x 15 pages: far more than 40 + 20 + 30
    for p in prompts:
        eng.generate([p, p], GREEDY)  # twice: a hit for write_through_selective
        eng.kv_manager.tiers.drain()  # type: ignore[union-attr]
        eng.check_integrity()
        tiers = eng.stats().tiers
        assert tiers["host"]["used_bytes"] <= tiers["host"]["capacity_bytes"] == 20 * RECORD_BYTES
        on_disk = sum(f.stat().st_size for f in kv.glob("*.kv"))
        assert on_disk == tiers["disk"]["used_bytes"] <= tiers["disk"]["capacity_bytes"]
        assert len(list(kv.glob("*.kv"))) <= 30
    tiers = eng.stats().tiers
    assert tiers["device"]["evicted"] > 0 and tiers["host"]["evicted"] > 0 and tiers["disk"]["evicted"] > 0
    assert eng.kv_manager.match(_req(eng, prompts[0])) == 0  # the oldest are gone from every tier
    assert eng.kv_manager.match(_req(eng, prompts[-1])) > 0
    eng.close()


def _req(eng: Engine, prompt: list[int]) -> Any:
    return eng.intake.new_request("probe", 0, prompt, GREEDY, 0, None, time.monotonic())


def test_churn_keeps_every_tier_consistent(tiny_llama: Path, tmp_path: Path) -> None:
    rng = random.Random(7)
    docs = [tokens(rng.randrange(20, 90), 200 + i) for i in range(6)]
    prompts = [rng.choice(docs) + tokens(rng.randrange(1, 12), 300 + i) for i in range(40)]
    refs = dict(zip(map(tuple, prompts[:8]), reference(tiny_llama, prompts[:8])))
    eng = engine(
        tiny_llama,
        48,
        host_cache_gb=gb(24),
        disk_cache_gb=gb(40),
        disk_cache_dir=str(tmp_path / "kv"),
        write_policy="write_back",
        max_batched_tokens=64,
    )
    outs: dict[str, list[int]] = {}
    ids: dict[str, list[int]] = {}
    pending = list(prompts)
    while pending or eng.has_unfinished():
        for _ in range(rng.randrange(0, 3)):
            if pending:
                p = pending.pop(0)
                ids[eng.add_request(p, GREEDY)] = p
        for out in eng.step():
            outs.setdefault(out.group_id, []).extend(out.token_ids)
        if rng.random() < 0.05 and ids:
            eng.abort(rng.choice(list(ids)))
        eng.check_integrity()
    for rid, p in ids.items():
        if tuple(p) in refs and len(outs.get(rid, [])) == GREEDY.max_tokens:
            assert outs[rid] == refs[tuple(p)]
    assert eng.stats().tiers["device"]["loads"] > 0
    eng.check_integrity()
    eng.close()


def test_a_request_waiting_on_a_load_does_not_hold_up_others(tiny_llama: Path) -> None:
    eng = engine(tiny_llama, host_cache_gb=gb(400))
    doc = tokens(100, 9)
    eng.generate([doc + [1]], GREEDY)
    evict_from_device(eng, doc)
    host = eng.kv_manager.tiers.stores[0]  # type: ignore[union-attr]
    gate = threading.Event()
    real_get = host.get

    def slow_get(key: bytes) -> torch.Tensor | None:
        gate.wait(30)
        return real_get(key)

    host.get = slow_get  # type: ignore[method-assign]
    waiting = eng.add_request(doc + [2], GREEDY)
    other = eng.add_request(tokens(30, 10), GREEDY)
    done: set[str] = set()
    for _ in range(50):
        done |= {o.group_id for o in eng.step() if o.finish_reason}
        if other in done:
            break
    assert other in done and waiting not in done  # the other finished while the load was held back
    eng.check_integrity()  # the loading request's pages are accounted while in flight
    gate.set()
    while eng.has_unfinished():
        eng.step()
    assert eng.stats().tiers["host"]["hits"] == 25
    eng.check_integrity()


def test_stores_roundtrip_and_lru(tmp_path: Path) -> None:
    shape = (2, 2, PAGE, 2, 16)
    pages = [torch.randn(shape) for _ in range(4)]
    keys = [bytes([i]) * 16 for i in range(4)]
    host = HostStore(3 * PAGE_BYTES, shape, torch.float32)
    assert all(host.put(k, p) == [] for k, p in zip(keys[:3], pages[:3]))
    assert host.get(keys[0]) is not None  # now keys[1] is the least recently used
    (evicted,) = host.put(keys[3], pages[3])
    assert evicted[0] == keys[1] and torch.equal(evicted[1], pages[1])
    assert torch.equal(host.get(keys[3]), pages[3]) and not host.contains(keys[1])  # type: ignore[arg-type]
    host.check_integrity()
    fp = b"f" * 16
    disk = DiskStore(tmp_path, 2 * (PAGE_BYTES + 64), fp, shape, torch.float32)
    for k, p in zip(keys[:3], pages[:3]):
        disk.put(k, p)
    assert not disk.contains(keys[0]) and len(list(tmp_path.glob("*.kv"))) == 2
    reopened = DiskStore(tmp_path, 2 * (PAGE_BYTES + 64), fp, shape, torch.float32)
    assert torch.equal(reopened.get(keys[2]), pages[2])  # type: ignore[arg-type]
    reopened.check_integrity()


def test_a_second_store_on_the_directory_keeps_a_live_writers_temporary_and_reindex_sees_new_pages(
    tmp_path: Path,
) -> None:
    """A warm standby indexes the disk directory while the serving process writes to it: the serving
    process's write in progress (a temporary named with its live pid) stays, a dead process's goes,
    and ``reindex`` (on taking over) finds what the serving process wrote and evicted since."""
    shape = (2, 2, PAGE, 2, 16)
    fp, keys = b"f" * 16, [bytes([i]) * 16 for i in range(3)]
    serving = DiskStore(tmp_path, 4 * (PAGE_BYTES + 64), fp, shape, torch.float32)
    serving.put(keys[0], torch.randn(shape))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    live_tmp = tmp_path / f"{keys[2].hex()}.kv.{os.getpid()}.1.tmp"
    dead_tmp = tmp_path / f"{keys[2].hex()}.kv.{dead.pid}.1.tmp"
    live_tmp.write_bytes(b"a write in progress")
    dead_tmp.write_bytes(b"half a page")
    standby = DiskStore(tmp_path, 4 * (PAGE_BYTES + 64), fp, shape, torch.float32)
    assert live_tmp.exists() and not dead_tmp.exists()
    assert standby.contains(keys[0]) and not standby.contains(keys[1])
    page = torch.randn(shape)
    serving.put(keys[1], page)
    serving.discard([keys[0]])
    standby.reindex()
    assert not standby.contains(keys[0]) and torch.equal(standby.get(keys[1]), page)  # type: ignore[arg-type]
    standby.check_integrity()


def test_a_page_of_the_older_format_is_refused_cleanly(tmp_path: Path) -> None:
    """Format 02 records had no prompt scores: such a file is deleted when the directory is indexed
    (its page is recomputed), never read as a page of the current format."""
    shape = (2, 2, PAGE, 2, 16)
    fp, key = b"f" * 16, b"k" * 16
    disk = DiskStore(tmp_path, 4 * (PAGE_BYTES + 64), fp, shape, torch.float32)
    disk.put(key, torch.randn(shape))
    path = disk.path(key)
    data = bytearray(path.read_bytes())
    assert data[:8] == b"RSKVPG03"
    data[:8] = b"RSKVPG02"
    path.write_bytes(bytes(data))
    reopened = DiskStore(tmp_path, 4 * (PAGE_BYTES + 64), fp, shape, torch.float32)
    assert not reopened.contains(key) and reopened.get(key) is None and not path.exists()
    assert reopened.stats.rejected == 1
    reopened.check_integrity()


class FakeLower:
    """A lower tier as the tree sees it: a dict of keys (the ``LowerTiers`` protocol)."""

    seed = b"s" * 16

    def __init__(self) -> None:
        self.held: dict[bytes, int] = {}

    def lookup(self, keys: Any) -> list[int]:
        tiers = []
        for k in keys:
            if k not in self.held:
                break
            tiers.append(self.held[k])
        return tiers


def test_tree_keys_unbacked_eviction_and_lower_match() -> None:
    lower, freed = FakeLower(), list[int]()
    tree = RadixCache(2, tiers=lower, on_free=freed.extend)
    tree.insert([1, 2, 3, 4, 5, 6], [10, 11, 12])
    k0 = page_key(namespace_key(lower.seed, None), [1, 2])
    keys = [k0, page_key(k0, [3, 4]), page_key(page_key(k0, [3, 4]), [5, 6])]
    assert tree.match_prefix([1, 2, 3, 4, 9, 9]).node.hashes == keys[:2]  # split keeps the chain
    tree.check_integrity()
    # No copy below: the tree reports the freed pages with their keys (for write-back to copy).
    assert tree.evict(2) == EvictResult(2, [12, 11], [keys[2], keys[1]], [keys[2], keys[1]])
    lower.held.update({keys[1]: 0, keys[2]: 1})
    m = tree.match_prefix([1, 2, 3, 4, 5, 6, 7])
    assert (m.pages, m.lower_keys, m.lower_tiers) == ([10], (keys[1], keys[2]), (0, 1))
    peek = tree.peek([1, 2, 3, 4, 5, 6, 7], lower=True)
    assert (peek.num_tokens, peek.lower_pages) == (2, 2) and tree.peek([1, 2, 3, 4]).num_tokens == 2
    assert tree.lower_keys([1, 2, 3, 4, 5, 6, 7]) == [keys[1], keys[2]]  # past the device match
    tree.match_prefix([1, 2]).node.backed_up = True
    # A backed-up page just leaves the device; its key is still reported (an eviction by prefix drops
    # the copies below too).
    assert tree.evict(1) == EvictResult(1, [], [], [keys[0]])
    assert freed == [12, 11, 10]


def test_discard_drops_a_stores_pages_and_counts_what_it_held(tmp_path: Path) -> None:
    shape, keys = (2, 4), [bytes([i]) * 16 for i in range(3)]
    host = HostStore(8 * 4 * 8, shape, torch.float32)  # 8 slots
    disk = DiskStore(tmp_path / "kv", 1 << 20, b"f" * 16, shape, torch.float32)
    stores: list[tuple[HostStore | DiskStore, int]] = [(host, host.page_bytes), (disk, disk.file_bytes)]
    for store, one_page in stores:
        for i, key in enumerate(keys):
            store.put(key, torch.full(shape, float(i)))
        assert store.discard([keys[0], keys[2], b"x" * 16]) == 2
        assert [store.contains(k) for k in keys] == [False, True, False]
        assert store.discard([keys[0]]) == 0
        store.check_integrity()
        assert store.stats.used_bytes == one_page
    assert sorted(p.name for p in (tmp_path / "kv").glob("*.kv")) == [f"{keys[1].hex()}.kv"]
