"""TierController: the one owner of the tiers beneath the device pool (host RAM, disk).

It owns the write policy (``WritePolicy``) and the write-through threshold, so it alone decides when
a device page gets a copy below (backups); it copies pages between the device pool and the stores
(as the pool's byte records: K, V and int8 scales, ``KVPool.read_pages``) through the attention
backend's ``gather_pages``/``scatter_pages``; it keeps the loads in flight; and
it runs disk writes and loads on two background threads, so the stepping thread does no file I/O.

The radix tree only records where each page lives (``TreeNode.backed_up`` and the chain keys the stores
are addressed by) and reports what eviction freed without a copy. ``KVCacheManager`` decides which
pages to load and allocates their device pages; the controller owns each ``Load`` from ``start_load`` to
its release (``land`` puts its pages into the tree, ``abandon`` drops it). The manager tells the
controller what happened through its ``CacheListener`` hooks (a chunk was cached, a path was hit,
pages were evicted) and the policy decides what to copy. Without stores the manager holds a
``NoTiers`` instead, which holds nothing and loads nothing. (Building one from a config:
``cache/tier_setup.py``.)
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from functools import partial
from pathlib import Path

import torch

from radixserve.cache.disk_store import DiskStore
from radixserve.cache.listener import CachedChunk, CacheListener
from radixserve.cache.load_cost import LoadCost
from radixserve.cache.page_pool import PageCopier, PagedPool
from radixserve.cache.radix.node import EvictResult, MatchResult, TreeNode
from radixserve.cache.radix.tree import RadixCache
from radixserve.cache.request_pages import Load
from radixserve.cache.tiers import KVStore

logger = logging.getLogger(__name__)


class WritePolicy(enum.Enum):
    """When a device page gets a copy in the stores below (docs/cache.md has the table)."""

    WRITE_THROUGH = "write_through"  # when a computed chunk enters the tree
    WRITE_THROUGH_SELECTIVE = "write_through_selective"  # once a node has ``threshold`` hits
    WRITE_BACK = "write_back"  # when the device evicts it; host LRU victims then go to disk


WRITE_POLICIES = tuple(p.value for p in WritePolicy)


class TierController(CacheListener):
    """The stores beneath ``pool``, fastest first, with the write policy, the loads and the copy threads.

    ``backup`` puts pages into the first store now; under the write-through policies it also queues
    them for the stores below, and under write-back a store's LRU victims are queued for the next store
    down. A backlog over ``max_pending`` pages drops further writes (a cache may forget; it may not stall).
    """

    def __init__(
        self,
        stores: Sequence[KVStore],
        seed: bytes,
        pool: PagedPool,
        backend: PageCopier,
        policy: WritePolicy = WritePolicy.WRITE_THROUGH,
        write_through_threshold: int = 2,
        max_pending: int = 4096,
        scatter_on_land: bool = False,
    ) -> None:
        if not stores:
            raise ValueError("a TierController needs at least one store")
        self.stores = list(stores)
        self.seed = seed  # the model fingerprint, mixed into every key
        self.pool = pool
        self.backend = backend  # the engine's attention backend: its gather/scatter move the pages
        self.policy = policy
        self.write_through_threshold = write_through_threshold
        self.max_pending = max_pending
        # Pages read by the loader thread are written into the pool when they land, on the stepping
        # thread, instead of on the loader thread: a tensor-parallel pool's writes are collectives.
        self.scatter_on_land = scatter_on_land
        self.dropped_writes = 0
        self.loads: list[Load] = []  # in flight, or landed and still locked for their request
        self.loading_pages = 0  # device pages held by loads in flight
        self.num_loads = 0
        self.failed_loads = 0
        # Measured load time per page of each store and prefill time per token: a load takes only the
        # pages that loading brings back sooner than recomputing them (cache/load_cost.py).
        self.cost = LoadCost(len(self.stores))
        self._pending = 0
        self._pending_lock = threading.Lock()
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="kv-tier-write")
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="kv-tier-load")

    # -- what the tree asks (the LowerTiers protocol) -------------------------------------------
    def lookup(self, keys: Iterable[bytes]) -> list[int]:
        """For the leading keys found in some store, the index of the fastest store holding each."""
        tiers = []
        for key in keys:
            tier = next((i for i, s in enumerate(self.stores) if s.contains(key)), None)
            if tier is None:
                break
            tiers.append(tier)
        return tiers

    # -- the write policy -------------------------------------------------------------------------
    def on_cached(self, chunk: CachedChunk) -> None:
        """A computed chunk entered the tree, ending at ``chunk.node``; write-through copies it down now."""
        if self.policy is WritePolicy.WRITE_THROUGH and chunk.added_pages:
            self._backup(chunk.node)

    def on_hit(self, path: Sequence[TreeNode]) -> None:
        """A request was admitted on ``path``; selective write-through copies the nodes hit often enough."""
        if self.policy is WritePolicy.WRITE_THROUGH_SELECTIVE:
            for node in path:
                if node.hit_count >= self.write_through_threshold:
                    self._backup(node)

    def on_evicted(self, evicted: EvictResult, by_prefix: bool) -> None:
        """Write-back: pages that left the device for room without a copy below get one now.

        Called on the stepping thread right after the eviction, before anything can allocate (and
        overwrite) the freed pages. Under the write-through policies such pages are simply dropped, and
        so are those of an eviction by prefix (the manager discards their copies).
        """
        if self.policy is WritePolicy.WRITE_BACK and evicted.unbacked_pages and not by_prefix:
            self.backup(evicted.unbacked_keys, self._gather(evicted.unbacked_pages))

    def on_flush(self) -> None:
        self.clear()

    def copy_everywhere(self, nodes: Iterable[TreeNode]) -> None:
        """Write the pages of ``nodes`` to every store now, whatever the policy (what must survive a
        restart: cache/pins/store.py)."""
        for node in nodes:
            pages = self._gather(node.pages).to("cpu")
            for key, page in zip(node.hashes, pages):
                for tier in range(len(self.stores)):
                    if not self.stores[tier].contains(key):
                        self._store(tier, key, page, cascade=False)
            node.backed_up = True

    def discard(self, keys: list[bytes]) -> int:
        """Drop every store's copy of ``keys`` (an eviction by prefix); how many copies went. An in-memory
        store drops them at once; the others on the writer thread, after the writes queued before, and
        this waits for it: a queued copy must not land after the discard and bring the page back, and
        the count must include it. (An explicit eviction may wait for the write backlog; nothing else
        calls this.)"""
        return sum(
            store.discard(keys) if store.in_memory else self._writer.submit(store.discard, keys).result()
            for store in self.stores
        )

    def load_now(self, keys: list[bytes], tiers: list[int], pages: list[int]) -> bool:
        """Fill device ``pages`` with ``keys`` on this thread (start-up only: cache/pins/store.py)."""
        return self._load(keys, tiers, partial(self._scatter, pages))

    def submit_write(self, job: Callable[[], None]) -> None:
        """Run ``job`` on the writer thread, after the writes queued before it (small files, e.g. pins)."""
        self._writer.submit(job)

    @property
    def disk_dir(self) -> Path | None:
        """The disk store's directory, if there is one."""
        return next((s.dir for s in self.stores if isinstance(s, DiskStore)), None)

    def _backup(self, node: TreeNode) -> None:
        if not node.backed_up:
            self.backup(node.hashes, self._gather(node.pages))
            node.backed_up = True

    # -- loads -----------------------------------------------------------------------------------
    def start_load(
        self, match: MatchResult, tokens: list[int], namespace: Hashable, pages: list[int]
    ) -> Load:
        """Fill device ``pages`` with the first ``len(pages)`` of ``match.lower_keys`` (those worth
        loading: ``cost.pages_to_load``) on the loader thread. The caller has locked ``match.node`` and
        allocated ``pages``; ``tokens`` ends with the loaded pages."""
        keys, where = list(match.lower_keys[: len(pages)]), list(match.lower_tiers[: len(pages)])
        held: list[torch.Tensor] | None = [] if self.scatter_on_land else None
        sink = held.append if held is not None else partial(self._scatter, pages)
        future = self._loader.submit(self._load, keys, where, sink)
        tiers = [self.stores[t].name for t in where]
        load = Load(tokens, namespace, match.node, list(match.pages), pages, future, tiers, held)
        self.loads.append(load)
        self.loading_pages += len(pages)
        self.num_loads += 1
        return load

    def finished_loads(self) -> list[Load]:
        """Loads whose pages have all arrived (or that failed) and have not landed yet."""
        return [x for x in self.loads if not x.ready and x.future.done()]

    def in_flight(self) -> list[Load]:
        return [x for x in self.loads if not x.ready]

    def land(self, load: Load, tree: RadixCache, free: Callable[[list[int]], None]) -> None:
        """Land a finished load: its pages join ``tree`` (all of them; those the tree already held are
        handed to ``free``) and the load's lock moves to the node that ends them, kept for its request
        until ``abandon``. A load that failed (a page gone, a broken store) frees all its pages instead,
        and its request computes those tokens."""
        self.loading_pages -= len(load.pages)
        load.ready = True
        try:
            ok = load.future.result()
        except Exception:  # a broken store must cost a recompute, never the engine
            ok = False
        if ok and load.held:
            self._scatter(load.pages, load.held.pop())
        if ok:
            r = tree.insert(load.tokens, load.prefix_pages + load.pages, load.namespace)
            if r.num_existing < len(load.tokens):
                r.node.backed_up = True  # its pages came from the lower tiers
            m = tree.match_prefix(load.tokens, load.namespace)
            tree.lock(m.node)
            tree.unlock(load.node)
            load.node = m.node
            first = len(load.prefix_pages)
            free([p for p, t in zip(load.pages, m.pages[first:]) if p != t])
        else:
            self.failed_loads += 1
            free(load.pages)
            load.pages = []
        if load.abandoned:
            self._release(load, tree)

    def abandon(self, load: Load, tree: RadixCache) -> None:
        """Its request was admitted (its own lock covers the pages now) or has gone: the load's lock is
        dropped now if it has landed, else as it lands; the load is then gone."""
        load.abandoned = True
        if load.ready:
            self._release(load, tree)

    def _release(self, load: Load, tree: RadixCache) -> None:
        tree.unlock(load.node)
        self.loads.remove(load)

    def wait_for_loads(self, timeout: float) -> None:
        """Block until a load in flight finishes or ``timeout`` passes."""
        pending = [x.future for x in self.in_flight()]
        if pending:
            wait(pending, timeout, return_when=FIRST_COMPLETED)

    # -- pages in and out of the device pool --------------------------------------------------------
    def _gather(self, pages: list[int]) -> torch.Tensor:
        """Device ``pages`` as byte records ``[n, page_bytes]``."""
        return self.pool.read_pages(self.backend, pages)

    def _scatter(self, pages: list[int], data: torch.Tensor) -> None:
        """Loader thread: write byte records ``[n, page_bytes]`` into device ``pages``."""
        self.pool.write_pages(self.backend, pages, data)

    # -- the stores -----------------------------------------------------------------------------------
    def backup(self, keys: Sequence[bytes], pages: torch.Tensor) -> None:
        """Copy ``pages`` (``[n, *page_shape]``, any device) into the stores under ``keys``."""
        pages = pages.to("cpu")
        for key, page in zip(keys, pages):
            self._store(0, key, page)

    def drain(self) -> None:
        """Wait for every queued write (tests, shutdown)."""
        self._writer.submit(lambda: None).result()

    def close(self) -> None:
        self._loader.shutdown(wait=True)
        self._writer.shutdown(wait=True)
        for store in self.stores:
            store.close()  # a disk store leaves its folder's shared budget

    def clear(self) -> None:
        self.drain()
        for store in self.stores:
            store.clear()

    def stats(self) -> dict[str, dict[str, float]]:
        out = {s.name: s.stats.as_dict() | self.cost.stats(i) for i, s in enumerate(self.stores)}
        out[self.stores[-1].name]["dropped_writes"] = float(self.dropped_writes)
        return out

    def check_integrity(self) -> None:
        loading = sum(len(x.pages) for x in self.in_flight())
        assert loading == self.loading_pages, f"loading page count {self.loading_pages} != {loading} held"
        for store in self.stores:
            store.check_integrity()

    def _load(self, keys: list[bytes], tiers: list[int], sink: Callable[[torch.Tensor], None]) -> bool:
        """Loader thread: read every page and hand them, stacked, to ``sink``; all or nothing. A load
        that succeeds is measured: per store, its reads plus its share (by pages) of the write into the
        pool, what ``cost`` weighs against recomputing."""
        pages = []
        spent, served = [0.0] * len(self.stores), [0] * len(self.stores)
        for key, tier in zip(keys, tiers):
            for i in range(tier, len(self.stores)):  # evicted meanwhile or corrupt: a slower tier may have it
                store = self.stores[i]
                start = time.perf_counter()
                page = store.get(key)
                took = time.perf_counter() - start
                store.stats.load_s += took
                spent[i] += took
                if page is not None:
                    break
            if page is None:
                return False
            store.stats.hits += 1
            store.stats.bytes_out += page.numel() * page.element_size()
            served[i] += 1
            pages.append(page)
        start = time.perf_counter()
        sink(torch.stack(pages))
        share = (time.perf_counter() - start) / len(pages)
        page_bytes = pages[0].numel() * pages[0].element_size()
        self.cost.note_load([s + share * n for s, n in zip(spent, served)], served, page_bytes)
        return True

    def _store(self, tier: int, key: bytes, page: torch.Tensor, cascade: bool = True) -> None:
        """Put now into an in-memory store; queue the put for the writer thread otherwise. ``cascade``:
        the policy may copy it further down (else only this store gets it)."""
        if self.stores[tier].in_memory:
            self._put(tier, key, page, cascade)
            return
        with self._pending_lock:
            if self._pending >= self.max_pending:
                self.dropped_writes += 1
                return
            self._pending += 1
        self._writer.submit(self._put_queued, tier, key, page, cascade)

    def _put_queued(self, tier: int, key: bytes, page: torch.Tensor, cascade: bool) -> None:
        try:
            self._put(tier, key, page, cascade)
        except OSError as exc:  # a full or failing disk: the page is forgotten, the engine goes on
            with self._pending_lock:
                self.dropped_writes += 1
                first = self.dropped_writes == 1
            if first:
                logger.warning(
                    "a KV page write to the %s tier failed (%s): such pages are dropped",
                    self.stores[tier].name,
                    exc,
                )
        finally:
            with self._pending_lock:
                self._pending -= 1

    def _put(self, tier: int, key: bytes, page: torch.Tensor, cascade: bool = True) -> None:
        store = self.stores[tier]
        start = time.perf_counter()
        evicted = store.put(key, page)
        store.stats.backup_s += time.perf_counter() - start
        below = tier + 1
        if below == len(self.stores):
            return
        if self.policy is WritePolicy.WRITE_BACK:  # a store's victims go down whatever ``cascade`` says
            for k, p in evicted:
                self._store(below, k, p)
        elif cascade and not self.stores[below].contains(key):
            self._store(below, key, page)


class NoTiers(CacheListener):
    """The lower tiers of a manager without any: nothing is held below, so nothing loads, every hook
    does nothing and every count is zero."""

    def __init__(self) -> None:
        self.loads: list[Load] = []  # stays empty
        self.stores: list[KVStore] = []
        self.loading_pages = 0
        self.num_loads = 0
        self.failed_loads = 0
        self.cost = LoadCost(0)  # measures the prefill all the same; there is nothing to load

    def start_load(
        self, match: MatchResult, tokens: list[int], namespace: Hashable, pages: list[int]
    ) -> Load:
        raise RuntimeError("no lower tiers to load from")  # prefetch never finds pages below

    def finished_loads(self) -> list[Load]:
        return []

    def land(self, load: Load, tree: RadixCache, free: Callable[[list[int]], None]) -> None:
        raise RuntimeError("no lower tiers to load from")

    def abandon(self, load: Load, tree: RadixCache) -> None:
        raise RuntimeError("no lower tiers to load from")

    def wait_for_loads(self, timeout: float) -> None:
        pass

    def discard(self, keys: list[bytes]) -> int:
        return 0

    def drain(self) -> None:
        pass

    def stats(self) -> dict[str, dict[str, float]]:
        return {}
