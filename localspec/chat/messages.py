"""OpenAI chat ``messages`` and ``tools`` checked and normalised for a template.

The checks and their texts are llama-server's (``oaicompat_chat_params_parse``,
``common_chat_msgs_parse_oaicompat``, ``common_chat_tools_parse_oaicompat``), so a client sees
the message it would see there; where llama-server answers a malformed message with a 500,
this is a 400: the request is at fault, not the server.

Normalised, as llama.cpp hands messages to a template: text content parts joined into one
string, ``null`` content as ``""``, ``developer`` as ``system``, tool-call ``arguments``
as a JSON object where the client sent it as a string (Qwen's templates iterate over them).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

MEDIA_HINT = (
    "input is not supported - hint: if this is unexpected, you may need to provide the mmproj"
)
_MEDIA_PARTS = {"image_url": "image", "input_audio": "audio", "video_url": "video"}


class MessageError(ValueError):
    """A malformed chat request; the text is what the client reads (a 400)."""


def _dump(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _bad(why: str, value: Any) -> MessageError:
    """llama-server's wording for a message it cannot read: the reason and the part, as JSON."""
    return MessageError(f"Failed to parse messages: {why}: {_dump(value)}")


@dataclass(frozen=True)
class ChatInput:
    """A chat request's part that the template renders, checked and normalised."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: str = "auto"  # auto | none | required (a named function counts as required)
    add_generation_prompt: bool = True
    # the last message is the assistant's, to be continued (llama-server's prefill)
    prefill: str | None = None

    @property
    def parse_tool_calls(self) -> bool:
        """llama-server looks for tool calls in the answer only when tools were offered."""
        return bool(self.tools) and self.tool_choice != "none"

    def tool_schemas(self) -> dict[str, dict[str, Any]]:
        """Each offered function's parameter properties, by name (to type parsed arguments)."""
        out: dict[str, dict[str, Any]] = {}
        for tool in self.tools:
            fn = tool.get("function", {})
            params = fn.get("parameters")
            props = params.get("properties") if isinstance(params, Mapping) else None
            out[str(fn.get("name", ""))] = dict(props) if isinstance(props, Mapping) else {}
        return out


