"""Stop conditions that need no text: EOS, stop token ids and the token budget.

The engine applies these to every sampled token (and ends a sample whose grammar is complete);
stop strings need the text, so ``TextStream`` (sampling/detokenizer.py) checks them, wherever the
text is made: in the engine (``Engine._postprocess``), offline and in the server's engine process alike.
"""

from __future__ import annotations

from collections.abc import Container
from typing import NamedTuple

from radixserve.sampling.params import SamplingParams


class TokenStop(NamedTuple):
    """Why a token ended its sample, decided on token ids alone."""

    finish_reason: str  # "stop" or "length"
    stop_reason: int | None = None  # the stop token id that matched
    hidden: bool = False  # an EOS or stop token: it ends the sample and has no text


GRAMMAR_COMPLETE = TokenStop("stop")  # the constraint is satisfied: only EOS could follow


def token_stop(
    params: SamplingParams, eos_token_ids: Container[int], token_id: int, num_output_tokens: int
) -> TokenStop | None:
    """What ``token_id``, the ``num_output_tokens``-th output token, does to its sample (None: nothing)."""
    if token_id in eos_token_ids and not params.ignore_eos:
        return TokenStop("stop", None, True)
    if token_id in params.stop_token_ids:
        return TokenStop("stop", token_id, True)
    if num_output_tokens >= params.max_tokens:
        return TokenStop("length")
    return None
