"""Wire types of ``/v1/chat/completions`` (msgspec Structs): messages, tools, replies, stream chunks.

The shared sampling fields and the invariants of all wire types are in protocol.py. A reply's
``content`` is always present (null when the reply is only tool calls), as OpenAI sends it;
``tool_calls`` and ``reasoning_content`` appear only when there are some.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import Meta, Struct

from radixserve.server.http.protocol import MaxTokens, SamplingFields, TopLogprobs, Usage


# -- requests -------------------------------------------------------------------------------------
class CacheControl(Struct, kw_only=True):
    """Anthropic's ``cache_control`` block: pin the prompt up to and including what carries it
    (cache_pins.py). ``type`` must be "ephemeral"; ``ttl`` is "5m", "1h" or seconds (default 5m)."""

    type: str
    ttl: str | float | None = None


class ContentPart(Struct):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None


class FunctionCall(Struct):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(Struct, kw_only=True):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Struct, kw_only=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None  # passed to the chat template
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool result: the call it answers
    reasoning_content: str | None = None  # an assistant's earlier reasoning, for templates that show it
    cache_control: CacheControl | None = None  # pin the prompt up to the end of this message


class FunctionDefinition(Struct, kw_only=True):
    name: Annotated[str, Meta(min_length=1, max_length=64)]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no arguments
    strict: bool | None = None


class Tool(Struct, kw_only=True):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(Struct):
    name: str


class NamedToolChoice(Struct, kw_only=True):
    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None  # None: "auto" with tools, "none" without
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # e.g. {"enable_thinking": false}
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the reply continues the last (assistant) message
    modalities: list[Literal["text"]] | None = None


class TokenizeRequest(Struct, kw_only=True):
    """vLLM's two shapes in one: ``prompt`` (completions), or ``messages`` rendered by the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


# -- responses ------------------------------------------------------------------------------------
class TopLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Struct):
    content: list[ChatTokenLogprob]


class ChatResponseMessage(Struct, omit_defaults=True):
    role: str
    content: str | None  # no default: always sent, null when the reply is only tool calls
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(Struct):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: str | int | None = None


class ChatCompletionResponse(Struct, kw_only=True):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaFunction(Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(Struct, omit_defaults=True):
    """A piece of a streamed tool call: the first has ``id``, ``type`` and the name, the rest arguments."""

    index: int
    id: str | None = None
    type: str | None = None
    function: DeltaFunction | None = None


class DeltaMessage(Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(Struct):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatCompletionChunk(Struct, kw_only=True):
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
