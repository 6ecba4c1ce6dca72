"""EngineStats: a snapshot of the engine's counters, for /metrics and for callers of Engine.stats()."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:  # the API server reads EngineStats without the cache's modules
    from radixserve.cache.kv_manager import KVCacheManager


class EngineStats(msgspec.Struct, array_like=True, kw_only=True):
    """A snapshot of the engine's counters (a Struct: the engine process sends one with each step that
    scheduled or finished a request or left the engine idle, and at least every 16 steps or second:
    runtime/messages.py, ``StepReport.stats``). All zero: nothing reported yet."""

    num_waiting: int = 0
    num_running: int = 0
    num_pages: int = 0
    free_pages: int = 0
    cached_pages: int = 0
    in_use_pages: int = 0
    evictable_pages: int = 0
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    evicted_pages: int = 0
    num_preemptions: int = 0
    num_steps: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    tiers: dict[str, dict[str, float]] = msgspec.field(default_factory=dict)  # per tier (device/host/disk)
    # Speculative decoding, by draft source ("tree", "prompt"): tokens drafted and accepted.
    spec_drafted: dict[str, int] = msgspec.field(default_factory=dict)
    spec_accepted: dict[str, int] = msgspec.field(default_factory=dict)
    spec_verify_steps: int = 0  # request-steps that verified drafts
    spec_emitted: int = 0  # tokens those steps produced: the accepted drafts plus one each
    # Cache control (cache/pins/): device pages held by pins, and the pins (held or pending).
    pinned_pages: int = 0
    num_pins: int = 0
    # Document reuse (engine/documents.py): prompt tokens placed from chunks, and those recomputed.
    reused_document_tokens: int = 0
    recomputed_document_tokens: int = 0

    @property
    def spec_mean_accepted_length(self) -> float:
        """Tokens per verifying request-step (1 + accepted drafts; 1.0 means speculation gained nothing)."""
        return self.spec_emitted / self.spec_verify_steps if self.spec_verify_steps else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0


def sum_stats(snapshots: Iterable[EngineStats]) -> EngineStats:
    """Several engines' stats, summed (tiers left out); per-key counters (speculation's, by draft
    source) summed key by key: the view of replicas, or of disaggregated engines, as one."""
    total = EngineStats()
    fields = [f for f in EngineStats.__struct_fields__ if f != "tiers"]
    for s in snapshots:
        for f in fields:
            mine, theirs = getattr(total, f), getattr(s, f)
            if isinstance(mine, dict):
                setattr(total, f, {k: mine.get(k, 0) + theirs.get(k, 0) for k in mine.keys() | theirs.keys()})
            else:
                setattr(total, f, mine + theirs)
    return total


def tier_stats(kv: KVCacheManager) -> dict[str, dict[str, float]]:
    """Per tier: hits, pages and bytes moved, load/backup seconds, occupancy (see TierStats); the
    device's from the manager's counters, the lower tiers' from their controller."""
    tiers = kv.tiers
    device = {
        "hits": float(kv.device_hit_pages),
        "evicted": float(kv.evicted_pages),
        "used_bytes": float((kv.num_cached + kv.num_in_use) * kv.page_bytes),
        "capacity_bytes": float(kv.num_pages * kv.page_bytes),
        "loads": float(tiers.num_loads),
        "failed_loads": float(tiers.failed_loads),
        "loading_pages": float(kv.loading_pages),
        # Pages a lower tier held that requests computed: loading them was slower (or found no room).
        "recomputed_pages": float(kv.recomputed_pages),
        "prefill_tokens_per_s": tiers.cost.prefill_tokens_per_s(),
    }
    return {"device": device, **tiers.stats()}
