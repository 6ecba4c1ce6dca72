"""The one chat renderer: a conversation (HF message dicts, with tools, earlier tool calls and tool
results) made prompt text by the model's chat template, transformers'
``apply_chat_template(messages, tools=..., **template_kwargs)``. The offline ``Engine.chat``
(engine/prompt.py) and the API server's chat routes (server/chat/render.py, which turns OpenAI's
message types into these dicts) both render through ``render_chat``, so a conversation is the same
prompt on either path.

- A template that does not mention ``tools`` cannot show the model its tools. Then, as llama.cpp
  does for such templates, the tools are described in the system message in the words of the
  served tool-call format (``ToolWriter``: server/chat/tools.py), earlier calls are written into the
  assistant's content in that format, and tool results become user messages wrapped in
  ``<tool_response>`` tags. Without a ``ToolWriter`` (offline) the messages go to the template as
  they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol


class ChatTemplateError(ValueError):
    """The template refused the conversation (templates raise whatever jinja raises, e.g. on role
    order); the API server answers it with a 400 on ``messages``."""


class ToolWriter(Protocol):
    """What rendering asks of a tool-call format (server/chat/tools.py's ``ToolCallFormat``)."""

    def instructions(self, tools: list[dict[str, Any]]) -> str: ...

    def render(self, calls: list[dict[str, Any]]) -> str: ...


def template_source(tokenizer: Any) -> str:
    """The tokenizer's chat template text ("" without one; named templates joined)."""
    template = tokenizer.chat_template
    if isinstance(template, dict):
        return "\n".join(str(t) for t in template.values())
    return template or ""


def render_chat(
    tokenizer: Any,
    messages: Sequence[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    writer: ToolWriter | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    template_kwargs: dict[str, Any] | None = None,
) -> str:
    """The prompt text of ``messages`` (HF dicts: ``role``, ``content``, and where given ``name``,
    ``tool_calls``, ``tool_call_id``, ``reasoning_content``); ChatTemplateError if the template refuses."""
    dicts = list(messages)
    uses_tools = tools or any(m.get("tool_calls") or m["role"] == "tool" for m in dicts)
    if uses_tools and writer is not None and "tools" not in template_source(tokenizer):
        dicts, tools = _without_native_tools(dicts, tools, writer), None
    if continue_final_message:
        add_generation_prompt = False
    try:
        text = tokenizer.apply_chat_template(
            dicts,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tokenize=False,
            **(template_kwargs or {}),
        )
    except Exception as exc:  # templates raise whatever jinja raises
        raise ChatTemplateError(f"cannot apply the chat template: {exc}") from None
    return str(text)


def _without_native_tools(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, writer: ToolWriter
) -> list[dict[str, Any]]:
    """The conversation for a template that knows no tools (module docstring)."""
    out: list[dict[str, Any]] = []
    previous_role = None
    for m in messages:
        m = dict(m)
        calls = m.pop("tool_calls", None)
        m.pop("tool_call_id", None)
        if calls:
            written = writer.render([tc["function"] for tc in calls])
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
        instructions = writer.instructions(tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{instructions}"}
        else:
            out.insert(0, {"role": "system", "content": instructions})
    return out
