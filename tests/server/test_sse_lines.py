"""Every SSE event's JSON is one line for any client: the line ends Python's str.splitlines knows
(httpx's aiter_lines splits there) that JSON leaves raw in strings are escaped. Found by the chaos soak:
a token of the tiny random model decoded to U+2028 and the client read half an event."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
from httpx._decoders import LineDecoder

from radixserve.server.anthropic import protocol as pa
from radixserve.server.anthropic.messages import _event
from radixserve.server.http.responses import sse

TEXT = "a\u2028b\x85c\u2029d\ne"  # the three, and a newline (JSON escapes that one itself)


def _httpx_lines(text: str) -> list[str]:
    return LineDecoder().decode(text)


@pytest.mark.parametrize("split", [str.splitlines, _httpx_lines])
def test_an_event_with_unicode_line_separators_is_one_line(split: Callable[[str], list[str]]) -> None:
    lines = [ln for ln in split(sse({"text": TEXT}).decode()) if ln]
    assert len(lines) == 1 and lines[0].startswith("data: ")
    assert json.loads(lines[0][len("data: ") :]) == {"text": TEXT}


def test_an_anthropic_event_too() -> None:
    event = pa.ContentBlockDelta(index=0, delta=pa.TextDelta(text=TEXT))
    lines = [ln for ln in _event(event).decode().splitlines() if ln]
    assert len(lines) == 2 and lines[0] == "event: content_block_delta"
    assert json.loads(lines[1][len("data: ") :])["delta"]["text"] == TEXT
