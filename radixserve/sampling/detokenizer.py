"""Incremental detokenization and stop conditions for one output sequence.

Invariants:
- ``IncrementalDetokenizer.add`` only returns whole characters: text that ends in U+FFFD (a UTF-8
  sequence cut between tokens) waits for the tokens that complete it. ``flush`` gives up waiting.
- ``TextStream`` never emits text that could still turn out to be the start of a stop string, never
  emits a stop string or anything after it, and never emits the text of an EOS or stop token (a
  ``TokenStop`` marked hidden).
- The deltas ``TextStream.append`` returns, joined, equal ``TextStream.text`` once the stream has
  finished: the decoded output (without EOS / stop tokens), cut before the first stop string (after
  it, with ``include_stop_str_in_output``).
- Stop strings are looked for only once the sample has ``min_tokens`` tokens, as in vLLM: one that
  ends earlier does not count.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from radixserve.sampling.params import SamplingParams
from radixserve.sampling.stop import TokenStop

# Tokens of context decoded before the new ones: enough for tokenizers (SentencePiece) whose
# decoding of a token depends on its neighbours, e.g. dropping the leading space of the first token.
_CONTEXT_TOKENS = 5


class Tokenizer(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str | list[str]: ...


def _decoder(tokenizer: Tokenizer) -> Callable[..., str | list[str]]:
    """The tokenizer's decode, or where it is the same text its Rust backend's: a fast tokenizer that
    does not clean up spaces decodes with nothing but the backend call, and HF's wrapper around it
    costs about 3x the call itself, twice a token a sample."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False:
        decode: Callable[..., str | list[str]] = backend.decode
        return decode
    return tokenizer.decode


class IncrementalDetokenizer:
    """Turns token ids into text deltas by decoding a small window of recent tokens.

    ``tokens[prefix_offset:read_offset]`` is text already returned, decoded again as context;
    ``tokens[read_offset:]`` is not returned yet. A delta is the window's decoding minus the
    context's decoding, so each step costs O(window), not O(sequence).
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True
    ):
        self._tokenizer = tokenizer
        self._decode_ids = _decoder(tokenizer)
        self._skip_special_tokens = skip_special_tokens
        self._tokens = list(prompt_token_ids[-_CONTEXT_TOKENS:])  # only the context is ever decoded
        self._read_offset = len(self._tokens)
        self._prefix_offset = max(self._read_offset - _CONTEXT_TOKENS, 0)

    def add(self, token_id: int) -> str:
        """Append one token; return the text it completes ("" while a character is still partial)."""
        tokens = self._tokens
        tokens.append(token_id)
        decode, skip = self._decode_ids, self._skip_special_tokens  # per token: no helper calls
        context = decode(tokens[self._prefix_offset : self._read_offset], skip_special_tokens=skip)
        text = decode(tokens[self._prefix_offset :], skip_special_tokens=skip)
        assert isinstance(context, str) and isinstance(text, str)
        if len(text) <= len(context) or text.endswith("\ufffd"):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        return text[len(context) :]

    def flush(self) -> str:
        """Return whatever is still held back, partial characters decoded as U+FFFD."""
        context, text = self._decode_window()
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        return text[len(context) :]

    def _decode_window(self) -> tuple[str, str]:
        context = self._decode(self._tokens[self._prefix_offset : self._read_offset])
        return context, self._decode(self._tokens[self._prefix_offset :])

    def _decode(self, token_ids: list[int]) -> str:
        text = self._decode_ids(token_ids, skip_special_tokens=self._skip_special_tokens)
        assert isinstance(text, str)
        return text


class TextStream:
    """The text of one output sequence, fed one token at a time, and its stop strings.

    The engine decides on token ids alone whether a token ends the sample (``TokenStop``: EOS, a stop
    token, the token budget, a complete grammar); ``append(token_id, stop)`` adds the token's text and
    returns ``(delta, finish_reason, stop_reason)``:
    - ``delta``: new text safe to show now (may be ""),
    - ``finish_reason``: None while running, else ``stop.finish_reason``, or "stop" when a stop string
      appeared in the text, which ends the sample at this token even though ``stop`` is None,
    - ``stop_reason``: the stop string or stop token id that ended it; None for EOS, "length" and a
      complete grammar.
    Once finished, ``append`` raises. ``text`` is the full text so far (it may run ahead of the
    deltas while a possible stop-string prefix is held back).
    """

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams, prompt_token_ids: Sequence[int]):
        self._detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens)
        self._stops = list(params.stop)
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        self._longest_stop = max((len(s) for s in self._stops), default=0)
        self._emitted = 0  # length of the text prefix already returned as deltas
        self.text = ""
        self.num_tokens = 0
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(
        self, token_id: int, stop: TokenStop | None = None
    ) -> tuple[str, str | None, str | int | None]:
        if self.finish_reason is not None:
            raise RuntimeError("append() after the stream finished")
        self.num_tokens += 1
        start = len(self.text)
        reason: str | None = None
        stop_reason: str | int | None = None
        if stop is None or not stop.hidden:
            self.text += self._detokenizer.add(token_id)
        if stop is not None:
            reason, stop_reason = stop.finish_reason, stop.stop_reason
            self.text += self._detokenizer.flush()
        if not self._stops:  # no stop strings: all of the text can go (the common case, no more calls)
            end = len(self.text)
        else:
            hit = self._find_stop(start)
            if hit is not None:
                index, stop_string = hit
                self.text = self.text[: index + (len(stop_string) if self._include_stop else 0)]
                reason, stop_reason = "stop", stop_string
            held = 0 if reason is not None else self._held_back()
            end = max(len(self.text) - held, self._emitted) if reason is None else len(self.text)
        delta = self.text[self._emitted : end]
        self._emitted = end
        self.finish_reason, self.stop_reason = reason, stop_reason
        return delta, reason, stop_reason

    def _find_stop(self, start: int) -> tuple[int, str] | None:
        """The earliest stop string in the text, given that none lay wholly before ``start``."""
        if not self._stops or len(self.text) == start or self.num_tokens < self._min_tokens:
            return None
        search_from = max(start - self._longest_stop + 1, 0)
        best: tuple[int, str] | None = None
        for stop in self._stops:
            index = self.text.find(stop, search_from)
            if index >= 0 and (best is None or index < best[0]):
                best = (index, stop)
        return best

    def _held_back(self) -> int:
        """Length of the longest text suffix that is a proper prefix of some stop string."""
        for size in range(min(self._longest_stop - 1, len(self.text)), 0, -1):
            tail = self.text[-size:]
            if any(len(stop) > size and stop.startswith(tail) for stop in self._stops):
                return size
        return 0
