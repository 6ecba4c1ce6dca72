"""Reasoning models: a reply's ``<think>…</think>`` part becomes ``reasoning_content``, apart from
``content``.

``--reasoning-parser qwen3`` or ``deepseek_r1`` (vLLM's names; both write ``<think>…</think>``) turns it on.
Whether a reply starts inside the reasoning is read from the rendered prompt, not guessed from the
model's name: DeepSeek-R1's template ends the prompt with ``<think>\\n`` (the reply starts inside), Qwen3's
with ``enable_thinking: false`` ends it with an empty ``<think>\\n\\n</think>\\n\\n`` (the reply is all
content), and a reply may open ``<think>`` itself at its start. The newlines after ``</think>`` are not
content, as Qwen3's template drops them when it renders the reply back.

``ReasoningStream`` splits a sample's text as it streams; the whole reply is one ``feed`` and ``finish``,
so streamed and whole replies split the same way.
"""

from __future__ import annotations

REASONING_PARSERS = ("qwen3", "deepseek_r1")
THINK_START, THINK_END = "<think>", "</think>"


def starts_in_reasoning(prompt: str) -> bool:
    """The rendered prompt leaves a ``<think>`` open: the reply starts inside the reasoning."""
    return prompt.rfind(THINK_START) > prompt.rfind(THINK_END)


def held_back(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``: while streaming,
    text that may still become the marker is held back."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class ReasoningStream:
    """One sample's text, split into (reasoning, content) deltas."""

    def __init__(self, inside: bool) -> None:
        self._state = "reasoning" if inside else "start"  # start -> reasoning -> after -> content
        self._buf = ""
        self.reasoned = inside  # some of the reply is reasoning (the field is sent, maybe empty)

    def feed(self, delta: str) -> tuple[str, str]:
        self._buf += delta
        reasoning = content = ""
        while True:
            if self._state == "start":
                stripped = self._buf.lstrip()
                if stripped.startswith(THINK_START):
                    self._state, self._buf, self.reasoned = "reasoning", stripped[len(THINK_START) :], True
                    continue
                if THINK_START.startswith(stripped):  # nothing yet, or the beginning of <think>
                    return reasoning, content
                self._state = "content"
            elif self._state == "reasoning":
                end = self._buf.find(THINK_END)
                if end < 0:
                    keep = held_back(self._buf, THINK_END)
                    reasoning += self._buf[: len(self._buf) - keep]
                    self._buf = self._buf[len(self._buf) - keep :]
                    return reasoning, content
                reasoning += self._buf[:end]
                self._state, self._buf = "after", self._buf[end + len(THINK_END) :]
            elif self._state == "after":
                self._buf = self._buf.lstrip("\n")
                if not self._buf:
                    return reasoning, content
                self._state = "content"
            else:
                content += self._buf
                self._buf = ""
                return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is still held back, at the end of the sample."""
        rest, self._buf = self._buf, ""
        if self._state == "reasoning":
            return rest, ""
        return "", rest if self._state != "after" else ""
