"""Tool calls in the model's own format, as OpenAI ``tool_calls``: whole answers and streams.

Two formats, chosen from the template source as llama.cpp chooses (``common/chat.cpp``):

- ``hermes`` (Qwen2.5 and Qwen2.5-Coder Instruct): ``<tool_call>\\n{"name": ..., "arguments":
  {...}}\\n</tool_call>``;
- ``qwen3-coder`` (Qwen3-Coder, also Qwen3.5, Nemotron Nano 3): ``<tool_call>\\n<function=NAME>
  \\n<parameter=P>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>``, values typed by the
  tool's JSON schema.

The answer's ``content`` is its text outside the call blocks, whitespace next to a block
dropped; a block that does not parse stays text. ``StreamParser`` emits the same content and
calls as ``parse_message`` of the whole text, piece by piece: text that might begin a block
(``<tool_`` at the end) and trailing whitespace wait until the next piece tells, and a call goes
out once its block is closed.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

START = "<tool_call>"
END = "</tool_call>"
_ID_CHARS = string.ascii_letters + string.digits

ToolCallFormat = Literal["hermes", "qwen3-coder"]


def tool_call_format(template_source: str) -> ToolCallFormat | None:
    """The format a template teaches its model (None: it knows no tool calls)."""
    if START not in template_source:
        return None
    if "<function=" in template_source and "<parameter=" in template_source:
        return "qwen3-coder"
    return "hermes"


def new_call_id() -> str:
    """A random id for a call the model wrote without one (llama-server's form: 32 chars)."""
    return "".join(secrets.choice(_ID_CHARS) for _ in range(32))


def _compact(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text (OpenAI's form)
    id: str = field(default_factory=new_call_id)

    def to_json(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
            "id": self.id,
        }


@dataclass
class ChatMessage:
    """The assistant's answer: its text and the calls it made."""

    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [c.to_json() for c in self.tool_calls]
        return out


Schemas = Mapping[str, Mapping[str, Any]]  # function name -> its parameters' properties


def _hermes_call(body: str, _schemas: Schemas) -> ToolCall | None:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some fine-tunes write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], _compact(args))


_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|\Z)", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|\Z)", re.DOTALL)


def _typed(value: str, schema: Mapping[str, Any] | None) -> Any:
    """A parameter's text as its schema's type (strings stay text; the rest parsed as JSON
    when it is JSON, as llama.cpp's Qwen3-Coder parser does)."""
    kind = schema.get("type") if schema else None
    if kind == "string" or (isinstance(kind, list) and kind[:1] == ["string"]):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


def _qwen3_coder_call(body: str, schemas: Schemas) -> ToolCall | None:
    match = _FUNCTION.search(body)
    if match is None or body[: match.start()].strip():
        return None
    name = match.group(1).strip()
    props = schemas.get(name, {})
    args: dict[str, Any] = {}
    for param in _PARAMETER.finditer(match.group(2)):
        value = param.group(2)
        # the template writes "<parameter=p>\n" value "\n</parameter>": one newline each side
        value = value[1:] if value.startswith("\n") else value
        value = value[:-1] if value.endswith("\n") else value
        key = param.group(1).strip()
        schema = props.get(key)
        args[key] = _typed(value, schema if isinstance(schema, Mapping) else None)
    return ToolCall(name, _compact(args))


_PARSERS = {"hermes": _hermes_call, "qwen3-coder": _qwen3_coder_call}


@dataclass
class _Split:
    """Text cut into runs of text around parsed calls (run k comes before call k)."""

    runs: list[str]
    calls: list[ToolCall]
    end: int  # text consumed: all of it, or up to what may still become a block
    last_call_end: int = 0  # where the last call's block ends (0: no call)


