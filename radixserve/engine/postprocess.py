"""What a sampled token does to its request: ``advance`` runs one request's part of a step's
postprocess in one pass, as ``Engine._postprocess`` calls it for each sampled request. In order: the
grammar advances (and jump-forward appends what it forces), the tokens are appended up to a
token-level stop, their text is made (where a stop string may end the sample at an earlier token),
and the step's ``StepOutput`` is built once, with that text. Only the stepping thread calls these.

One pass, because this runs for every request at every step: the host time of a decode step is
mostly this loop (``benchmarks/step/host_step.py``).
"""

from __future__ import annotations

from radixserve.engine.cache_control import cache_usage
from radixserve.engine.deltas import StepOutput
from radixserve.engine.next_tokens import Picked
from radixserve.engine.request import Request
from radixserve.sampling.grammar import Matcher
from radixserve.sampling.stop import GRAMMAR_COMPLETE, TokenStop, token_stop


def constrain(matcher: Matcher, tokens: list[int], jump_forward: bool) -> list[int]:
    """The sampled ``tokens`` advance the grammar; with jump-forward, the tokens it then forces are
    appended at once (computed next step as one chunk, not one step each)."""
    for t in tokens:
        matcher.accept(t)
    if not jump_forward:
        return tokens
    forced = matcher.forced_tokens()
    for t in forced:
        matcher.accept(t)
    return tokens + forced


def advance(
    req: Request,
    pick: Picked,
    matcher: Matcher | None,
    eos: frozenset[int],
    jump_forward: bool,
    now: float,
) -> tuple[StepOutput, int]:
    """Append ``pick``'s tokens to ``req`` up to the first that ends the sample, make their text, and
    return the step's output and how many tokens were appended before a stop string took any back
    (what speculative decoding settles). A stop string ends the sample at the token that completes
    it: the tokens after that one leave ``req.token_ids``, so the engine never keeps a token past a
    stop string."""
    tokens = pick.tokens if matcher is None else constrain(matcher, pick.tokens, jump_forward)
    first = len(req.token_ids) == req.num_prompt_tokens
    params, ids = req.params, req.token_ids
    stop: TokenStop | None = None
    count = len(tokens)
    for n, t in enumerate(tokens, 1):
        ids.append(t)
        stop = token_stop(params, eos, t, len(ids) - req.num_prompt_tokens)
        if stop is not None:
            count = n
            break
    if stop is None and matcher is not None and matcher.is_terminated():
        stop = GRAMMAR_COMPLETE
    finish: str | None = None
    stop_reason: str | int | None = None
    hidden = False
    if stop is not None:
        finish, stop_reason, hidden = stop
    appended = count
    text: str | None = None
    stream = req.text
    if stream is not None:  # the text, token by token: a stop string may end the sample earlier
        text = ""
        for i in range(count):
            last = i == count - 1
            delta, reason, why = stream.append(tokens[i], stop if last else None)
            text += delta
            if reason is not None:
                if not last:  # a stop string before the last token: the tokens after it go
                    del ids[len(ids) - (count - i - 1) :]
                    count = i + 1
                finish, stop_reason = reason, why
                break
    logprobs = pick.logprobs
    out = StepOutput(
        group_id=req.group_id,
        index=req.index,
        token_ids=tokens if count == len(tokens) else tokens[:count],
        text=text,
        logprobs=None if logprobs[0] is None else logprobs[:count],  # type: ignore[arg-type]
        finish_reason=finish,
        stop_reason=stop_reason,
        cached_tokens=req.pages.num_cached_tokens,
        time=now,
        prompt_logprobs=req.prompt_logprobs if first else None,
        hides_last_token=hidden,
        **cache_usage(req),
    )
    return out, appended
