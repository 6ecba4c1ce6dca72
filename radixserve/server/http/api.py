"""ApiContext: what every route shares: body decoding, the served model, submitting and collecting requests.

Invariants:
- A request is submitted to the engine only after its body decoded and validated against the
  protocol types (and, on the OpenAI routes, the field policy of openai/fields.py); the engine
  checks the rest and refuses with InvalidRequestError, answered as a 400 with its param (the route's
  name for it, where the two differ: ``submit``'s ``names``) and code.
- Every 400 names its ``param``: a body that fails decoding names the field's path as msgspec's error
  gives it (``invalid_field``, the one place that reads it); only a body that is not an object has none.
- A batch (several prompts) is submitted at once; if any prompt is refused, the others are aborted
  and the whole request is answered with that refusal.
- A client that disconnects while a non-streaming request runs aborts every request it started.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import msgspec
from starlette.requests import Request

from radixserve.cache.pins.types import PinSpec
from radixserve.chat_template import template_source
from radixserve.outputs import RequestOutput, TokenLogprob
from radixserve.runtime.backend import (
    EngineFailedError,
    EngineUnavailableError,
    QueueFullError,
    RequestStream,
    ServingBackend,
)
from radixserve.sampling.grammar import strict_schema
from radixserve.sampling.params import SamplingParams
from radixserve.server.chat.reasoning import REASONING_PARSERS
from radixserve.server.chat.tools import TOOL_CALL_PARSERS, choose_format
from radixserve.server.http import protocol as p
from radixserve.server.http.responses import ApiError
from radixserve.server.openai import protocol as c
from radixserve.server.openai.fields import IGNORED, Refused, check_fields

S = TypeVar("S")
Submitted = tuple[RequestOutput, RequestStream]  # the first delta, and the whole stream (it starts with it)


class TokenText:
    """Decodes single tokens for logprob listings, memoised (the vocabulary is fixed)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self._tok.decode([token_id])
        return text

    def chat_logprobs(self, lps: list[TokenLogprob] | None) -> c.ChatLogprobs | None:
        if lps is None:
            return None
        content = []
        for lp in lps:
            tok = self(lp.token_id)
            top = [c.TopLogprob(self(t), v, list(self(t).encode())) for t, v in lp.top.items()]
            content.append(c.ChatTokenLogprob(tok, lp.logprob, list(tok.encode()), top))
        return c.ChatLogprobs(content)

    def completion_logprobs(
        self, lps: Sequence[TokenLogprob | None], token_ids: Sequence[int], offset: int
    ) -> p.CompletionLogprobs:
        """OpenAI's legacy layout; a None entry (the first prompt token) has no logprob."""
        out = p.CompletionLogprobs([], [], [], [])
        for lp, tid in zip(lps, token_ids, strict=True):
            tok = self(tid)
            out.tokens.append(tok)
            out.token_logprobs.append(None if lp is None else lp.logprob)
            out.top_logprobs.append(None if lp is None else {self(t): v for t, v in lp.top.items()})
            out.text_offset.append(offset)
            offset += len(tok)
        return out


