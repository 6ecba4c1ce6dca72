"""Marking documents in a prompt: what a request's ``documents`` and ``document_reuse`` become, checked.

A request marks its documents as texts or token-id lists, in the order they occur in the prompt; each
is found in the prompt's tokens after the one before it (a text is tokenized on its own, without
special tokens: a caller whose template might tokenize a document differently inside the prompt passes
the document's token ids). ``document_reuse`` is the share of each placed document's tokens recomputed
(``model/blend_select.py``); None takes the engine's ``document_reuse`` (``--document-reuse``), and a
request whose share is None either way is served exactly as if it marked nothing.

Every refusal is an ``InvalidRequestError`` raised before anything is queued or allocated.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from radixserve.errors import InvalidRequestError

Document = str | list[int]


@dataclass(slots=True)
class DocumentPlan:
    """One sample's documents: ``spans`` are their ``[start, end)`` in the prompt, in order, apart.
    ``done``: its first scheduling has placed them, or left the prompt to an exact prefill."""

    spans: list[tuple[int, int]]
    share: float
    done: bool = False


@dataclass(frozen=True, slots=True)
class DocumentLimits:
    """What a request's documents are checked against; ``unsupported``: why this engine cannot place
    documents at all (None: it can)."""

    default_share: float | None
    max_documents: int
    max_model_len: int
    unsupported: str | None


def check_share(share: Any, param: str = "document_reuse") -> float | None:
    if share is None:
        return None
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share <= 1:
        raise InvalidRequestError(f"{param} must be a number in [0, 1], got {share!r}", param)
    return float(share)


def locate(token_ids: list[int], docs: list[list[int]]) -> list[tuple[int, int]]:
    """Each document's span in ``token_ids``: its first occurrence after the one before it."""
    spans: list[tuple[int, int]] = []
    at = 0
    for i, doc in enumerate(docs):
        n = len(doc)
        first = doc[0]
        found = next(
            (
                s
                for s in range(at, len(token_ids) - n + 1)
                if token_ids[s] == first and token_ids[s : s + n] == doc
            ),
            None,
        )
        if found is None:
            raise InvalidRequestError(
                f"document {i} does not occur in the prompt's tokens after the document before it "
                "(a text tokenized alone may split differently inside the prompt: pass its token ids)",
                "documents",
                "document_not_found",
            )
        spans.append((found, found + n))
        at = found + n
    return spans


def plan_documents(
    tokenizer: Any,
    token_ids: list[int],
    documents: Sequence[Document] | None,
    share: Any,
    limits: DocumentLimits,
    logprobs_from: int | None,
) -> DocumentPlan | None:
    """The checked plan of a request's documents; None where it marks none or the mode is off for it.
    ``logprobs_from``: the first prompt position whose logprob the request wants (None: none)."""
    own = check_share(share)
    if not documents:
        if documents is not None and not isinstance(documents, (list, tuple)):
            raise InvalidRequestError("documents must be a list", "documents")
        return None
    if len(documents) > limits.max_documents:
        raise InvalidRequestError(
            f"{len(documents)} documents; at most {limits.max_documents} may be marked",
            "documents",
            "too_many_documents",
        )
    docs: list[list[int]] = []
    for i, doc in enumerate(documents):
        ids = tokenizer.encode(doc, add_special_tokens=False) if isinstance(doc, str) else list(doc)
        if not ids:
            raise InvalidRequestError(f"document {i} is empty", "documents", "empty_document")
        if len(ids) > limits.max_model_len:
            raise InvalidRequestError(
                f"document {i} has {len(ids)} tokens, more than the context of {limits.max_model_len}",
                "documents",
                "document_too_long",
            )
        docs.append(ids)
    spans = locate(token_ids, docs)
    effective = own if own is not None else limits.default_share
    if effective is None or math.isnan(effective):
        return None
    if limits.unsupported is not None:
        raise InvalidRequestError(
            f"document reuse is not available: {limits.unsupported}", "document_reuse", "unsupported"
        )
    if logprobs_from is not None and logprobs_from <= spans[-1][1]:
        # a position after the last document is scored from logits computed in full; none before
        raise InvalidRequestError(
            "prompt_logprobs with document reuse must start after the last document "
            f"(prompt_logprobs_start > {spans[-1][1]}): placed tokens' logits are not computed",
            "prompt_logprobs_start",
        )
    return DocumentPlan(spans, effective)
