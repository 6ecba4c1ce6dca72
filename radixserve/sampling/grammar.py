"""Constrained decoding with llguidance: constraints compile to matchers, matchers give token masks.

Invariants:
- One llguidance tokenizer bridge per ``GrammarCompiler`` (building it costs about a second).
- Compiled grammars are cached by (kind, canonical source). A cached matcher is a pristine template
  that never consumes a token; every request gets its own deep copy, so samples never share state.
- A mask is a bool tensor of the model's vocabulary size: ids the tokenizer does not know (the padding
  rows of a model whose embedding is larger than its vocabulary) are never allowed.
- Once a grammar is complete, llguidance allows only EOS (the bridge knows the tokenizer's EOS id).
  A matcher that entered llguidance's error state (it was fed a token outside its mask) also allows only
  EOS and reports itself terminated, so the request ends instead of looping.
- Nothing here raises on a bad constraint at decode time: bad constraints are rejected by ``validate``
  (InvalidRequestError naming the field and llguidance's message) before a request is queued.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import llguidance
import llguidance.hf
import numpy as np
import torch

from radixserve.errors import InvalidRequestError
from radixserve.sampling.params import SamplingParams

# Flexible whitespace lets a sampling model spend its whole token budget on blanks between JSON
# tokens (random-ish logits do exactly that), so JSON gets fixed separators unless the schema's
# "x-guidance" options say otherwise (these are llguidance *defaults*, which x-guidance overrides).
JSON_DEFAULTS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_ONE = (
    "items",
    "additionalItems",
    "contains",
    "not",
    "if",
    "then",
    "else",
    "additionalProperties",
    "propertyNames",
    "unevaluatedProperties",
    "unevaluatedItems",
)
_SCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf", "items")
_BITS = torch.arange(32, dtype=torch.int32)


def _bit(i: int) -> int:
    """Bit ``i`` of an int32 word as a Python int that fits int32 (bit 31 is the sign bit)."""
    return (1 << i) - (1 << 32 if i == 31 else 0)


def strict_schema(schema: Any) -> Any:
    """A copy of ``schema`` with ``additionalProperties: false`` on every object schema that leaves it unset.

    This is what OpenAI's ``"strict": true`` means; llguidance otherwise allows extra keys.
    """
    if isinstance(schema, list):
        return [strict_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: strict_schema(sub) for name, sub in out[key].items()}
    for key in _SCHEMA_ONE + _SCHEMA_LISTS:
        if isinstance(out.get(key), dict | list):
            out[key] = strict_schema(out[key])
    is_object = out.get("type") == "object" or (isinstance(out.get("type"), list) and "object" in out["type"])
    if (is_object or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def constraint_of(params: SamplingParams) -> tuple[str, str] | None:
    """The (kind, canonical source) of the request's constraint, or None when it has none."""
    if params.regex is not None:
        return "regex", params.regex
    if params.json_schema is not None:
        schema = params.json_schema
        return "json_schema", schema if isinstance(schema, str) else json.dumps(schema, sort_keys=True)
    if params.grammar is not None:
        return "grammar", params.grammar
    if params.choices is not None:
        return "choices", json.dumps(list(params.choices))
    return None


def _to_llguidance(kind: str, source: str) -> str:
    """The llguidance grammar for a constraint; ValueError (naming ``kind``) if it is not even parseable."""
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(source)
    if kind == "grammar":
        return llguidance.LLMatcher.grammar_from_lark(source)
    if kind == "choices":
        # JSON string literals are valid Lark literals; ensure_ascii keeps the escapes simple.
        alternatives = " | ".join(json.dumps(c, ensure_ascii=True) for c in json.loads(source))
        return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(source, defaults=JSON_DEFAULTS)  # type: ignore[arg-type]
    except ValueError as exc:
        raise ValueError(f"json_schema is invalid: {exc}") from None


