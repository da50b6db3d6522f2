"""The answers, shaped like llama-server's (final, stream partial, OpenAI, /slots), as compact
JSON.

llama.vim matches ``"content"\\s*:"`` on the raw body, so every answer is serialized without
spaces (``separators=(",", ":")``), UTF-8 as is.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pydantic_core
from starlette.responses import Response

from localspec.engine.acceptance import Acceptance
from localspec.engine.slot import Slot
from localspec.engine.stops import incomplete_utf8_tail
from localspec.engine.types import GenerationResult, TokenProbs

Piece = Callable[[int], bytes]  # a token's bytes (the vocabulary's piece)
LOWEST_LOGPROB = -3.4028234663852886e38  # llama-server's log(0): the lowest float, not -inf


def dumps(obj: Any) -> bytes:
    """Compact JSON (no space after ``:`` or ``,``), UTF-8 as is, never NaN or Infinity.

    pydantic-core's serializer (Rust) writes the full answer, 25 KB of prompt text, ≈3x
    faster than ``json.dumps``, with the same bytes but for a small float's exponent
    (``1e-7``, not ``1e-07``: the same number). A non-finite float comes out as the string
    "NaN" or "Infinity" there; then, as for anything it refuses (lone surrogates), the answer
    is ``json.dumps``'s own, which raises on a non-finite float.
    """
    try:
        out: bytes | None = pydantic_core.to_json(obj, inf_nan_mode="strings")
    except pydantic_core.PydanticSerializationError:
        out = None
    if out is not None and b'"NaN"' not in out and b'Infinity"' not in out:
        return out
    text = json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return text.encode("utf-8", "replace")


class CompactJSONResponse(Response):
    media_type = "application/json; charset=utf-8"

    def render(self, content: Any) -> bytes:
        return content if isinstance(content, bytes) else dumps(content)


def sse(obj: Any) -> bytes:
    """One server-sent event line as llama-server writes it."""
    return b"data: " + dumps(obj) + b"\n\n"


def pick_fields(paths: Sequence[str], obj: dict[str, Any]) -> dict[str, Any]:
    """llama-server's response_fields: each path ``a/b`` that exists becomes a flat key."""
    out: dict[str, Any] = {}
    for path in paths:
        current: Any = obj
        for key in path.split("/"):
            if isinstance(current, dict) and key in current:
                current = current[key]
            else:
                break
        else:
            out[path] = current
    return out


def slot_json(slot: Slot, *, speculative: bool) -> dict[str, object]:
    """A slot as llama-server's /slots shows it."""
    return {
        "id": slot.id,
        "n_ctx": slot.n_ctx,
        "speculative": speculative,
        "is_processing": slot.is_processing,
        "n_prompt_tokens": len(slot.tokens),
        "n_prompt_tokens_processed": slot.last_prompt_n,
        "n_prompt_tokens_cache": slot.last_cache_n,
        "n_requests": slot.n_requests,
    }


@dataclass
class FinishedCompletion:
    """One finished completion and what the answer needs besides the engine's result."""

    result: GenerationResult
    index: int
    id_slot: int
    tokens_cached: int
    prompt_text: str = ""
    truncated: bool = False  # the prompt was cut to fit, or generation hit the context end
    # answered from the cursor's nearest lines within t_max_prompt_ms (server/jump.py)
    prompt_budget: dict[str, Any] | None = None


def _per(ms: float, n: int) -> float:
    return ms / n if n > 0 else 0.0


def _rate(ms: float, n: int) -> float:
    return 1e3 / ms * n if ms > 0 else 0.0


def timings(result: GenerationResult, n_predicted: int | None = None) -> dict[str, Any]:
    """llama-server's timings; ``n_predicted`` counts the generated tokens where their ids
    are not known (an upstream's text stream)."""
    prompt_n = result.n_evaluated
    predicted_n = len(result.tokens) if n_predicted is None else n_predicted
    return {
        "cache_n": result.n_cached,
        "prompt_n": prompt_n,
        "prompt_ms": result.prompt_ms,
        "prompt_per_token_ms": _per(result.prompt_ms, prompt_n),
        "prompt_per_second": _rate(result.prompt_ms, prompt_n),
        "predicted_n": predicted_n,
        "predicted_ms": result.predicted_ms,
        "predicted_per_token_ms": _per(result.predicted_ms, predicted_n),
        "predicted_per_second": _rate(result.predicted_ms, predicted_n),
        "draft_n": result.draft_n,
        "draft_n_accepted": result.draft_n_accepted,
        **_by_position(result),
    }


def _by_position(result: GenerationResult) -> dict[str, Any]:
    """Acceptance by position in llama-server's terms: accepted tokens per draft position
    (its ``n_accepted_per_pos``, here from position 1, the last entry for that position and
    beyond) and the drafts verified (its ``n_draft_verif_steps``)."""
    acc = Acceptance.of_steps(result.spec_steps)
    out: dict[str, Any] = {
        "draft_n_verif_steps": acc.drafts,
        "draft_n_accepted_per_pos": acc.accepted_at,
    }
    if result.draft_n_relaxed:  # relaxed acceptance took tokens the target would not have
        out["draft_n_relaxed"] = result.draft_n_relaxed
    return out


