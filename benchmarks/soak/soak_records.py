"""What one soak request got back (benchmarks/soak/soak_traffic.py sends it): the client's view of the reply
(``Reply``) and the request it answered (``Record``), for soak_outcomes.py to classify. Plain data, so
the classifier and its tests need no HTTP client."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Reply:
    """What the client got: an HTTP status (None: none came), the error object (a body's or a stream's
    error event), whether the answer was whole ([DONE] seen, a full JSON body), and its text."""

    status: int | None = None
    error: dict[str, Any] | None = None
    done: bool = False
    text: str = ""
    tokens: int = 0
    transport: str = ""  # the transport failure (timeout, reset), empty when none
    body: Any = None


@dataclass
class Record:
    kind: str
    key: int
    sent: float  # seconds since the run's start
    finished: float
    reply: Reply
    expect_4xx: bool = False  # a bad input: a 4xx is the right answer
    mismatch: str = ""  # a probe or a 200 whose content is wrong: what differs
    note: str = ""

    def row(self) -> dict[str, Any]:
        r = self.reply
        err = r.error or {}
        return {
            "kind": self.kind,
            "key": self.key,
            "sent_s": round(self.sent, 3),
            "finished_s": round(self.finished, 3),
            "status": r.status,
            "done": r.done,
            "tokens": r.tokens,
            "error_type": err.get("type"),
            "error": (str(err.get("message", ""))[:160] or r.transport)[:160],
            "mismatch": self.mismatch[:200],
            "note": self.note,
        }
