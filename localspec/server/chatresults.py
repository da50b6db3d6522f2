"""Chat answers in llama-server's shapes: ``chat.completion`` and ``chat.completion.chunk``.

Field order, ``usage``, ``timings`` and the stream's framing follow llama-server's
``server_task_result_cmpl_final::to_json_oaicompat_chat[_stream]``: the first chunk of a
completion carries ``{"role":"assistant","content":null}``, then one chunk per content or
tool-call delta, then a chunk with the ``finish_reason`` and an empty delta; with
``stream_options.include_usage`` one more chunk with no choices and the usage; ``timings`` on
the last chunk; then ``data: [DONE]``.
"""

from __future__ import annotations

import secrets
import string
import time
from collections.abc import Sequence
from typing import Any

from localspec.chat import ChatMessage, ToolCall
from localspec.engine.types import GenerationResult
from localspec.server.results import (
    FinishedCompletion,
    Piece,
    completion_probabilities,
    timings,
    usage,
)

FINGERPRINT = "localspec"
_ID_CHARS = string.ascii_letters + string.digits


def chat_id() -> str:
    """llama-server's form: ``chatcmpl-`` and 32 random letters and digits."""
    return "chatcmpl-" + "".join(secrets.choice(_ID_CHARS) for _ in range(32))


def finish_reason(result: GenerationResult, message: ChatMessage) -> str:
    if result.stop_type in ("eos", "word"):
        return "tool_calls" if message.tool_calls else "stop"
    return "length"


def _logprobs(result: GenerationResult, piece: Piece) -> dict[str, Any]:
    return {"content": completion_probabilities(result.tokens, result.probs, piece)}


def chat_completion(
    done: Sequence[FinishedCompletion],
    messages: Sequence[ChatMessage],
    *,
    model: str,
    cmpl_id: str,
    piece: Piece,
) -> dict[str, Any]:
    """The non-streamed answer: one choice per completion."""
    choices = []
    for d, message in zip(done, messages, strict=True):
        choice: dict[str, Any] = {
            "finish_reason": finish_reason(d.result, message),
            "index": d.index,
            "message": message.to_json(),
        }
        if d.result.probs:
            choice["logprobs"] = _logprobs(d.result, piece)
        choices.append(choice)
    return {
        "choices": choices,
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": FINGERPRINT,
        "object": "chat.completion",
        "usage": usage(done),
        "id": cmpl_id,
        "timings": timings(done[0].result) if done else {},
    }


def chunk(
    *,
    cmpl_id: str,
    model: str,
    index: int,
    delta: dict[str, Any],
    finish: str | None = None,
    logprobs: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """One ``chat.completion.chunk`` event."""
    choice: dict[str, Any] = {"finish_reason": finish, "index": index, "delta": delta}
    if logprobs:
        choice["logprobs"] = {"content": logprobs}
    return {
        "choices": [choice],
        "created": int(time.time()),
        "id": cmpl_id,
        "model": model,
        "system_fingerprint": FINGERPRINT,
        "object": "chat.completion.chunk",
    }


ROLE_DELTA: dict[str, Any] = {"role": "assistant", "content": None}


def deltas(content: str, calls: Sequence[tuple[int, ToolCall]]) -> list[dict[str, Any]]:
    """The deltas for newly parsed text and calls: content first, then each call whole."""
    out: list[dict[str, Any]] = []
    if content:
        out.append({"content": content})
    for index, call in calls:
        out.append(
            {
                "tool_calls": [
                    {
                        "index": index,
                        "id": call.id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments},
                    }
                ]
            }
        )
    return out


def usage_chunk(done: Sequence[FinishedCompletion], *, cmpl_id: str, model: str) -> dict[str, Any]:
    """The last chunk with ``stream_options.include_usage``: no choices, the usage."""
    return {
        "choices": [],
        "created": int(time.time()),
        "id": cmpl_id,
        "model": model,
        "system_fingerprint": FINGERPRINT,
        "object": "chat.completion.chunk",
        "usage": usage(done),
    }