class Matcher:
    """The grammar state of one sample: which tokens may come next, and what was accepted so far."""

    def __init__(
        self, ll: llguidance.LLMatcher, vocab_size: int, words: int, eos_token_ids: Sequence[int]
    ) -> None:
        self._ll = ll
        self.vocab_size = vocab_size  # the model's: the width of the logits
        self.words = words  # int32 words of llguidance's mask: ceil(tokenizer vocabulary / 32)
        self._eos = list(eos_token_ids)

    def fill_bitmask(self, row: torch.Tensor) -> None:
        """Write llguidance's packed mask (int32, bit i of word w = token 32w+i) into a contiguous CPU row."""
        if self._ll.is_error():
            row.zero_()
            for t in self._eos:
                row[t // 32] |= _bit(t % 32)
            return
        self._ll.unsafe_compute_mask_ptr(row.data_ptr(), self.words * 4)

    def fill_mask(self) -> torch.Tensor:
        """Bool [vocab_size]: the tokens allowed next."""
        mask = batch_mask([self], self.vocab_size)
        assert mask is not None
        return mask[0]

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens`` the grammar would accept in a row from here (nothing is consumed)."""
        if self._ll.is_error() or self._ll.is_stopped():
            return 0
        return int(self._ll.validate_tokens(list(tokens)))

    def fill_draft_bitmasks(self, draft: Sequence[int], rows: torch.Tensor) -> None:
        """Row j of ``rows`` ([len(draft) + 1, words]): the mask after ``draft[:j]``, for verifying drafts
        in one step. The drafts must be a ``valid_prefix``; the state is rolled back after."""
        for j, token in enumerate(draft):
            self.fill_bitmask(rows[j])
            self._ll.consume_token(token)
        self.fill_bitmask(rows[len(draft)])
        if draft:
            self._ll.rollback(len(draft))

    def accept(self, token_id: int) -> bool:
        """Advance past ``token_id``; False (and terminated from now on) if the grammar rejects it."""
        return self._ll.consume_token(token_id)

    def is_terminated(self) -> bool:
        """The grammar is complete (nothing but EOS may follow) or broken: the request should stop."""
        return self._ll.is_stopped()

    def forced_tokens(self) -> list[int]:
        """Jump-forward: the tokens the grammar forces next, without choice (empty if none)."""
        if self._ll.is_error() or self._ll.is_stopped():
            return []
        return list(self._ll.compute_ff_tokens())

    @property
    def error(self) -> str | None:
        return self._ll.get_error() if self._ll.is_error() else None


class GrammarCompiler:
    """Compiles constraints for one tokenizer on worker threads, caching the compiled grammars.

    ``validate`` runs on the caller's thread (about a millisecond); ``submit`` never blocks on a
    compile, so an expensive grammar cannot stall the step loop.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, max_workers: int = 1, cache_size: int = 256) -> None:
        self.vocab_size = vocab_size
        self._lltok = llguidance.hf.from_tokenizer(tokenizer)
        self.eos_token_ids = list(self._lltok.eos_tokens)
        self._words = (self._lltok.vocab_size + 31) // 32
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers, thread_name_prefix="radixserve-grammar"
        )
        self._lock = threading.Lock()
        self._cache_size = cache_size
        self._compiled: OrderedDict[tuple[str, str], concurrent.futures.Future[llguidance.LLMatcher]] = (
            OrderedDict()
        )
        self._validated: OrderedDict[tuple[str, str], str] = OrderedDict()  # key -> error ("" when valid)
        self.cache_hits = 0
        self.cache_misses = 0

    def validate(self, params: SamplingParams) -> None:
        """Raise InvalidRequestError naming the field and the problem if the request's constraint is
        invalid."""
        key = constraint_of(params)
        if key is None:
            return
        with self._lock:
            error = self._validated.get(key)
        if error is None:
            try:
                error = llguidance.LLMatcher.validate_grammar(_to_llguidance(*key), self._lltok)
            except ValueError as exc:
                error = str(exc)
            with self._lock:
                _remember(self._validated, key, error, self._cache_size)
        if error:
            prefix = f"{key[0]} is invalid: "
            raise InvalidRequestError(error if error.startswith(prefix) else prefix + error, key[0])

    def submit(self, params: SamplingParams) -> concurrent.futures.Future[Matcher]:
        """A fresh matcher for one sample, compiled on a worker thread (or copied from the cache).

        The future fails with ValueError if the constraint does not compile; ``params`` must be constrained.
        """
        key = constraint_of(params)
        if key is None:
            raise ValueError("the request has no constraint")
        with self._lock:
            compiled = self._compiled.get(key)
            if compiled is None:
                self.cache_misses += 1
                compiled = self._pool.submit(self._compile, key)
                _remember(self._compiled, key, compiled, self._cache_size)
            else:
                self.cache_hits += 1
                self._compiled.move_to_end(key)
        out: concurrent.futures.Future[Matcher] = concurrent.futures.Future()

        def finish(done: concurrent.futures.Future[llguidance.LLMatcher]) -> None:
            try:
                template = done.result()
                out.set_result(
                    Matcher(template.deep_copy(), self.vocab_size, self._words, self.eos_token_ids)
                )
            except Exception as exc:
                out.set_exception(exc)

        compiled.add_done_callback(finish)
        return out

    def matcher(self, params: SamplingParams) -> Matcher:
        """``submit`` and wait: for tests and offline use."""
        return self.submit(params).result()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, key: tuple[str, str]) -> llguidance.LLMatcher:
        ll = llguidance.LLMatcher(self._lltok, _to_llguidance(*key), log_level=0)
        if ll.is_error():
            raise ValueError(f"{key[0]} is invalid: {ll.get_error()}")
        return ll


