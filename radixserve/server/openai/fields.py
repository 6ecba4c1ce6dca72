"""Which request fields the OpenAI and Anthropic routes serve, refuse or ignore: nothing that changes the
output is dropped.

A top-level field of a ``/v1/chat/completions`` or ``/v1/completions`` body is one of:
- **served**: a field of the request Struct (http/protocol.py, openai/protocol.py);
- **ignored**: ``IGNORED``, fields known to have no effect on the output (ids, tags, billing);
- **refused**: ``CHAT_REFUSED`` / ``COMPLETION_REFUSED``, OpenAI and vLLM fields that radixserve does not
  implement. A value that asks for nothing (``null``, or the field's default, e.g. ``echo: false``) is
  accepted; any other is a 400 naming the field (``code: unsupported_parameter``);
- **unknown**: anything else, a 400 naming it (``code: unknown_parameter``), as OpenAI answers: a
  misspelt field would otherwise change the output silently.

``/v1/messages`` (Anthropic's API, anthropic/protocol.py) has the same four kinds, with its own lists:
``MESSAGES_IGNORED`` and ``MESSAGES_REFUSED`` (Anthropic answers an unknown field with a 400 too).

docs/server.md has the tables of every field; tests/server/test_server_api_surface.py and
tests/server/test_anthropic.py check that they match.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from radixserve.errors import InvalidRequestError

# Fields that do not change what is generated; they are accepted and have no effect.
IGNORED: dict[str, str] = {
    "user": "an end-user id for abuse monitoring",
    "safety_identifier": "an end-user id for abuse monitoring",
    "metadata": "tags for OpenAI's stored completions",
    "store": "OpenAI's stored completions",
    "service_tier": "OpenAI's processing tier",
    "prompt_cache_key": "a routing hint for OpenAI's prompt cache; every prefix is cached here",
    "prompt_cache_retention": "how long OpenAI keeps cached prefixes",
    "request_id": "vLLM: an id for the request's logs",
}


@dataclass(frozen=True)
class Refused:
    """A field that is not implemented: ``effect`` says what it would do; ``noop`` values ask for nothing."""

    effect: str
    noop: tuple[Any, ...] = (None,)


_COMMON: dict[str, Refused] = {
    # vLLM extensions
    "use_beam_search": Refused("beam search", (None, False)),
    "length_penalty": Refused("beam search's length penalty", (None, 1, 1.0)),
    "truncate_prompt_tokens": Refused("keeps only the prompt's last k tokens"),
    "prompt_logprobs": Refused("logprobs of the prompt tokens (use /v1/completions with echo and logprobs)"),
    "allowed_token_ids": Refused("restricts sampling to these tokens"),
    "bad_words": Refused("bans words", (None, [])),
    "spaces_between_special_tokens": Refused("spacing of special tokens in the text", (None, True)),
    "logits_processors": Refused("custom logits processors", (None, [])),
    "return_tokens_as_token_ids": Refused("logprob tokens as 'token_id:N'", (None, False)),
    "return_token_ids": Refused("token ids in the response", (None, False)),
    "guided_json": Refused("a JSON schema constraint (use response_format)"),
    "guided_regex": Refused("a regex constraint (use regex)"),
    "guided_choice": Refused("a choice constraint (use choices)"),
    "guided_grammar": Refused("a grammar constraint"),
    "guided_decoding_backend": Refused("the constraint backend"),
    "guided_whitespace_pattern": Refused("whitespace in JSON constraints"),
    "structured_outputs": Refused("a constraint (use response_format, regex or choices)"),
    "kv_transfer_params": Refused("disaggregated prefill"),
    "vllm_xargs": Refused("custom sampling arguments"),
    "mm_processor_kwargs": Refused("multimodal inputs"),
}

CHAT_REFUSED: dict[str, Refused] = {
    **_COMMON,
    "functions": Refused("the deprecated function calling (use tools)"),
    "function_call": Refused("the deprecated function calling (use tool_choice)"),
    "audio": Refused("audio output"),
    "prediction": Refused("predicted outputs"),
    "web_search_options": Refused("web search"),
    "reasoning_effort": Refused("the reasoning effort of OpenAI's reasoning models"),
    "verbosity": Refused("the verbosity of OpenAI's models"),
    "best_of": Refused("the best of several samples", (None, 1)),
    "echo": Refused("echoes the last message (vLLM)", (None, False)),
    "add_special_tokens": Refused("adds the tokenizer's special tokens to the rendered chat", (None, False)),
    "chat_template": Refused("a chat template sent with the request (use --chat-template)"),
    "documents": Refused("documents for RAG chat templates"),
}

COMPLETION_REFUSED: dict[str, Refused] = {
    **_COMMON,
    "suffix": Refused("text that comes after the completion (insertion)", (None, "")),
    "add_special_tokens": Refused("whether the prompt gets the tokenizer's special tokens", (None, True)),
    "prompt_embeds": Refused("prompt embeddings instead of tokens"),
}


# /v1/messages: Anthropic's fields with no effect on the output (ids, routing, billing, diagnostics).
MESSAGES_IGNORED: dict[str, str] = {
    "metadata": "an end-user id for abuse monitoring",
    "service_tier": "Anthropic's capacity tier",
    "inference_geo": "the region Anthropic runs the request in",
    "speed": "Anthropic's fast mode: the tokens are the same",
    "diagnostics": "Anthropic's explanation of prompt-cache misses",
    "user_profile_id": "the party the request is made for",
    "workspace_id": "Anthropic's workspace",
}

MESSAGES_REFUSED: dict[str, Refused] = {
    "thinking": Refused("extended thinking budgets (a --reasoning-parser splits a model's own)", (None,)),
    "container": Refused("code execution containers"),
    "mcp_servers": Refused("MCP servers", (None, [])),
    "context_management": Refused("server-side context editing"),
}


def check_fields(
    fields: Mapping[str, Any],
    served: Iterable[str],
    refused: Mapping[str, Refused],
    ignored: Mapping[str, str] = IGNORED,
) -> None:
    """Raise InvalidRequestError naming the first field that is neither served nor ``ignored``,
    unless it is a refused field whose value asks for nothing."""
    served = set(served)
    for name, value in fields.items():
        if name in served or name in ignored:
            continue
        rule = refused.get(name)
        if rule is None:
            raise InvalidRequestError(f"unknown parameter {name!r}", name, "unknown_parameter")
        if not any(value == ok and type(value) is type(ok) for ok in rule.noop):
            raise InvalidRequestError(
                f"{name!r} is not supported by this server ({rule.effect}); leave it out",
                name,
                "unsupported_parameter",
            )
