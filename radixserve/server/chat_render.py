"""Chat messages (with tools, earlier tool calls and tool results) rendered into a prompt by the model's
chat template: transformers' ``apply_chat_template(messages, tools=..., **chat_template_kwargs)``.

- A message becomes the dict HF templates read: ``role``, ``content`` (text parts joined; "" for
  none), and where given ``name``, ``tool_calls`` (arguments decoded from their JSON text, as
  templates write them with ``tojson``), ``tool_call_id`` and ``reasoning_content``.
- A template that does not mention ``tools`` cannot show the model its tools. Then, as llama.cpp
  does for such templates, the tools are described in the system message in the words of the
  served tool-call format (tools.py), earlier calls are written into the assistant's content in that
  format, and tool results become user messages wrapped in ``<tool_response>`` tags.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from radixserve.server import protocol_chat as c
from radixserve.server.http_util import ApiError
from radixserve.server.tools import ToolCallFormat


def template_source(tokenizer: Any) -> str:
    """The tokenizer's chat template text ("" without one; named templates joined)."""
    template = tokenizer.chat_template
    if isinstance(template, dict):
        return "\n".join(str(t) for t in template.values())
    return template or ""


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


def _without_native_tools(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, fmt: ToolCallFormat
) -> list[dict[str, Any]]:
    """The conversation for a template that knows no tools (module docstring)."""
    out: list[dict[str, Any]] = []
    previous_role = None
    for m in messages:
        m = dict(m)
        calls = m.pop("tool_calls", None)
        m.pop("tool_call_id", None)
        if calls:
            written = fmt.render([tc["function"] for tc in calls])
            m["content"] = f"{m['content']}\n{written}" if m["content"] else written
        role, after_tool = m["role"], previous_role == "tool"
        previous_role = role
        if role == "tool":
            response = f"<tool_response>\n{m['content']}\n</tool_response>"
            if after_tool:  # one user turn for consecutive results
                out[-1]["content"] += "\n" + response
                continue
            m = {"role": "user", "content": response}
        out.append(m)
    if tools:
        instructions = fmt.instructions(tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{instructions}"}
        else:
            out.insert(0, {"role": "system", "content": instructions})
    return out


def render_chat(
    tokenizer: Any,
    messages: Sequence[c.ChatMessage],
    tools: Sequence[c.Tool] | None,
    fmt: ToolCallFormat,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    template_kwargs: dict[str, Any] | None = None,
) -> str:
    """The prompt text of ``messages``; ApiError (400, ``messages``) if the template refuses them."""
    dicts = [message_dict(m) for m in messages]
    tool_dicts = [tool_dict(t) for t in tools] if tools else None
    uses_tools = tool_dicts or any(m.tool_calls or m.role == "tool" for m in messages)
    if uses_tools and "tools" not in template_source(tokenizer):
        dicts, tool_dicts = _without_native_tools(dicts, tool_dicts, fmt), None
    if continue_final_message:
        add_generation_prompt = False
    try:
        text = tokenizer.apply_chat_template(
            dicts,
            tools=tool_dicts,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tokenize=False,
            **(template_kwargs or {}),
        )
    except Exception as exc:  # templates raise whatever jinja raises, e.g. on role order
        raise ApiError(400, f"cannot apply the chat template: {exc}", "messages") from None
    return str(text)