def _content_text(content: Any) -> str:
    """A message's content as the template reads it: a string (typed text parts joined)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise MessageError("Expected 'content' to be a string or an array")
    texts: list[str] = []
    for part in content:
        if not isinstance(part, Mapping) or "type" not in part:
            raise _bad("Missing content part type", part)
        kind = part["type"]
        if kind in _MEDIA_PARTS:
            raise MessageError(f"{_MEDIA_PARTS[kind]} {MEDIA_HINT}")
        if kind != "text":
            raise MessageError("unsupported content[].type")
        text = part.get("text")
        if not isinstance(text, str):
            raise _bad("content part without 'text'", part)
        texts.append(text)
    return "\n".join(texts)


def _tool_calls(message: Mapping[str, Any]) -> list[dict[str, Any]]:
    calls = message.get("tool_calls")
    if calls is None:
        return []
    if not isinstance(calls, list):
        raise MessageError(
            f"Failed to parse messages: Expected 'tool_calls' to be an array, got {_dump(calls)}"
        )
    out = []
    for call in calls:
        if not isinstance(call, Mapping) or "type" not in call:
            raise _bad("Missing tool call type", call)
        if call["type"] != "function":
            raise _bad("Unsupported tool call type", call)
        fn = call.get("function")
        if not isinstance(fn, Mapping):
            raise _bad("Missing tool call function", call)
        if not isinstance(fn.get("name"), str):
            raise _bad("Missing tool call name", call)
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:  # OpenAI sends a JSON string; templates iterate over an object
                parsed = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                parsed = args
            args = parsed
        entry: dict[str, Any] = {
            "type": "function",
            "function": {"name": fn["name"], "arguments": args},
        }
        if isinstance(call.get("id"), str):
            entry["id"] = call["id"]
        out.append(entry)
    return out


def _message(raw: Any) -> dict[str, Any]:
    if not isinstance(raw, Mapping):
        raise MessageError(
            f"Failed to parse messages: Expected 'message' to be an object, got {_dump(raw)}"
        )
    role = raw.get("role")
    if role is None:
        raise _bad("Missing 'role' in message", raw)
    if not isinstance(role, str):
        raise MessageError(
            f"Failed to parse messages: Expected 'role' to be a string, got {_dump(role)}"
        )
    if role != "assistant" and "content" not in raw:
        raise MessageError("All non-assistant messages must contain 'content'")
    if role == "assistant" and "content" not in raw and "tool_calls" not in raw:
        raise MessageError("Assistant message must contain either 'content' or 'tool_calls'!")
    msg: dict[str, Any] = {
        "role": "system" if role == "developer" else role,
        "content": _content_text(raw.get("content")),
    }
    calls = _tool_calls(raw)
    if calls:
        msg["tool_calls"] = calls
    for key in ("name", "tool_call_id", "reasoning_content"):
        value = raw.get(key)
        if isinstance(value, str):
            msg[key] = value
    return msg


def _tools(raw: Any) -> list[dict[str, Any]]:
    if raw is None:
        return []

    def fail(why: str) -> MessageError:
        return MessageError(f"Failed to parse tools: {why}; tools = {_dump(raw)}")

    if not isinstance(raw, list):
        raise fail(f"Expected 'tools' to be an array, got {_dump(raw)}")
    out = []
    for tool in raw:
        if not isinstance(tool, Mapping) or "type" not in tool:
            raise fail(f"Missing tool type: {_dump(tool)}")
        if tool["type"] != "function":
            raise fail(f"Unsupported tool type: {_dump(tool)}")
        fn = tool.get("function")
        if not isinstance(fn, Mapping):
            raise fail(f"Missing tool function: {_dump(tool)}")
        if not isinstance(fn.get("name"), str):
            raise fail(f"Missing tool function name: {_dump(tool)}")
        params = fn.get("parameters")
        if not isinstance(params, Mapping) or not params:
            params = {"type": "object", "properties": {}}
        function: dict[str, Any] = {"name": fn["name"]}  # llama.cpp's order
        if isinstance(fn.get("description"), str):
            function["description"] = fn["description"]
        function["parameters"] = dict(params)
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(raw: Any) -> str:
    if raw is None:
        return "auto"
    if isinstance(raw, str) and raw in ("auto", "none", "required"):
        return raw
    if isinstance(raw, Mapping) and raw.get("type") == "function":
        return "required"
    raise MessageError(f"Invalid tool_choice: {_dump(raw)}")


def parse_chat_input(
    messages: Any,
    *,
    tools: Any = None,
    tool_choice: Any = None,
    add_generation_prompt: bool | None = True,
    continue_final_message: Any = None,
) -> ChatInput:
    """The request's messages and tools, checked with llama-server's rules, or a MessageError.

    A last assistant message is continued (llama-server's prefill): the prompt ends with its
    text instead of a new assistant turn.
    """
    if messages is None:
        raise MessageError("'messages' is required")
    if not isinstance(messages, list):
        raise MessageError("Expected 'messages' to be an array")
    if not messages:
        raise MessageError("'messages' must not be empty")
    msgs = [_message(m) for m in messages]
    offered = _tools(tools)
    choice = _tool_choice(tool_choice)
    continuing = continue_final_message is True or continue_final_message == "content"
    gen_prompt = True if add_generation_prompt is None else bool(add_generation_prompt)
    if continuing and gen_prompt:
        raise MessageError(
            "Cannot set both add_generation_prompt and continue_final_message to true."
        )
    prefill = None
    if msgs[-1]["role"] == "assistant":
        if len(msgs) >= 2 and msgs[-2]["role"] == "assistant":
            raise MessageError("Cannot have 2 or more assistant messages at the end of the list.")
        if msgs[-1].get("tool_calls"):
            raise MessageError("Cannot continue an assistant message that contains tool calls.")
        prefill = msgs.pop()["content"]
        gen_prompt = True  # the assistant turn is opened, then its text continues
    elif continuing:
        raise MessageError("continue_final_message: the last message is not the assistant's")
    return ChatInput(
        messages=msgs,
        tools=offered,
        tool_choice=choice,
        add_generation_prompt=gen_prompt,
        prefill=prefill,
    )
