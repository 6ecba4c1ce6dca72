"""``POST /v1/completions``: prompts in every shape OpenAI accepts, batched; echo, logprobs, scoring.

- ``prompt`` is a string, a list of strings, a list of token ids, or a list of lists of token ids.
  Each prompt is one engine request with ``n`` samples, all submitted at once; choice ``i * n + j``
  is sample j of prompt i, as OpenAI numbers them. Usage sums over the prompts.
- ``max_tokens: 0`` generates nothing: with ``echo`` (and ``logprobs``) it scores the prompt. The engine
  runs the prompt as for one token, whose logits come with the prompt's anyway, and the token is dropped.
- An omitted ``max_tokens`` is 16, as OpenAI's default, or what the context leaves if that is less.
- ``best_of`` is served only where it chooses nothing (``best_of == n``); ``suffix`` is refused.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator, Sequence
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from radixserve.engine.prompt import Prompt
from radixserve.errors import InvalidRequestError
from radixserve.outputs import CompletionOutput, RequestOutput, TokenLogprob
from radixserve.server.cache_api.pins import pin_spec
from radixserve.server.http import protocol as p
from radixserve.server.http.api import ApiContext, Submitted
from radixserve.server.http.responses import DONE, ApiError, EventStream, json_response, merge, usage
from radixserve.server.openai.fields import COMPLETION_REFUSED

DEFAULT_MAX_TOKENS = 16  # OpenAI's


def parse_prompts(prompt: str | list[Any]) -> list[Prompt]:
    """The prompts of a request: InvalidRequestError (naming the bad item) unless one of OpenAI's shapes."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise InvalidRequestError("prompt is empty", "prompt")
    if all(isinstance(x, str) for x in prompt):
        return list(prompt)
    if all(isinstance(x, list) for x in prompt):
        return [_token_ids(ids, f"prompt[{i}]") for i, ids in enumerate(prompt)]
    return [_token_ids(prompt, "prompt")]


def _token_ids(ids: list[Any], param: str) -> list[int]:
    for i, t in enumerate(ids):
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t <= p.INT64_MAX:
            raise InvalidRequestError(
                f"{param}[{i}] is {t!r}: a prompt is a string, a list of strings, a list of token ids "
                "(integers >= 0) or a list of lists of token ids",
                param,
            )
    if not ids:
        raise InvalidRequestError("prompt is empty", param)
    return ids


async def completions(ctx: ApiContext, request: Request) -> Response:
    req = await ctx.decode_checked(request, p.CompletionRequest, COMPLETION_REFUSED)
    ctx.check_model(req.model)
    if req.best_of is not None and req.best_of != req.n:
        raise ApiError(
            400,
            f"best_of ({req.best_of}) must equal n ({req.n}): choosing the best of several "
            "samples is not supported",
            "best_of",
            "unsupported_parameter",
        )
    try:
        given = parse_prompts(req.prompt)
    except ValueError as exc:
        raise ApiError.invalid(exc) from None
    prompts = [ctx.engine.tokenize(prompt) for prompt in given]
    score_only = req.max_tokens == 0
    params = []
    for ids in prompts:
        max_tokens = ctx.max_tokens(
            len(ids), 1 if score_only else req.max_tokens, DEFAULT_MAX_TOKENS, "prompt"
        )
        prompt_logprobs = req.logprobs if req.echo and req.logprobs is not None else None
        params.append(ctx.sampling(req, max_tokens, req.logprobs, prompt_logprobs))
    rid = f"cmpl-{uuid.uuid4().hex}"
    salt = ctx.salt(request, req.cache_salt)
    pin = pin_spec(req.cache_pin, "cache_pin")
    submitted = await ctx.submit_all(prompts, params, rid, salt, req.priority, pin)
    texts = [
        prompt if isinstance(prompt, str) else str(ctx.tokenizer.decode(ids))
        for prompt, ids in zip(given, prompts)
    ]
    choices = _Choices(ctx, req, texts, score_only)
    if req.stream:
        return EventStream(choices.events(rid, submitted), [stream for _, stream in submitted])
    results = await ctx.collect(request, submitted)
    out = [choices.choice(i, o, res) for i, res in enumerate(results) for o in res.outputs]
    completion_tokens = 0 if score_only else sum(len(o.token_ids) for r in results for o in r.outputs)
    usage_ = usage(sum(map(len, prompts)), completion_tokens, results)
    return json_response(
        p.CompletionResponse(
            id=rid, created=int(time.time()), model=ctx.model_name, choices=out, usage=usage_
        )
    )


class _Choices:
    """Builds the choices of one request, whole or streamed, in OpenAI's numbering."""

    def __init__(
        self, ctx: ApiContext, req: p.CompletionRequest, prompt_texts: list[str], score_only: bool
    ) -> None:
        self.ctx, self.req, self.prompt_texts, self.score_only = ctx, req, prompt_texts, score_only

    def choice(
        self, i: int, o: CompletionOutput, res: RequestOutput, with_prompt: bool = True
    ) -> p.CompletionChoice:
        """Sample ``o`` of prompt ``i`` (or a streamed piece of it); the echoed prompt first when
        ``with_prompt``."""
        req = self.req
        text, token_ids, lps = o.text, list(o.token_ids), list(o.logprobs or [])
        finish, stop_reason = o.finish_reason, o.stop_reason
        if self.score_only:  # the one token the engine made is not part of the answer
            text, token_ids, lps = "", [], []
            finish, stop_reason = ("length" if finish is not None else None), None
        logprobs = None
        if req.echo and with_prompt:
            text = self.prompt_texts[i] + text
        if req.logprobs is not None:
            lp_list: list[TokenLogprob | None] = list(lps)
            if req.echo and with_prompt:
                lp_list = list(res.prompt_logprobs or [None] * len(res.prompt_token_ids)) + lp_list
                token_ids = list(res.prompt_token_ids) + token_ids
            logprobs = self.ctx.tokens.completion_logprobs(lp_list, token_ids, 0)
        return p.CompletionChoice(i * req.n + o.index, text, logprobs, finish, stop_reason)

    async def events(
        self, rid: str, submitted: Sequence[Submitted]
    ) -> AsyncGenerator[p.CompletionResponse | bytes, None]:
        req, created = self.req, int(time.time())
        options = req.stream_options
        include_usage = options is not None and options.include_usage
        continuous = options is not None and options.continuous_usage_stats
        prompt_tokens = sum(len(first.prompt_token_ids) for first, _ in submitted)
        latest = [first for first, _ in submitted]  # each prompt's, for its cached tokens
        echoed: set[tuple[int, int]] = set()
        completion_tokens = 0

        def chunk(choices: list[p.CompletionChoice], usage_: p.Usage | None = None) -> p.CompletionResponse:
            model = self.ctx.model_name
            return p.CompletionResponse(id=rid, created=created, model=model, choices=choices, usage=usage_)

        async for i, d in merge(submitted):
            c = d.outputs[0]
            latest[i] = d
            completion_tokens += 0 if self.score_only else len(c.token_ids)
            echo_now = (i, c.index) not in echoed
            echoed.add((i, c.index))
            if c.text or c.token_ids or c.finish_reason is not None or (req.echo and echo_now):
                res = d if d.prompt_logprobs is not None else submitted[i][0]
                running = usage(prompt_tokens, completion_tokens, latest) if continuous else None
                yield chunk([self.choice(i, c, res, with_prompt=echo_now)], running)
        if include_usage:
            yield chunk([], usage(prompt_tokens, completion_tokens, latest))
        yield DONE