def _split(text: str, fmt: ToolCallFormat, schemas: Schemas, *, final: bool) -> _Split:
    parse = _PARSERS[fmt]
    out = _Split([""], [], 0)
    pos = 0
    while True:
        i = text.find(START, pos)
        if i < 0:
            tail = text[pos:]
            keep = 0 if final else _partial_start(tail)
            out.runs[-1] += tail[: len(tail) - keep]
            out.end = len(text) - keep
            return out
        j = text.find(END, i + len(START))
        if j < 0 and not final:  # a block still being written
            out.runs[-1] += text[pos:i]
            out.end = i
            return out
        body_end = j if j >= 0 else len(text)
        block_end = j + len(END) if j >= 0 else len(text)
        call = parse(text[i + len(START) : body_end], schemas)
        if call is None:  # not a call after all: text
            out.runs[-1] += text[pos:block_end]
        else:
            out.runs[-1] += text[pos:i]
            out.calls.append(call)
            out.runs.append("")
            out.last_call_end = block_end
        pos = block_end


def _partial_start(tail: str) -> int:
    """Length of the longest end of ``tail`` that is a proper start of ``<tool_call>``."""
    for n in range(min(len(tail), len(START) - 1), 0, -1):
        if tail.endswith(START[:n]):
            return n
    return 0


def _trimmed(runs: list[str], *, after_call: bool) -> list[str]:
    """Each run with the whitespace next to a call dropped (run k is followed by call k)."""
    last = len(runs) - 1
    return [
        (run.lstrip() if k > 0 or after_call else run).rstrip()
        if k < last
        else (run.lstrip() if k > 0 or after_call else run)
        for k, run in enumerate(runs)
    ]


def parse_message(
    text: str, fmt: ToolCallFormat | None, schemas: Schemas | None = None
) -> ChatMessage:
    """The whole answer as content and tool calls (``fmt`` None: all of it is content)."""
    if fmt is None:
        return ChatMessage(text)
    split = _split(text, fmt, schemas or {}, final=True)
    return ChatMessage("".join(_trimmed(split.runs, after_call=False)), split.calls)


@dataclass
class StreamDelta:
    content: str = ""
    tool_calls: list[tuple[int, ToolCall]] = field(default_factory=list)  # (index, call)

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)


class StreamParser:
    """Feed the answer's pieces; each feed returns what may go out now. The pieces' deltas,
    joined, are ``parse_message`` of the whole text (tested on every cut of the text)."""

    def __init__(self, fmt: ToolCallFormat | None, schemas: Schemas | None = None) -> None:
        self.fmt = fmt
        self.schemas: Schemas = schemas or {}
        self.text = ""
        self.sent = ""  # content emitted so far
        self.calls: list[ToolCall] = []
        # text before ``base`` is settled: it ended with a call (so its content and calls
        # are final); only text from here on is split again
        self._base = 0
        self._base_content = ""

    def feed(self, piece: str) -> StreamDelta:
        self.text += piece
        if self.fmt is None:
            self.sent += piece
            return StreamDelta(piece)
        return self._advance(final=False)

    def finish(self) -> StreamDelta:
        """Everything held back, now that the answer is complete."""
        if self.fmt is None:
            return StreamDelta()
        return self._advance(final=True)

    def message(self) -> ChatMessage:
        return ChatMessage(self.sent, list(self.calls))

    def _advance(self, *, final: bool) -> StreamDelta:
        assert self.fmt is not None
        split = _split(self.text[self._base :], self.fmt, self.schemas, final=final)
        runs = _trimmed(split.runs, after_call=self._base > 0)
        content = self._base_content + "".join(runs)
        if not final:
            # the last run may yet be followed by a call, which drops its trailing whitespace
            last = runs[-1]
            content = content[: len(content) - (len(last) - len(last.rstrip()))]
        delta = StreamDelta()
        if len(content) > len(self.sent):
            delta.content = content[len(self.sent) :]
            self.sent = content
        for call in split.calls:
            delta.tool_calls.append((len(self.calls), call))
            self.calls.append(call)
        if split.calls:  # text up to the last call's block is settled: never split again
            self._base_content += "".join(runs[: len(split.calls)])
            self._base += split.last_call_end
        return delta
