"""CacheControl (``Engine.cache_control``): the engine's side of cache control (docs/cache.md): pins
granted with requests, warms (prefill-only requests), the usage a step reports, and the calls the
engine process answers (list, unpin, evict by prefix).

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
from radixserve.cache.pin_types import PinInfo, PinRef, PinSpec, PrefixEviction
from radixserve.engine.deltas import StepOutput
from radixserve.engine.request import Request
from radixserve.errors import InvalidRequestError

WARM_FINISH = "warm"  # the finish reason of a warm


class PinStats(TypedDict):
    pinned_pages: int
    num_pins: int


class CacheUsage(TypedDict):
    """The cache fields of a StepOutput (engine/deltas.py)."""

    cached_tokens_by_tier: dict[str, int]
    cache_write_tokens: int
    cache_pin: PinRef | None


def cache_usage(req: Request) -> CacheUsage:
    pin = req.pages.pin
    return CacheUsage(
        cached_tokens_by_tier=req.pages.cached_by_tier,
        cache_write_tokens=req.pages.write_tokens,
        cache_pin=pin.ref() if pin is not None else None,
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
        kv_manager.enable_pins(max_pinned_fraction, reserve)

    # -- with add_request ------------------------------------------------------------------------
    def prepare(self, reqs: list[Request], pin: PinSpec | None, warm: bool) -> None:
        """Grant ``pin`` to the request's first sample (or refuse it: InvalidRequestError, PinBudgetError,
        nothing changed) and mark warms."""
        if pin is not None:
            if self.kv.pins is None:
                raise InvalidRequestError(
                    f"{pin.param}: pins need the prefix cache, which is off (--no-prefix-cache)",
                    pin.param,
                    "prefix_cache_off",
                )
            first = reqs[0]
            first.pages.pin = self.kv.pins.grant(first.prompt_token_ids, first.cache_salt, pin)
        for r in reqs:
            r.warm = warm

    def on_added(self, reqs: list[Request], finish: Callable[[Request, str], None]) -> list[StepOutput]:
        """Just taken from the inbox: a pin whose prefix is cached is held now, and a warm the device pool
        already holds in full ends here (its output is returned)."""
        kv, outputs = self.kv, []
        for r in reqs:
            if r.pages.pin is not None and kv.pins is not None:
                kv.pins.hold(r.pages.pin)
            if not r.warm or kv.tree is None:
                continue
            tokens = r.prompt_token_ids
            if kv.tree.prefix_len(tokens, r.cache_salt) < len(tokens):
                continue
            match = kv.tree.match_prefix(tokens, r.cache_salt)  # a hit: LRU order, hit counts, pin TTLs
            if kv.pins is not None:
                kv.pins.hit(kv.tree.path(match.node))
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
        return self.kv.pins.info(namespace) if self.kv.pins is not None else []

    def unpin(self, pin_id: str, namespace: str | None) -> bool:
        pins = self.kv.pins
        pin = pins.find(pin_id, namespace) if pins is not None else None
        if pin is None:
            return False
        assert pins is not None
        pins.drop(pin)
        return True

    def evict(self, token_ids: list[int], namespace: str | None) -> PrefixEviction:
        return self.kv.evict_prefix(token_ids, namespace)

    def advance_clock(self, seconds: float) -> None:
        if self.kv.pins is not None:
            self.kv.pins.advance(seconds)

    def stats(self) -> PinStats:
        """Device pages held by pins (and pending ones), and the number of pins, for EngineStats."""
        pins = self.kv.pins
        if pins is None:
            return PinStats(pinned_pages=0, num_pins=0)
        return PinStats(pinned_pages=pins.pages(everyone=True), num_pins=len(pins))
