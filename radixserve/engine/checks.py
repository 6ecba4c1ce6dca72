"""The checks a request passes before it is queued (``Intake.make``, for ``Engine.add_request``): its
prompt ids, its length against the context and the pool, its priority. Each refusal is an
``InvalidRequestError`` naming the parameter at fault; nothing is queued for a refused request."""

from __future__ import annotations

from radixserve.engine.policy import PRIORITY_NAMES
from radixserve.errors import InvalidRequestError
from radixserve.sampling.params import SamplingParams


def check_prompt(
    token_ids: list[int],
    params: SamplingParams,
    vocab: int,
    max_model_len: int,
    page_size: int,
    num_pages: int,
) -> None:
    """A non-empty prompt of ids in the vocabulary whose prompt + ``max_tokens`` fits the context
    (``max_model_len``) and the pool (``num_pages`` of ``page_size``)."""
    if not token_ids:
        raise InvalidRequestError("prompt is empty", "prompt")
    if any(not 0 <= t < vocab for t in token_ids):
        raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})", "prompt")
    total = len(token_ids) + params.max_tokens
    if total > max_model_len:
        raise InvalidRequestError(
            f"prompt ({len(token_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} tokens "
            f"exceeds the maximum context length of {max_model_len} tokens",
            "max_tokens",
            "context_length_exceeded",
        )
    pages = -(-total // page_size)
    if pages > num_pages:
        # The prompt's fault if it alone overflows the pool, else the output's it asks room for.
        param = "prompt" if -(-len(token_ids) // page_size) > num_pages else "max_tokens"
        raise InvalidRequestError(
            f"the request needs {pages} KV pages but the pool has only {num_pages}", param
        )


def priority_value(priority: int | str) -> int:
    """An integer priority as it is; a name (``PRIORITY_NAMES``) as its value."""
    if isinstance(priority, int):
        return priority
    if priority not in PRIORITY_NAMES:
        raise InvalidRequestError(
            f"priority must be an integer or one of {sorted(PRIORITY_NAMES)}, got {priority!r}", "priority"
        )
    return PRIORITY_NAMES[priority]
