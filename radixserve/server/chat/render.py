"""OpenAI's chat messages and tools (server/openai/protocol.py) made the dicts HF templates read, and
rendered by the one chat renderer (``render_openai_chat``: radixserve/chat_template.py's ``render_chat``,
which the offline ``Engine.chat`` uses too).

- A message becomes ``role``, ``content`` (text parts joined; "" for none), and where given ``name``,
  ``tool_calls`` (arguments decoded from their JSON text, as templates write them with ``tojson``),
  ``tool_call_id`` and ``reasoning_content``.
- For a template that knows no tools, the served tool-call format (tools.py) writes the tools and
  earlier calls into the messages (chat_template.py says how).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from radixserve import chat_template
from radixserve.server.chat.tools import ToolCallFormat
from radixserve.server.http.responses import ApiError
from radixserve.server.openai import protocol as c


def content_text(content: str | list[c.ContentPart] | None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.text for part in content)


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def message_dict(m: c.ChatMessage) -> dict[str, Any]:
    d: dict[str, Any] = {"role": m.role, "content": content_text(m.content)}
    if m.name is not None:
        d["name"] = m.name
    if m.tool_calls:
        d["tool_calls"] = [
            {
                "id": tc.id,
                "type": "function",
                "function": {"name": tc.function.name, "arguments": _arguments(tc.function.arguments)},
            }
            for tc in m.tool_calls
        ]
    if m.tool_call_id is not None:
        d["tool_call_id"] = m.tool_call_id
    if m.reasoning_content is not None:
        d["reasoning_content"] = m.reasoning_content
    return d


def tool_dict(tool: c.Tool) -> dict[str, Any]:
    fn = tool.function
    function: dict[str, Any] = {"name": fn.name}
    if fn.description is not None:
        function["description"] = fn.description
    function["parameters"] = (
        fn.parameters if fn.parameters is not None else {"type": "object", "properties": {}}
    )
    if fn.strict is not None:
        function["strict"] = fn.strict
    return {"type": "function", "function": function}


def render_openai_chat(
    tokenizer: Any,
    messages: Sequence[c.ChatMessage],
    tools: Sequence[c.Tool] | None,
    fmt: ToolCallFormat,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    template_kwargs: dict[str, Any] | None = None,
) -> str:
    """The prompt text of ``messages``, by the one renderer (chat_template.py); ApiError (400,
    ``messages``) if the template refuses them."""
    dicts = [message_dict(m) for m in messages]
    tool_dicts = [tool_dict(t) for t in tools] if tools else None
    try:
        return chat_template.render_chat(
            tokenizer, dicts, tool_dicts, fmt, add_generation_prompt, continue_final_message, template_kwargs
        )
    except chat_template.ChatTemplateError as exc:
        raise ApiError(400, str(exc), "messages") from None
