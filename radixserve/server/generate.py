"""``POST /generate``: the native endpoint (SGLang-style), used by the frontend DSL."""

from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator

from starlette.requests import Request
from starlette.responses import Response

from radixserve.outputs import CompletionOutput, RequestOutput, TokenLogprob
from radixserve.server.cache_api.pins import pin_spec
from radixserve.server.http import protocol as p
from radixserve.server.http.api import ApiContext
from radixserve.server.http.responses import DONE, ApiError, EventStream, json_response, usage


async def generate(ctx: ApiContext, request: Request) -> Response:
    req = await ctx.decode(request, p.GenerateRequest)
    if (req.text is None) == (req.input_ids is None):
        raise ApiError(400, "give exactly one of text and input_ids", "text")
    token_ids = ctx.engine.tokenize(req.text) if req.text is not None else list(req.input_ids or [])
    sp = req.sampling_params
    logprobs = req.top_logprobs_num if req.return_logprob else None
    prompt_logprobs = req.top_logprobs_num if req.return_logprob and req.logprob_start_len >= 0 else None
    params = sp.engine_params(logprobs, prompt_logprobs)
    if prompt_logprobs is not None:  # the positions before it are neither computed nor returned
        params.prompt_logprobs_start = req.logprob_start_len
    rid = req.rid or uuid.uuid4().hex
    salt, pin = ctx.salt(request, req.cache_salt), pin_spec(req.cache_pin, "cache_pin")
    first, stream = await ctx.submit(token_ids, params, rid, salt, req.priority, pin, _names(req))
    if req.stream:
        return EventStream(_events(req, rid, first, stream), [stream])
    [res] = await ctx.collect(request, [(first, stream)])
    outs = [_response(req, rid, o, res, res.prompt_logprobs) for o in res.outputs]
    return json_response(outs[0] if sp.n == 1 else outs)


def _names(req: p.GenerateRequest) -> dict[str, str]:
    """The engine's parameters as this request gave them: the sampling ones in ``sampling_params``."""
    sp = req.sampling_params
    given_max = "max_tokens" if sp.max_new_tokens is None and sp.max_tokens is not None else "max_new_tokens"
    return {
        **{name: f"sampling_params.{name}" for name in p.GenerateSamplingParams.__struct_fields__},
        "max_tokens": f"sampling_params.{given_max}",
        "prompt": "text" if req.text is not None else "input_ids",
        "logprobs": "top_logprobs_num",
        "prompt_logprobs": "top_logprobs_num",
        "request_id": "rid",
    }


def _response(
    req: p.GenerateRequest,
    rid: str,
    o: CompletionOutput,
    res: RequestOutput,
    prompt_logprobs: list[TokenLogprob | None] | None,
) -> p.GenerateResponse:
    cache = usage(0, 0, [res])
    meta = p.GenerateMeta(
        id=rid,
        prompt_tokens=len(res.prompt_token_ids),
        completion_tokens=len(o.token_ids),
        cached_tokens=res.cached_tokens,
        finish_reason=o.finish_reason,
        stop_reason=o.stop_reason,
        cached_tokens_by_tier=cache.prompt_tokens_details.cached_tokens_by_tier,
        cache_write_tokens=res.cache_write_tokens,
        cache_pin=cache.cache_pin,
        kv_transfer_tokens=res.kv_transfer_tokens,
    )
    if req.return_logprob:
        lps = o.logprobs or []
        meta.output_token_logprobs = [(lp.logprob, lp.token_id) for lp in lps]
        if req.top_logprobs_num:
            meta.output_top_logprobs = [[(v, t) for t, v in lp.top.items()] for lp in lps]
        if prompt_logprobs is not None:
            start = req.logprob_start_len
            entries = list(zip(prompt_logprobs[start:], res.prompt_token_ids[start:], strict=True))
            meta.input_token_logprobs = [(None if lp is None else lp.logprob, t) for lp, t in entries]
            if req.top_logprobs_num:
                meta.input_top_logprobs = [
                    None if lp is None else [(v, t) for t, v in lp.top.items()] for lp, _ in entries
                ]
    return p.GenerateResponse(o.index, o.text, list(o.token_ids), meta)


async def _events(
    req: p.GenerateRequest, rid: str, first: RequestOutput, stream: AsyncGenerator[RequestOutput, None]
) -> AsyncGenerator[p.GenerateResponse | bytes, None]:
    counts: dict[int, int] = {}
    d: RequestOutput | None = first  # the stream goes on after it
    while d is not None:
        c = d.outputs[0]
        counts[c.index] = counts.get(c.index, 0) + len(c.token_ids)
        piece = _response(req, rid, c, d, d.prompt_logprobs)
        piece.meta_info.completion_tokens = counts[c.index]
        yield piece
        d = await anext(stream, None)
    yield DONE
