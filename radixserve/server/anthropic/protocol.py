"""Wire types of ``/v1/messages`` and ``/v1/messages/count_tokens``, Anthropic's Messages API (msgspec
Structs): requests, content blocks, the reply, stream events, the error body.

- Content blocks are tagged by ``type``. The kinds served are ``text``, ``tool_use``, ``tool_result``
  and ``thinking``; the kinds Anthropic has that radixserve cannot render (images, documents, server
  tools' blocks, ...) decode into ``RefusedBlock`` subclasses, so render.py answers each with
  a 400 naming it instead of msgspec's bare "invalid tag".
- ``max_tokens`` is required, as Anthropic requires it; 0 warms the cache with the prompt and
  generates nothing. The sampling ranges are SamplingParams' own (protocol.py's aliases), as on the
  OpenAI routes.
- Nested objects ignore keys they do not know (``citations`` on a text block, ``allowed_callers`` on a
  tool), as the OpenAI routes' do; the top-level keys are checked by the field policy
  (openai/fields.py, ``MESSAGES_REFUSED``).
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

import msgspec
from msgspec import Meta, Struct

from radixserve.server.http.protocol import NonNegInt, Temperature, TopK, TopP, UsagePin
from radixserve.server.openai.protocol import CacheControl


# -- content blocks -------------------------------------------------------------------------------
class _Block(Struct, tag_field="type", kw_only=True):
    pass


class TextBlock(_Block, tag="text", kw_only=True):
    text: str
    cache_control: CacheControl | None = None


class ToolUseBlock(_Block, tag="tool_use", kw_only=True):
    """An assistant's earlier call (its ``input`` reaches the template as the call's arguments)."""

    id: str
    name: str
    input: dict[str, Any] = msgspec.field(default_factory=dict)
    cache_control: CacheControl | None = None


class RefusedBlock(_Block, kw_only=True):
    """A block kind that is not served: ``what`` names it in the 400."""

    what: ClassVar[str] = ""


class ImageBlock(RefusedBlock, tag="image", kw_only=True):
    what = "image input; the served models read text"


class DocumentBlock(RefusedBlock, tag="document", kw_only=True):
    what = "document input: PDFs and citations"


class SearchResultBlock(RefusedBlock, tag="search_result", kw_only=True):
    what = "search results with citations"


class RedactedThinkingBlock(RefusedBlock, tag="redacted_thinking", kw_only=True):
    what = "redacted thinking, which only Anthropic can decrypt"


class ServerToolUseBlock(RefusedBlock, tag="server_tool_use", kw_only=True):
    what = "server tools: web search, code execution"


class WebSearchResultBlock(RefusedBlock, tag="web_search_tool_result", kw_only=True):
    what = "server tools: web search, code execution"


class ContainerUploadBlock(RefusedBlock, tag="container_upload", kw_only=True):
    what = "code execution containers"


Refused = (
    ImageBlock
    | DocumentBlock
    | SearchResultBlock
    | RedactedThinkingBlock
    | ServerToolUseBlock
    | WebSearchResultBlock
    | ContainerUploadBlock
)


class ToolResultBlock(_Block, tag="tool_result", kw_only=True):
    """A tool's result: its text reaches the template as a ``tool`` message answering ``tool_use_id``."""

    tool_use_id: str
    content: str | list[TextBlock | Refused] | None = None
    is_error: bool = False
    cache_control: CacheControl | None = None


class ThinkingBlock(_Block, tag="thinking", kw_only=True):
    """An assistant's earlier reasoning: the message's ``reasoning_content`` for templates that show it."""

    thinking: str
    signature: str = ""


Block = TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | Refused


class Message(Struct, kw_only=True):
    role: Literal["user", "assistant"]
    content: str | list[Block]


# -- tools ----------------------------------------------------------------------------------------
class ToolDefinition(Struct, kw_only=True):
    """A client tool. ``type`` other than ``custom`` is a server tool (``web_search_...``), refused."""

    name: Annotated[str, Meta(min_length=1, max_length=128)]
    input_schema: dict[str, Any] | None = None
    description: str | None = None
    type: str | None = None
    strict: bool | None = None
    cache_control: CacheControl | None = None


class _Choice(Struct, tag_field="type", kw_only=True):
    disable_parallel_tool_use: bool = False


class ToolChoiceAuto(_Choice, tag="auto", kw_only=True):
    pass