class ApiContext:
    """``tool_call_parser`` (tools.py) and ``reasoning_parser`` (reasoning.py; None: off) shape chat
    replies."""

    def __init__(
        self,
        engine: ServingBackend,
        model_name: str,
        salt_per_key: bool,
        max_body_bytes: int,
        tool_call_parser: str = "auto",
        reasoning_parser: str | None = None,
    ) -> None:
        if tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {TOOL_CALL_PARSERS}, got {tool_call_parser!r}")
        if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {REASONING_PARSERS}, got {reasoning_parser!r}")
        self.engine = engine
        self.model_name = model_name
        self.salt_per_key = salt_per_key
        self.max_body_bytes = max_body_bytes
        self.tokenizer = engine.model.tokenizer
        self.tokens = TokenText(self.tokenizer)
        self.tool_format = choose_format(tool_call_parser, template_source(self.tokenizer))
        self.reasoning = reasoning_parser is not None

    # -- bodies -----------------------------------------------------------------------------------
    async def body(self, request: Request) -> bytes:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise ApiError(413, f"request body exceeds the limit of {self.max_body_bytes} bytes")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > self.max_body_bytes:
                raise ApiError(413, f"request body exceeds the limit of {self.max_body_bytes} bytes")
        return bytes(body)

    async def decode(self, request: Request, type_: type[S], optional: bool = False) -> S:
        """The body as ``type_``; ``optional``: an empty body is ``type_()`` (every field left out)."""
        body = await self.body(request)
        if optional and not body.strip():
            return type_()
        return _decode(body, type_)

    async def decode_checked(
        self,
        request: Request,
        type_: type[S],
        refused: Mapping[str, Refused],
        ignored: Mapping[str, str] = IGNORED,
    ) -> S:
        """``decode``, after checking the body's top-level fields against the field policy (the
        OpenAI routes', or with ``refused`` and ``ignored`` another API's: server/openai/fields.py)."""
        body = await self.body(request)
        # The body is parsed once, to plain objects: its keys are checked against the policy, then the
        # same objects are converted to ``type_`` (no second scan of the bytes).
        try:
            fields = msgspec.json.decode(body)
        except msgspec.DecodeError as exc:
            raise ApiError(400, f"invalid JSON body: {exc}") from None
        if not isinstance(fields, dict):
            raise ApiError(400, "the request body must be a JSON object")
        try:
            check_fields(fields, type_.__struct_fields__, refused, ignored)  # type: ignore[attr-defined]
        except ValueError as exc:
            raise ApiError.invalid(exc) from None
        try:
            return msgspec.convert(fields, type_, strict=False)
        except msgspec.ValidationError as exc:
            raise ApiError(400, str(exc), *invalid_field(str(exc))) from None

    def check_model(self, model: str | None) -> None:
        """A model other than the served one is a 404 ``model_not_found``, as OpenAI and vLLM answer."""
        if model is not None and model != self.model_name:
            raise ApiError(
                404,
                f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                "model",
                "model_not_found",
            )

    def salt(self, request: Request, salt: str | None) -> str | None:
        key = request.scope.get("radixserve.api_key")
        if not (self.salt_per_key and key):
            return salt
        tenant = "key:" + hashlib.sha256(key.encode()).hexdigest()[:16]
        return tenant if salt is None else f"{tenant}/{salt}"

    def max_tokens(self, prompt_tokens: int, requested: int | None, default: int | None, param: str) -> int:
        """``requested``, or when it is omitted ``default`` (None: no limit) clamped to what the context
        leaves; the engine process guarantees that one ``max_model_len`` request fits in its KV pool."""
        if requested is not None:
            return requested
        max_model_len = self.engine.limits().max_model_len
        room = max_model_len - prompt_tokens
        if room <= 0:
            raise ApiError(
                400,
                f"the prompt ({prompt_tokens} tokens) leaves no room for output within the maximum "
                f"context length of {max_model_len} tokens",
                param,
                "context_length_exceeded",
            )
        return room if default is None else min(default, room)

    @staticmethod
    def sampling(
        req: p.SamplingFields, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None
    ) -> SamplingParams:
        fmt = req.response_format
        if fmt is not None and fmt.type != "text" and (req.regex is not None or req.choices is not None):
            raise ApiError(400, "response_format cannot be combined with regex or choices", "response_format")
        json_schema: str | dict | None = None
        if fmt is not None and fmt.type == "json_object":
            json_schema = {"type": "object"}
        elif fmt is not None and fmt.type == "json_schema":
            json_schema = (fmt.json_schema.schema if fmt.json_schema else None) or {"type": "object"}
            if fmt.json_schema is not None and fmt.json_schema.strict:
                json_schema = strict_schema(json_schema)  # llguidance would otherwise allow extra keys
        return SamplingParams.pick(
            req,
            max_tokens=max_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            json_schema=json_schema,
        )

    # -- running requests -------------------------------------------------------------------------
    async def submit(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        rid: str,
        salt: str | None,
        priority: int | str,
        pin: PinSpec | None = None,
        names: Mapping[str, str] | None = None,
    ) -> Submitted:
        """Start a request (the route tokenized its prompt, once); returns its first delta and its
        stream, whose iteration yields that delta first (``RequestStream.first``). A pin over the
        budget is a 429 (PinBudgetError), any other refusal a 400 naming the route's field for the
        engine's parameter (``names``, where they differ)."""
        stream = self.engine.generate(prompt_token_ids, params, rid, salt, priority, pin)
        try:
            first = await stream.first()
        except ValueError as exc:
            raise ApiError.invalid(exc, names) from None
        except QueueFullError as exc:
            raise ApiError(429, f"server busy: {exc}", headers={"Retry-After": "1"}) from None
        except EngineUnavailableError as exc:
            raise ApiError(503, str(exc)) from None
        except EngineFailedError as exc:
            raise ApiError(500, str(exc)) from None
        return first, stream

    async def submit_all(
        self,
        prompts: Sequence[list[int]],
        params: Sequence[SamplingParams],
        rid: str,
        salt: str | None,
        priority: int | str,
        pin: PinSpec | None = None,
    ) -> list[Submitted]:
        """Start one request per prompt, all at once; if one is refused, abort the rest and raise."""
        if len(prompts) == 1:
            return [await self.submit(prompts[0], params[0], rid, salt, priority, pin)]
        results = await asyncio.gather(
            *(
                self.submit(prompt, sp, f"{rid}-{i}", salt, priority, pin)
                for i, (prompt, sp) in enumerate(zip(prompts, params, strict=True))
            ),
            return_exceptions=True,
        )
        started = [r for r in results if not isinstance(r, BaseException)]
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            for _, stream in started:
                await stream.aclose()
            raise errors[0]
        return started

    async def collect(self, request: Request, submitted: Sequence[Submitted]) -> list[RequestOutput]:
        """Run requests to their end, aborting them all if the client goes away meanwhile; returns each
        one's whole output (its stream's ``result``: the deltas as the engine's assembler folded them)."""

        async def drain(first: RequestOutput, stream: RequestStream) -> RequestOutput:
            async for _ in stream:
                pass
            return stream.result

        async def disconnected() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        work = [asyncio.ensure_future(drain(first, stream)) for first, stream in submitted]
        watch = asyncio.ensure_future(disconnected())
        try:
            pending: set[asyncio.Future[Any]] = set(work)
            while pending and not watch.done():
                done, pending = await asyncio.wait(pending | {watch}, return_when=asyncio.FIRST_COMPLETED)
                pending.discard(watch)
                for task in done:
                    if task is not watch and task.exception() is not None:
                        raise task.exception()  # type: ignore[misc]
        finally:
            watch.cancel()
            for task in work:
                task.cancel()
            await asyncio.gather(*work, return_exceptions=True)
            for _, stream in submitted:
                await stream.aclose()
        if not all(task.done() and not task.cancelled() for task in work):
            raise ApiError(400, "client disconnected")
        return [task.result() for task in work]


