"""Anthropic's Messages request made the chat request the OpenAI route runs (``c.ChatCompletionRequest``),
so ``/v1/messages`` renders, tokenizes, pins and samples exactly as ``/v1/chat/completions`` does.

- ``system`` (a string or text blocks) is a leading ``system`` message.
- A message's text blocks are its content parts; an assistant's ``tool_use`` blocks are its
  ``tool_calls`` (``input`` as the arguments) and its ``thinking`` blocks its ``reasoning_content``; a
  user's ``tool_result`` blocks are ``tool`` messages answering their ``tool_use_id``, in block order
  (text after them is a user message of its own). A final ``assistant`` message is continued (Anthropic's
  prefill): ``continue_final_message``.
- ``cache_control`` keeps Anthropic's meaning, "the prompt up to and including this block", on the
  project's pins (cache_pins.py): a text block's is its content part's, a ``tool_use`` or
  ``tool_result`` block's its message's. A tool's marks the end of the system prompt, where chat
  templates write the tools (the first message without one); the top-level one the last block. Each is
  checked here, so a 400 names the block as the client sent it.
- ``tools`` are function tools (``input_schema`` the parameters); ``tool_choice`` ``auto``, ``any``
  (OpenAI's ``required``), ``tool`` (a named function) and ``none``, with ``disable_parallel_tool_use``
  as ``parallel_tool_calls: false``. ``output_config.format`` is ``response_format: json_schema``.
- What cannot be rendered (image and document blocks, server tools) is a 400 naming it.
"""

from __future__ import annotations

import json

import msgspec

from radixserve.server.anthropic import protocol as pa
from radixserve.server.cache_api.pins import block_ttl
from radixserve.server.http import protocol as p
from radixserve.server.http.responses import ApiError
from radixserve.server.openai import protocol as c


def _checked(block: c.CacheControl | None, param: str) -> c.CacheControl | None:
    """``block`` once its type and TTL are valid; ``param`` is what carries it ("": the request)."""
    if block is not None:
        block_ttl(block, f"{param}.cache_control" if param else "cache_control")
    return block


def _refuse(block: pa.RefusedBlock, param: str) -> ApiError:
    kind = type(block).__struct_config__.tag
    return ApiError(
        400,
        f"{kind!r} blocks are not supported by this server ({block.what})",
        f"{param}.type",
        "unsupported_content",
    )


def _parts(blocks: list[pa.TextBlock | pa.Refused], param: str) -> list[c.ContentPart]:
    parts = []
    for j, block in enumerate(blocks):
        if isinstance(block, pa.RefusedBlock):
            raise _refuse(block, f"{param}[{j}]")
        parts.append(c.ContentPart("text", block.text, _checked(block.cache_control, f"{param}[{j}]")))
    return parts


def _system(system: str | list[pa.TextBlock] | None) -> list[c.ChatMessage]:
    if system is None:
        return []
    content: str | list[c.ContentPart] = system if isinstance(system, str) else _parts(list(system), "system")
    return [c.ChatMessage(role="system", content=content)]


def _tool_result(block: pa.ToolResultBlock, param: str) -> c.ChatMessage:
    content = block.content
    text: str | list[c.ContentPart] = content if isinstance(content, str) else ""
    if isinstance(content, list):
        text = _parts(content, f"{param}.content")
    return c.ChatMessage(
        role="tool",
        content=text,
        tool_call_id=block.tool_use_id,
        cache_control=_checked(block.cache_control, param),
    )


def _message(m: pa.Message, i: int) -> list[c.ChatMessage]:
    """One Anthropic message as chat messages (several where tool results split it)."""
    if isinstance(m.content, str):
        return [c.ChatMessage(role=m.role, content=m.content)]
    out: list[c.ChatMessage] = []
    parts: list[c.ContentPart] = []
    calls: list[c.ToolCall] = []
    reasoning: list[str] = []
    marked: c.CacheControl | None = None  # a tool_use block's: the message's end

    def flush() -> None:
        nonlocal parts, marked
        if parts or m.role == "assistant":
            out.append(
                c.ChatMessage(
                    role=m.role,
                    content=parts,
                    tool_calls=calls or None,
                    reasoning_content="".join(reasoning) or None,
                    cache_control=marked,
                )
            )
        parts, marked = [], None

    for j, block in enumerate(m.content):
        param = f"messages[{i}].content[{j}]"
        if isinstance(block, pa.RefusedBlock):
            raise _refuse(block, param)
        if isinstance(block, pa.TextBlock):
            parts.append(c.ContentPart("text", block.text, _checked(block.cache_control, param)))
        elif m.role == "user" and isinstance(block, pa.ToolResultBlock):
            if parts:
                flush()
            out.append(_tool_result(block, param))
        elif m.role == "assistant" and isinstance(block, pa.ToolUseBlock):
            arguments = json.dumps(block.input, ensure_ascii=False)
            calls.append(c.ToolCall(id=block.id, function=c.FunctionCall(block.name, arguments)))
            marked = _checked(block.cache_control, param) or marked
        elif m.role == "assistant" and isinstance(block, pa.ThinkingBlock):
            reasoning.append(block.thinking)
        else:
            kind = type(block).__struct_config__.tag
            raise ApiError(400, f"a {m.role} message cannot hold a {kind!r} block", f"{param}.type")
    flush()
    return out


