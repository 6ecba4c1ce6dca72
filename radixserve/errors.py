"""Errors a caller can act on, typed so they keep their meaning across the engine's process boundary."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request the engine refuses as given. ``param`` names the offending field (the engine's
    name for it, e.g. ``max_tokens``), ``code`` a machine-readable reason where there is one; the
    server answers ``status`` (400) with both, so neither is ever parsed back out of the message."""

    status = 400

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class PinBudgetError(InvalidRequestError):
    """A pin the pinned-page budget (``max_pinned_fraction``) has no room for: answered 429, and nothing
    changed (the pins already held stay, the request did not run)."""

    status = 429