# msgspec's ValidationError names where the value failed as a path (`$.messages[0].role`; a dict's value
# `$.logit_bias[...]`, its key "`key` in `$.logit_bias`"), and an unknown or missing field by name
# beside the path of the object that holds it (no path: the body itself).
_PATH = re.compile(r"`\$\.?([^`]*)`")
_FIELD = re.compile(r"^Object (contains unknown|missing required) field `([^`]*)`")
_FIELD_CODES = {"contains unknown": "unknown_parameter", "missing required": "missing_required_parameter"}


def invalid_field(message: str) -> tuple[str | None, str | None]:
    """The ``param`` (the field's path, as ``messages[0].role``) and ``code`` of a body that failed
    validation with msgspec's ``message``; param None only where the body as a whole is wrong."""
    path = _PATH.search(message)
    param = path.group(1) if path else ""
    field = _FIELD.match(message)
    if field is None:
        return param or None, None
    return f"{param}.{field.group(2)}" if param else field.group(2), _FIELD_CODES[field.group(1)]


def _decode(body: bytes, type_: type[S]) -> S:
    try:
        return msgspec.json.decode(body, type=type_, strict=False)  # lax like pydantic: 2.0 and "2" are ints
    except msgspec.ValidationError as exc:
        raise ApiError(400, str(exc), *invalid_field(str(exc))) from None
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"invalid JSON body: {exc}") from None