class ToolChoiceAny(_Choice, tag="any", kw_only=True):
    pass


class ToolChoiceTool(_Choice, tag="tool", kw_only=True):
    name: str


class ToolChoiceNone(_Choice, tag="none", kw_only=True):
    pass


ToolChoice = ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone


# -- requests -------------------------------------------------------------------------------------
class JsonOutputFormat(Struct, kw_only=True):
    type: Literal["json_schema"]
    schema: dict[str, Any]


class OutputConfig(Struct, kw_only=True):
    """Structured outputs: ``format`` constrains the reply to a JSON schema (a grammar, as
    ``response_format`` does on the OpenAI routes); ``effort`` is not served."""

    format: JsonOutputFormat | None = None
    effort: str | None = None


class CountTokensRequest(Struct, kw_only=True):
    """What makes the prompt: the fields ``/v1/messages/count_tokens`` takes, and the start of a
    ``/v1/messages`` body."""

    model: str
    messages: Annotated[list[Message], Meta(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    cache_control: CacheControl | None = None  # top level: on the last block of the prompt


class MessagesRequest(CountTokensRequest, kw_only=True):
    max_tokens: NonNegInt  # 0: only write the prompt to the cache (Anthropic's pre-warming)
    stop_sequences: list[str] | None = None
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = -1
    stream: bool = False
    output_config: OutputConfig | None = None
    cache_salt: str | None = None  # radixserve's: requests with different salts share no prefix pages


# -- responses ------------------------------------------------------------------------------------
class MessageUsage(Struct, kw_only=True, omit_defaults=True):
    """Anthropic's split of the prompt: ``input_tokens`` were neither read from the cache nor newly
    written to it, so the three sum to the prompt's tokens. ``cached_tokens_by_tier`` (where the read
    tokens were) and ``cache_pin`` are radixserve's, as in the OpenAI routes' usage."""

    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int
    cache_creation_input_tokens: int
    cached_tokens_by_tier: dict[str, int] | None = None
    cache_pin: UsagePin | None = None


class TextOut(Struct, tag_field="type", tag="text"):
    text: str


class ToolUseOut(Struct, tag_field="type", tag="tool_use"):
    id: str
    name: str
    input: Any


class ThinkingOut(Struct, tag_field="type", tag="thinking"):
    thinking: str
    signature: str = ""


ContentOut = TextOut | ToolUseOut | ThinkingOut
StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class MessageResponse(Struct, kw_only=True):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    content: list[ContentOut]
    model: str
    stop_reason: StopReason | None
    stop_sequence: str | None
    usage: MessageUsage


class CountTokensResponse(Struct):
    input_tokens: int


# -- stream events (each sent as ``event: <type>`` + ``data: <json>``) ----------------------------
class MessageStart(Struct, tag_field="type", tag="message_start"):
    message: MessageResponse


class Ping(Struct, tag_field="type", tag="ping"):
    pass


class ContentBlockStart(Struct, tag_field="type", tag="content_block_start"):
    index: int
    content_block: ContentOut


class TextDelta(Struct, tag_field="type", tag="text_delta"):
    text: str


class InputJsonDelta(Struct, tag_field="type", tag="input_json_delta"):
    partial_json: str


class ThinkingDelta(Struct, tag_field="type", tag="thinking_delta"):
    thinking: str


class ContentBlockDelta(Struct, tag_field="type", tag="content_block_delta"):
    index: int
    delta: TextDelta | InputJsonDelta | ThinkingDelta


class ContentBlockStop(Struct, tag_field="type", tag="content_block_stop"):
    index: int


class StopDelta(Struct):
    stop_reason: StopReason | None
    stop_sequence: str | None


class MessageDelta(Struct, tag_field="type", tag="message_delta"):
    delta: StopDelta
    usage: MessageUsage


class MessageStop(Struct, tag_field="type", tag="message_stop"):
    pass


# -- errors ---------------------------------------------------------------------------------------
class ErrorDetail(Struct):
    type: str
    message: str


class ErrorBody(Struct, tag_field="type", tag="error"):
    """``{"type": "error", "error": {"type", "message"}}``: the body of every error on these routes, and
    the data of a stream's ``error`` event."""

    error: ErrorDetail


StreamEvent = (
    MessageStart
    | Ping
    | ContentBlockStart
    | ContentBlockDelta
    | ContentBlockStop
    | MessageDelta
    | MessageStop
    | ErrorBody
)
