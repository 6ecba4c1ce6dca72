"""Host-RAM and disk KV stores beneath the device pool, behind one small storage interface.

A page of KV travels between tiers as one CPU tensor, the pool's byte record of the page (K, V and,
for int8 KV, their scales, of every layer, then the prompt scores of its positions:
``KVPool.read_pages``), under a 16-byte key: a hash chain
over the page's whole token prefix, seeded with the model fingerprint and the namespace
(``namespace_key`` then ``page_key`` per page). Equal keys mean the same model, namespace and tokens
up to the page's end, hence the same KV, so a key can be looked up in any store without the tree that
produced it, and a disk store can be reindexed after a restart.

Invariants:
- ``HostStore``: every slot is free or holds exactly one key; used bytes never exceed the capacity.
- ``DiskStore`` (``cache/disk_store.py``): its own invariants are in its module.
- A store's methods may be called from any thread (each store has its own lock); ``get`` returns a
  tensor that stays valid whatever the store does next.

``TierController`` (``cache/tier_controller.py``) chains the stores (host first, then disk), owns the
write policy and the loads, and runs disk writes and loads on two background threads.
"""

from __future__ import annotations

import hashlib
import math
import threading
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Protocol

import torch

KEY_BYTES = 16


def namespace_key(fingerprint: bytes, namespace: Hashable) -> bytes:
    """The chain's seed for one namespace of one model."""
    return hashlib.blake2b(fingerprint + repr(namespace).encode(), digest_size=KEY_BYTES).digest()


def page_key(prev: bytes, tokens: Sequence[int]) -> bytes:
    """The key of the page holding ``tokens``, given the key of the page before it (or the seed)."""
    data = b"".join(int(t).to_bytes(4, "little") for t in tokens)
    return hashlib.blake2b(prev + data, digest_size=KEY_BYTES).digest()