def _valid_text(data: bytes) -> str:
    """The bytes as text, without an incomplete UTF-8 sequence at the end (a token may hold
    only the first bytes of a character), as llama-server's ``validate_utf8``."""
    return data[: len(data) - incomplete_utf8_tail(data)].decode("utf-8", errors="replace")


def _candidate(token: int, prob: float, piece: Piece) -> dict[str, Any]:
    data = piece(token)
    return {
        "id": token,
        "token": _valid_text(data),
        "bytes": list(data),
        "logprob": math.log(prob) if prob > 0 else LOWEST_LOGPROB,
    }


def completion_probabilities(
    tokens: Sequence[int], probs: Sequence[TokenProbs], piece: Piece
) -> list[dict[str, Any]]:
    """llama-server's ``completion_probabilities`` (n_probs, before sampling): per generated
    token its id, text, bytes and log-probability, and ``top_logprobs`` likeliest first."""
    return [
        {
            **_candidate(tok, p.prob, piece),
            "top_logprobs": [_candidate(t, q, piece) for t, q in p.top],
        }
        for tok, p in zip(tokens, probs, strict=False)
    ]


def final_object(
    done: FinishedCompletion,
    *,
    model: str,
    settings_json: dict[str, Any],
    stream: bool = False,
    piece: Piece | None = None,
    n_predicted: int | None = None,
) -> dict[str, Any]:
    """llama-server's final completion object (``stop: true``); content is empty when streamed,
    and the token probabilities (n_probs, given ``piece``) went out with the streamed pieces.
    ``n_predicted``: the generated token count where the ids are not known."""
    r = done.result
    n_predicted = len(r.tokens) if n_predicted is None else n_predicted
    probs = (
        {"completion_probabilities": completion_probabilities(r.tokens, r.probs, piece)}
        if r.probs and piece is not None and not stream
        else {}
    )
    return {
        "index": done.index,
        "content": "" if stream else r.text,
        "tokens": [] if stream else list(r.tokens),
        "id_slot": done.id_slot,
        "stop": True,
        "model": model,
        "tokens_predicted": n_predicted,
        "tokens_evaluated": r.n_prompt,
        "generation_settings": settings_json,
        "prompt": done.prompt_text,
        "has_new_line": "\n" in r.text,
        "truncated": done.truncated,
        "stop_type": r.stop_type,
        "stopping_word": r.stopping_word,
        "tokens_cached": done.tokens_cached,
        **({"prompt_budget": done.prompt_budget} if done.prompt_budget else {}),
        **probs,
        "timings": timings(r, n_predicted),
    }


def partial_object(
    *,
    index: int,
    content: str,
    tokens: list[int],
    id_slot: int,
    n_decoded: int,
    n_prompt: int,
    probs: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """One streamed piece (``stop: false``), with its token's probabilities when asked."""
    out = {
        "index": index,
        "content": content,
        "tokens": tokens,
        "stop": False,
        "id_slot": id_slot,
        "tokens_predicted": n_decoded,
        "tokens_evaluated": n_prompt,
    }
    if probs:
        out["completion_probabilities"] = probs
    return out


def finish_reason(result: GenerationResult) -> str:
    return "stop" if result.stop_type in ("eos", "word") else "length"


def openai_id() -> str:
    return "cmpl-" + uuid.uuid4().hex


def usage(done: Sequence[FinishedCompletion]) -> dict[str, Any]:
    """Token counts: the prompt once (every completion shares it), every completion's tokens."""
    n_prompt = done[0].result.n_prompt if done else 0
    n_completion = sum(len(d.result.tokens) for d in done)
    return {
        "completion_tokens": n_completion,
        "prompt_tokens": n_prompt,
        "total_tokens": n_completion + n_prompt,
        "prompt_tokens_details": {"cached_tokens": done[0].result.n_cached if done else 0},
    }


def openai_completion(
    done: Sequence[FinishedCompletion], *, model: str, cmpl_id: str
) -> dict[str, Any]:
    """OpenAI's text_completion object, one choice per completion."""
    return {
        "choices": [
            {
                "text": d.result.text,
                "index": d.index,
                "logprobs": None,
                "finish_reason": finish_reason(d.result),
            }
            for d in done
        ],
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": "localspec",
        "object": "text_completion",
        "usage": usage(done),
        "id": cmpl_id,
        "timings": timings(done[0].result) if done else {},
    }


def openai_chunk(
    *, text: str, index: int, model: str, cmpl_id: str, finish: str | None
) -> dict[str, Any]:
    return {
        "choices": [{"text": text, "index": index, "logprobs": None, "finish_reason": finish}],
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": "localspec",
        "object": "text_completion",
        "id": cmpl_id,
    }


def openai_final_chunk(done: FinishedCompletion, *, model: str, cmpl_id: str) -> dict[str, Any]:
    """A completion's last streamed chunk: its end, usage and timings, as llama-server's
    (an OpenAI client reads the usage from it with or without ``include_usage``)."""
    chunk = openai_chunk(
        text="", index=done.index, model=model, cmpl_id=cmpl_id, finish=finish_reason(done.result)
    )
    return {**chunk, "usage": usage([done]), "timings": timings(done.result)}
