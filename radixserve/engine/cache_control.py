"""CacheControl (``Engine.cache_control``): the engine's side of cache control (docs/cache.md): warms
(prefill-only requests), the usage a step reports, and the calls the engine process answers (list,
unpin, evict by prefix). Every pin rule is the cache's (``cache/pins/``: ``PinControl``); this class
hands it the requests and the calls.

A warm is a request whose prompt is whole pages. It is scheduled like any other and computes its
prefill into the tree, but nothing is sampled: the step that finishes its prefill ends it with finish
reason ``"warm"`` and no tokens. A warm whose prompt the device pool already holds in full ends as it is
taken from the inbox, without being scheduled: it costs no forward pass (it still counts as a hit:
LRU order and the TTL of the pins it covers are renewed).

All of this runs on the stepping thread, but ``prepare`` (called by ``Engine.add_request``): a pin's
budget is checked there, so that a pin over the budget is refused before the request is queued; the
engine process calls ``add_request`` from its stepping thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypedDict

from radixserve.cache.kv_manager import KVCacheManager
from radixserve.cache.pins.control import PinControl, PinStats
from radixserve.cache.pins.types import PinInfo, PinRef, PinSpec, PrefixEviction
from radixserve.engine.deltas import StepOutput
from radixserve.engine.request import Request

WARM_FINISH = "warm"  # the finish reason of a warm


class CacheUsage(TypedDict):
    """The cache fields of a StepOutput (engine/deltas.py)."""

    cached_tokens_by_tier: dict[str, int]
    cache_write_tokens: int
    cache_pin: PinRef | None
    reused_document_tokens: int
    recomputed_tokens: int


def cache_usage(req: Request) -> CacheUsage:
    pin = req.pages.pin
    return CacheUsage(
        cached_tokens_by_tier=req.pages.cached_by_tier,
        cache_write_tokens=req.pages.write_tokens,
        cache_pin=pin.ref() if pin is not None else None,
        reused_document_tokens=req.pages.reused_document_tokens,
        recomputed_tokens=req.pages.recomputed_tokens,
    )


def ending_output(req: Request, finish_reason: str, now: float) -> StepOutput:
    """The last output of a sample that ends without a token (a warm's, an abort's)."""
    return StepOutput(
        group_id=req.group_id,
        index=req.index,
        token_ids=[],
        text=None if req.text is None else "",
        logprobs=None,
        finish_reason=finish_reason,
        stop_reason=None,
        cached_tokens=req.pages.num_cached_tokens,
        time=now,
        **cache_usage(req),
    )


class CacheControl:
    def __init__(self, kv_manager: KVCacheManager, max_pinned_fraction: float, max_model_len: int) -> None:
        self.kv = kv_manager
        # Pins never leave less than one whole-context request's pages unpinned, so it always runs.
        reserve = -(-max_model_len // kv_manager.page_size)
        self.pin_control = PinControl(kv_manager, max_pinned_fraction, reserve)

    # -- with add_request ------------------------------------------------------------------------
    def prepare(self, reqs: list[Request], pin: PinSpec | None, warm: bool) -> None:
        """Grant ``pin`` to the request's first sample (or refuse it: InvalidRequestError, PinBudgetError,
        nothing changed) and mark warms."""
        if pin is not None:
            first = reqs[0]
            first.pages.pin = self.pin_control.grant(first.prompt_token_ids, first.cache_salt, pin)
        for r in reqs:
            r.warm = warm

    def on_added(self, reqs: list[Request], finish: Callable[[Request, str], None]) -> list[StepOutput]:
        """Just taken from the inbox: a pin whose prefix is cached is held now, and a warm the device pool
        already holds in full ends here (its output is returned)."""
        outputs = []
        for r in reqs:
            self.pin_control.hold(r)
            tokens = r.prompt_token_ids
            if not r.warm or not self.kv.hit(tokens, r.cache_salt):  # a hit: LRU order, pin TTLs, ...
                continue
            r.pages.num_cached_tokens = len(tokens)
            r.pages.cached_by_tier = {"device": len(tokens), "host": 0, "disk": 0}
            outputs.append(self._warm_output(r))
            finish(r, WARM_FINISH)
        return outputs

    # -- in the step -------------------------------------------------------------------------------
    def finish_warms(
        self, reqs: list[Request], finish: Callable[[Request, str], None]
    ) -> tuple[list[StepOutput], list[Request]]:
        """Of the requests whose prefill this step finished, the warms end here, unsampled; returns
        their outputs and the requests left to sample."""
        outputs = [self._warm_output(r) for r in reqs if r.warm]
        for r in reqs:
            if r.warm:
                finish(r, WARM_FINISH)
        return outputs, [r for r in reqs if not r.warm]

    @staticmethod
    def _warm_output(req: Request) -> StepOutput:
        return ending_output(req, WARM_FINISH, time.monotonic())

    # -- the calls ---------------------------------------------------------------------------------
    def pins(self, namespace: str | None) -> list[PinInfo]:
        return self.pin_control.info(namespace)

    def unpin(self, pin_id: str, namespace: str | None) -> bool:
        return self.pin_control.unpin(pin_id, namespace)

    def evict(self, token_ids: list[int], namespace: str | None) -> PrefixEviction:
        return self.kv.evict_prefix(token_ids, namespace)

    def advance_clock(self, seconds: float) -> None:
        self.pin_control.advance_clock(seconds)

    def stats(self) -> PinStats:
        return self.pin_control.stats()
