"""What a sampled token does to its request, one seam a function, in the order ``Engine._postprocess``
calls them: the grammar advances (and jump-forward appends what it forces), the tokens are appended up
to a token-level stop, the step's ``StepOutput`` is made, and its text, where a stop string may end
the sample early. Only ``Engine._postprocess`` (the stepping thread) calls these.
"""

from __future__ import annotations

from radixserve.engine.cache_control import cache_usage
from radixserve.engine.deltas import StepOutput, add_text
from radixserve.engine.next_tokens import Picked
from radixserve.engine.request import Request
from radixserve.sampling.grammar import Matcher
from radixserve.sampling.stop import TokenStop, token_stop


def constrain(matcher: Matcher | None, tokens: list[int], jump_forward: bool) -> list[int]:
    """The sampled ``tokens`` advance the grammar; with jump-forward, the tokens it then forces are
    appended at once (computed next step as one chunk, not one step each)."""
    tokens = list(tokens)
    if matcher is not None:
        for t in tokens:
            matcher.accept(t)
        if jump_forward:
            forced = matcher.forced_tokens()
            for t in forced:
                matcher.accept(t)
            tokens += forced
    return tokens


def append_tokens(req: Request, tokens: list[int], eos: frozenset[int]) -> tuple[list[int], TokenStop | None]:
    """Append tokens up to the first that ends the sample on token-level checks; the appended ones
    and that stop."""
    for n, t in enumerate(tokens, 1):
        req.token_ids.append(t)
        stop = token_stop(req.params, eos, t, req.num_output_tokens)
        if stop is not None:
            return tokens[:n], stop
    return list(tokens), None


def sample_output(
    req: Request, appended: list[int], stop: TokenStop | None, pick: Picked, now: float, first: bool
) -> StepOutput:
    """The step's output of one sample, before its text (``with_text``)."""
    finish, stop_reason, hidden = stop if stop is not None else (None, None, False)
    return StepOutput(
        group_id=req.group_id,
        index=req.index,
        token_ids=appended,
        text=None,
        logprobs=None if pick.logprobs[0] is None else pick.logprobs[: len(appended)],  # type: ignore[arg-type]
        finish_reason=finish,
        stop_reason=stop_reason,
        cached_tokens=req.pages.num_cached_tokens,
        time=now,
        prompt_logprobs=req.prompt_logprobs if first else None,
        hides_last_token=hidden,
        **cache_usage(req),
    )


def with_text(req: Request, out: StepOutput) -> tuple[StepOutput, int]:
    """``out`` with its text, and how many of its tokens a stop string took back: it ends the sample
    at the token that completes it, and the tokens after that one leave ``req.token_ids``, so the
    engine never keeps a token past a stop string."""
    assert req.text is not None
    text_out = add_text(req.text, out)
    cut = len(out.token_ids) - len(text_out.token_ids)
    if cut:
        del req.token_ids[-cut:]
    return text_out, cut