def _remember(cache: OrderedDict[Any, Any], key: Any, value: Any, size: int) -> None:
    cache[key] = value
    cache.move_to_end(key)
    while len(cache) > size:
        cache.popitem(last=False)


def batch_mask(
    matchers: Sequence[Matcher | None],
    vocab_size: int,
    device: torch.device | str | None = None,
    drafts: Sequence[Sequence[int]] | None = None,
) -> torch.Tensor | None:
    """Bool [rows, vocab_size] of allowed tokens, rows without a matcher all True; None if no row is
    constrained. Each matcher has one row, or ``len(drafts[i]) + 1`` rows with drafts (one per
    position being verified, ``Matcher.fill_draft_bitmasks``).

    Only constrained rows cost anything: an unconstrained batch returns None before allocating. The
    packed masks are unpacked on ``device``: on a GPU with torch bit ops (the packed transfer is 32x
    smaller), on the CPU with numpy (torch's bit ops measured ~60x slower there, on 2 busy cores).
    """
    if matchers.count(None) == len(matchers):
        return None
    counts = [1] * len(matchers) if drafts is None else [len(d) + 1 for d in drafts]
    starts = [0, *itertools.accumulate(counts)]
    index = [r for i, m in enumerate(matchers) if m is not None for r in range(starts[i], starts[i + 1])]
    device = torch.device(device or "cpu")
    words = max(m.words for m in matchers if m is not None)
    packed = torch.zeros((len(index), words), dtype=torch.int32)
    j = 0
    for i, m in enumerate(matchers):
        if m is None:
            continue
        if drafts is None:
            m.fill_bitmask(packed[j, : m.words])
        else:
            m.fill_draft_bitmasks(drafts[i], packed[j : j + counts[i], : m.words])
        j += counts[i]
    width = min(vocab_size, words * 32)
    num_rows = starts[-1]
    if device.type == "cpu":  # numpy: single-threaded, so no torch thread-pool wake-ups on a busy host
        bits = np.unpackbits(packed.numpy().view(np.uint8), axis=1, bitorder="little").view(np.bool_)
        if len(index) == num_rows and width == vocab_size:
            return torch.from_numpy(bits[:, :vocab_size])
        out = np.ones((num_rows, vocab_size), dtype=np.bool_)
        out[index, :width] = bits[:, :width]
        out[index, width:] = False
        return torch.from_numpy(out)
    gpu_bits = unpack_bits(packed.to(device))
    mask = torch.ones(num_rows, vocab_size, dtype=torch.bool, device=device)
    rows_t = torch.tensor(index, device=device)
    mask[rows_t, :width] = gpu_bits[:, :width]
    mask[rows_t, width:] = False
    return mask


def unpack_bits(packed: torch.Tensor) -> torch.Tensor:
    """Bool [R, 32 * W] from int32 [R, W] llguidance masks, with torch ops (bit i of word w = token 32w +
    i)."""
    return ((packed.unsqueeze(-1) >> _BITS.to(packed.device)) & 1).view(packed.shape[0], -1).bool()


def apply_mask(logits: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Set disallowed logits to -inf in place (``mask`` from ``batch_mask``, moved to the logits' device)."""
    if mask is not None:
        logits.masked_fill_(~mask.to(logits.device), float("-inf"))
    return logits
