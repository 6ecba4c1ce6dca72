"""Where programs run: a remote server (``RuntimeEndpoint``, over POST /generate) or a ``LocalEngine``.

Invariants:
- A backend is called from many threads at once (one per program state): every method is thread-safe,
  and concurrent calls are what lets the server batch the branches of a fork.
- Prompts travel as text; the server's radix cache deduplicates the shared prefixes, so resending a
  prefix costs a cache lookup, not a prefill.
- Role segments are rendered client-side by ``ChatTemplate`` from the model's Jinja chat template
  (the local engine's tokenizer, or ``GET /get_model_info`` of the server when it offers one,
  else ChatML), so both backends send the same text for the same program.
- Every failure surfaces as ``BackendError`` carrying the server's message; the interpreter adds the step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import httpx

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_SENTINEL = "\x00RADIXSERVE-CONTENT\x00"


class BackendError(RuntimeError):
    """The backend could not do what a step asked (unreachable server, rejected request, ...)."""


@dataclass
class Completion:
    text: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    finish_reason: str | None


class ChatTemplate:
    """Renders chat messages to text with a Jinja chat template (as transformers does)."""

    def __init__(self, source: str | None = None, bos_token: str = "", eos_token: str = "") -> None:
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise jinja2.TemplateError(message)

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.globals["raise_exception"] = raise_exception
        self.source = source or CHATML
        self._template = env.from_string(self.source)
        self._specials = {"bos_token": bos_token, "eos_token": eos_token}

    def render(self, messages: Sequence[dict[str, str]], open_role: str | None = None) -> str:
        """The text of ``messages``; with ``open_role``, followed by the opening of a message of that
        role, up to where its content starts (so content can be appended as it is generated)."""
        if open_role is None:
            return self._template.render(
                messages=list(messages), add_generation_prompt=False, **self._specials
            )
        full = self._template.render(
            messages=[*messages, {"role": open_role, "content": _SENTINEL}],
            add_generation_prompt=False,
            **self._specials,
        )
        return full[: full.index(_SENTINEL)]


class Backend(ABC):
    """What the interpreter needs from a model: generate, score a prompt, render chat messages."""

    @property
    @abstractmethod
    def chat_template(self) -> ChatTemplate: ...

    @abstractmethod
    def generate(
        self, prompt: str, sampling_params: dict[str, Any], on_text: Callable[[str], None] | None = None
    ) -> Completion:
        """Generate from ``prompt`` (``sampling_params`` as in POST /generate); ``on_text`` gets each
        delta."""

    @abstractmethod
    def prompt_logprobs(self, prompt: str) -> list[tuple[int, float | None]]:
        """(token id, logprob) of every prompt token; the first has no logprob (None)."""

    def cache_prefix(self, prompt: str) -> None:
        """Compute ``prompt`` once so that concurrent requests sharing it find it in the radix cache."""
        self.generate(prompt, {"max_new_tokens": 1, "temperature": 0.0})

    def score(self, prompt: str, choices: Sequence[str]) -> list[list[float]]:
        """The logprobs of the tokens of each choice appended to ``prompt``.

        The choice's tokens are those after the longest common prefix with the prompt's own tokens, so a
        token that merges across the boundary is scored as part of the choice. The prompt is scored
        first, alone: its pages then hold its KV and its logprobs, so each choice, sent after it (all
        at once), computes only its own tokens (and the rest of the prompt's last, partly filled page).
        """
        base = [t for t, _ in self.prompt_logprobs(prompt)]
        with concurrent.futures.ThreadPoolExecutor(len(choices)) as pool:
            scored = list(pool.map(self.prompt_logprobs, [prompt + c for c in choices]))
        out = []
        for choice, entries in zip(choices, scored, strict=True):
            k = 0
            while k < min(len(base), len(entries)) and base[k] == entries[k][0]:
                k += 1
            lps = [lp for _, lp in entries[k:] if lp is not None]
            if not lps:
                raise BackendError(f"choice {choice!r} adds no tokens to the prompt")
            out.append(lps)
        return out

    def close(self) -> None:  # noqa: B027 (optional hook: most backends hold nothing)
        """Release connections or threads (the backend is unusable afterwards)."""


class RuntimeEndpoint(Backend):
    """A radixserve server (``radixserve serve``), over its native POST /generate."""

    def __init__(
        self, url: str, api_key: str | None = None, chat_template: str | None = None, timeout: float = 600.0
    ) -> None:
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)
        self._template_source = chat_template

    @cached_property
    def chat_template(self) -> ChatTemplate:
        if self._template_source is not None:
            return ChatTemplate(self._template_source)
        try:
            r = self._client.get("/get_model_info")
        except httpx.HTTPError as exc:
            raise BackendError(f"cannot reach {self.url}: {exc}") from None
        info = r.json() if r.status_code == 200 else {}
        return ChatTemplate(
            info.get("chat_template"), info.get("bos_token") or "", info.get("eos_token") or ""
        )

    def generate(
        self, prompt: str, sampling_params: dict[str, Any], on_text: Callable[[str], None] | None = None
    ) -> Completion:
        body = {"text": prompt, "sampling_params": sampling_params, "stream": on_text is not None}
        if on_text is None:
            return _completion(self._post(body))
        text, last = "", None
        try:
            with self._client.stream("POST", "/generate", json=body) as r:
                if r.status_code != 200:
                    r.read()
                    raise BackendError(_http_error(r))
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        raise BackendError(f"the server failed mid-stream: {event['error'].get('message')}")
                    if event["text"]:
                        on_text(event["text"])
                    text += event["text"]
                    last = event
        except httpx.HTTPError as exc:
            raise BackendError(f"cannot reach {self.url}: {exc}") from None
        if last is None:
            raise BackendError("the server sent no output")
        done = _completion(last)
        done.text = text
        return done

    def prompt_logprobs(self, prompt: str) -> list[tuple[int, float | None]]:
        res = self._post(
            {
                "text": prompt,
                "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
                "return_logprob": True,
                "logprob_start_len": 0,
            }
        )
        return [(int(t), lp) for lp, t in res["meta_info"]["input_token_logprobs"]]

    def close(self) -> None:
        self._client.close()

    def _post(self, body: dict[str, Any]) -> dict[str, Any]:
        try:
            r = self._client.post("/generate", json=body)
        except httpx.HTTPError as exc:
            raise BackendError(f"cannot reach {self.url}: {exc}") from None
        if r.status_code != 200:
            raise BackendError(_http_error(r))
        return r.json()


def _http_error(r: httpx.Response) -> str:
    try:
        message = r.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = r.text[:500]
    return f"the server answered {r.status_code}: {message}"


def _completion(res: dict[str, Any]) -> Completion:
    meta = res["meta_info"]
    return Completion(
        res["text"],
        meta["prompt_tokens"],
        meta["cached_tokens"],
        meta["completion_tokens"],
        meta.get("finish_reason"),
    )


class LocalEngine(Backend):
    """A local engine with no HTTP server: an ``AsyncEngine`` and the engine process it starts, driven
    from a background event loop so concurrent calls share batches. Sampling params go through the
    same conversion as POST /generate's (``GenerateSamplingParams``), so both backends accept the same.

    ``model`` is a model folder (None: the embedded default); ``options`` are the engine's options
    (page_size, num_pages, ...).
    """

    def __init__(self, model: str | None = None, **options: Any) -> None:
        from radixserve.config import EngineConfig
        from radixserve.runtime.async_engine import AsyncEngine

        self.engine = AsyncEngine(EngineConfig.from_kwargs(model=model, **options))
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rf-engine-loop", daemon=True)
        self._thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self.engine.start(), self._loop).result()
        except BaseException:
            self._stop_loop()
            raise
        tok = self.engine.model.tokenizer
        self._template = ChatTemplate(
            getattr(tok, "chat_template", None), tok.bos_token or "", tok.eos_token or ""
        )

    @property
    def chat_template(self) -> ChatTemplate:
        return self._template

    def generate(
        self, prompt: str, sampling_params: dict[str, Any], on_text: Callable[[str], None] | None = None
    ) -> Completion:
        import msgspec

        from radixserve.server import GenerateSamplingParams

        try:
            params = msgspec.convert(sampling_params, GenerateSamplingParams).engine_params()
        except msgspec.ValidationError as exc:
            raise BackendError(f"the engine rejected the request: {exc}") from None
        return self._call(self._generate(prompt, params, on_text))

    def prompt_logprobs(self, prompt: str) -> list[tuple[int, float | None]]:
        from radixserve.sampling.params import SamplingParams

        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
        done = self._call(self._run(prompt, params, None))
        lps = done.prompt_logprobs or []
        return [
            (t, None if lp is None else lp.logprob) for t, lp in zip(done.prompt_token_ids, lps, strict=True)
        ]

    def close(self) -> None:
        if self._loop.is_running():
            asyncio.run_coroutine_threadsafe(self.engine.shutdown(5.0), self._loop).result()
            self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()

    # -- internals ----------------------------------------------------------------------------------
    def _call(self, coro: Any) -> Any:
        try:
            return asyncio.run_coroutine_threadsafe(coro, self._loop).result()
        except ValueError as exc:
            raise BackendError(f"the engine rejected the request: {exc}") from None
        except RuntimeError as exc:
            raise BackendError(str(exc)) from None

    async def _generate(self, prompt: str, params: Any, on_text: Callable[[str], None] | None) -> Completion:
        done = await self._run(prompt, params, on_text)
        out = done.outputs[0]
        return Completion(
            out.text, len(done.prompt_token_ids), done.cached_tokens, len(out.token_ids), out.finish_reason
        )

    async def _run(self, prompt: str, params: Any, on_text: Callable[[str], None] | None) -> Any:
        """Run one request to its end (``on_text`` gets each piece of text); its whole RequestOutput."""
        stream = self.engine.generate(prompt, params)
        async for delta in stream:
            if on_text is not None and delta.outputs[0].text:
                on_text(delta.outputs[0].text)
        return stream.result