def chain_keys(key: bytes, tokens: Sequence[int], start: int, end: int, page_size: int) -> Iterator[bytes]:
    """Keys of the whole pages of ``tokens[start:end]``, continuing the chain from ``key``."""
    for i in range(start, start + (end - start) // page_size * page_size, page_size):
        key = page_key(key, tokens[i : i + page_size])
        yield key


def model_fingerprint(
    model: torch.nn.Module,
    config: object,
    dtype: torch.dtype,
    page_size: int,
    kv_dtype: str = "float32",
    shards: int = 1,
) -> bytes:
    """A cheap, stable identity of the KV a model produces and of its page layout: its config, dtype,
    weights format (the model's ``quantization``: int8 weights give other K/V than fp32 ones, and the
    parameters' dtypes), page size, KV dtype (a page written at one is never read at another) and a
    few weights; with tensor parallelism, the TP size (a record then holds every rank's shard of the
    page, ``shards`` of them in rank order).

    Hashing every weight would take seconds for large models; the first, middle and last tensors (and all
    shapes) catch a different checkpoint of the same architecture in practice.
    """
    h = hashlib.blake2b(digest_size=KEY_BYTES)
    quantization = getattr(model, "quantization", None)
    h.update(f"{config!r}|{dtype}|{quantization}|{page_size}|kv={kv_dtype}".encode())
    arithmetic = getattr(model, "arithmetic", "exact")  # a cheaper prefill writes other K/V
    if arithmetic != "exact":
        h.update(f"|arithmetic={arithmetic}".encode())
    if getattr(model, "decode_arithmetic", "exact") != "exact":  # int8 decode writes other K/V again
        h.update(f"|decode={model.decode_arithmetic}".encode())
    attention = getattr(model, "attention_arithmetic", "fp32")  # bf16 attention writes other K/V too
    if attention != "fp32":
        h.update(f"|attention={attention}".encode())
    if getattr(model, "outlier_channels", 0):  # int8 products with fp32 outlier channels: other K/V
        h.update(f"|outliers={model.outlier_channels}".encode())
    if getattr(model, "bf16_copy", False):  # a timed choice; it rounds outputs to bf16, the kernel does not
        h.update(b"|bf16-copy")
    if shards > 1:
        h.update(f"|tp={shards}".encode())
    params = sorted(model.named_parameters(), key=lambda kv: kv[0])
    for name, p in params:
        h.update(f"{name}{tuple(p.shape)}{p.dtype}".encode())
    for _, p in (params[0], params[len(params) // 2], params[-1]) if params else ():
        sample = p.detach().flatten()[:4096].to("cpu", torch.float32).contiguous()
        h.update(sample.numpy().tobytes())
    return h.digest()


@dataclass
class TierStats:
    """Counters of one tier, for ``EngineStats.tiers`` and /metrics."""

    hits: int = 0  # pages served from this tier to a load
    pages_in: int = 0  # pages written into this tier
    bytes_in: int = 0
    bytes_out: int = 0  # bytes read out of this tier by loads
    evicted: int = 0  # pages dropped by this tier's LRU
    rejected: int = 0  # pages found corrupt, foreign or torn (disk) and deleted
    load_s: float = 0.0  # time spent reading for loads
    backup_s: float = 0.0  # time spent writing
    used_bytes: int = 0
    capacity_bytes: int = 0

    def as_dict(self) -> dict[str, float]:
        return {k: float(v) for k, v in asdict(self).items()}


class KVStore(Protocol):
    """A bounded, LRU key -> page store. Host RAM and disk implement it; a remote store could too."""

    name: str
    in_memory: bool  # written on the caller's thread if True, on the writer thread if False
    stats: TierStats

    def contains(self, key: bytes) -> bool: ...

    def get(self, key: bytes) -> torch.Tensor | None:
        """The page under ``key`` (marking it recently used), or None if absent or unreadable."""
        ...

    def put(self, key: bytes, page: torch.Tensor) -> list[tuple[bytes, torch.Tensor]]:
        """Store a page (a no-op, bar the LRU touch, if present); returns the entries evicted to make room."""
        ...

    def discard(self, keys: Iterable[bytes]) -> int:
        """Drop the pages under ``keys``; how many of them it held."""
        ...

    def clear(self) -> None: ...

    def reindex(self) -> None:
        """Read again what the store holds from its medium, which another process may have changed (a
        warm standby taking over from a dead engine). A store only this process sees holds it already."""
        ...

    def check_integrity(self) -> None: ...

    def close(self) -> None:
        """Give back what the store shares with other processes (the disk folder's budget); the store is
        not used again."""
        ...


class HostStore:
    """Pages in one preallocated host tensor of slots (pinned when CUDA is present), LRU-evicted."""

    name = "host"
    in_memory = True  # cheap enough to write on the stepping thread

    def __init__(
        self, capacity_bytes: int, page_shape: Sequence[int], dtype: torch.dtype, pin: bool = False
    ) -> None:
        self.page_shape = tuple(page_shape)
        self.page_bytes = math.prod(self.page_shape) * torch.empty(0, dtype=dtype).element_size()
        self.num_slots = capacity_bytes // self.page_bytes
        self._data = torch.empty((self.num_slots, *self.page_shape), dtype=dtype, pin_memory=pin)
        self._slots: OrderedDict[bytes, int] = OrderedDict()  # key -> slot, least recently used first
        self._free = list(range(self.num_slots - 1, -1, -1))
        self._lock = threading.Lock()
        self.stats = TierStats(capacity_bytes=self.num_slots * self.page_bytes)

    def contains(self, key: bytes) -> bool:
        with self._lock:
            return key in self._slots

    def get(self, key: bytes) -> torch.Tensor | None:
        with self._lock:
            slot = self._slots.get(key)
            if slot is None:
                return None
            self._slots.move_to_end(key)
            return self._data[slot].clone()  # a copy: the slot may be reused as soon as the lock is released

    def put(self, key: bytes, page: torch.Tensor) -> list[tuple[bytes, torch.Tensor]]:
        with self._lock:
            if key in self._slots:
                self._slots.move_to_end(key)
                return []
            if self.num_slots == 0:
                return [(key, page)]
            evicted = []
            if not self._free:
                old, slot = self._slots.popitem(last=False)
                evicted.append((old, self._data[slot].clone()))
                self._free.append(slot)
                self.stats.evicted += 1
            slot = self._free.pop()
            self._data[slot].copy_(page)
            self._slots[key] = slot
            self.stats.pages_in += 1
            self.stats.bytes_in += self.page_bytes
            self.stats.used_bytes = len(self._slots) * self.page_bytes
            return evicted

    def discard(self, keys: Iterable[bytes]) -> int:
        with self._lock:
            slots = [self._slots.pop(k) for k in keys if k in self._slots]
            self._free.extend(slots)
            self.stats.used_bytes = len(self._slots) * self.page_bytes
            return len(slots)

    def clear(self) -> None:
        with self._lock:
            self._slots.clear()
            self._free = list(range(self.num_slots - 1, -1, -1))
            self.stats.used_bytes = 0

    def reindex(self) -> None:
        pass  # this process's memory: nobody else changed it

    def close(self) -> None:
        pass  # shares nothing with other processes

    def check_integrity(self) -> None:
        with self._lock:
            used = list(self._slots.values())
            owned = used + self._free
            assert len(set(owned)) == len(owned), "a host slot is both free and used, or used twice"
            assert sorted(owned) == list(range(self.num_slots)), "a host slot is leaked"
            assert self.stats.used_bytes == len(used) * self.page_bytes <= self.stats.capacity_bytes