def _tools(tools: list[pa.ToolDefinition] | None) -> list[c.Tool] | None:
    if not tools:
        return None
    out = []
    for k, tool in enumerate(tools):
        if tool.type not in (None, "custom"):
            raise ApiError(
                400,
                f"server tools ({tool.type!r}) are not supported by this server; give client tools "
                "(name, description, input_schema)",
                f"tools[{k}].type",
                "unsupported_tool",
            )
        if tool.input_schema is None:
            raise ApiError(400, "a tool needs its input_schema", f"tools[{k}].input_schema")
        _checked(tool.cache_control, f"tools[{k}]")
        fn = c.FunctionDefinition(
            name=tool.name, description=tool.description, parameters=tool.input_schema, strict=tool.strict
        )
        out.append(c.Tool(function=fn))
    return out


def _tool_choice(choice: pa.ToolChoice | None) -> tuple[c.ToolChoice | None, bool]:
    """OpenAI's tool_choice and parallel_tool_calls for Anthropic's tool_choice."""
    if choice is None:
        return None, True
    parallel = not choice.disable_parallel_tool_use
    if isinstance(choice, pa.ToolChoiceTool):
        return c.NamedToolChoice(function=c.NamedFunction(choice.name)), parallel
    named: dict[type, c.ToolChoice] = {
        pa.ToolChoiceAuto: "auto",
        pa.ToolChoiceAny: "required",
        pa.ToolChoiceNone: "none",
    }
    return named[type(choice)], parallel


def _mark(messages: list[c.ChatMessage], at: int, block: c.CacheControl) -> None:
    messages[at] = msgspec.structs.replace(messages[at], cache_control=block)


def chat_request(req: pa.CountTokensRequest) -> c.ChatCompletionRequest:
    """The chat request of ``req`` (a ``MessagesRequest`` brings its sampling fields too)."""
    messages = _system(req.system)
    for i, m in enumerate(req.messages):
        messages += _message(m, i)
    if any(t.cache_control is not None for t in req.tools or []):
        block = next(t.cache_control for t in req.tools or [] if t.cache_control is not None)
        _mark(messages, 0, block)  # the system message, where templates write the tools; or the first
    if _checked(req.cache_control, "") is not None:
        assert req.cache_control is not None
        _mark(messages, len(messages) - 1, req.cache_control)
    choice, parallel = _tool_choice(req.tool_choice)
    prefill = req.messages[-1].role == "assistant"
    chat = c.ChatCompletionRequest(
        model=req.model,
        messages=messages,
        tools=_tools(req.tools),
        tool_choice=choice,
        parallel_tool_calls=parallel,
        add_generation_prompt=not prefill,
        continue_final_message=prefill,
    )
    if isinstance(req, pa.MessagesRequest):
        chat.max_tokens = req.max_tokens
        chat.stop = req.stop_sequences
        chat.temperature, chat.top_p, chat.top_k = req.temperature, req.top_p, req.top_k
        chat.stream, chat.cache_salt = req.stream, req.cache_salt
        chat.response_format = _format(req.output_config)
    return chat


def _format(config: pa.OutputConfig | None) -> p.ResponseFormat | None:
    if config is None:
        return None
    if config.effort is not None:
        raise ApiError(
            400,
            "output_config.effort is not supported by this server (the effort of Anthropic's models); leave "
            "it out",
            "output_config.effort",
            "unsupported_parameter",
        )
    if config.format is None:
        return None
    return p.ResponseFormat("json_schema", p.JsonSchemaFormat(schema=config.format.schema))
