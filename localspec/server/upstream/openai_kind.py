"""The ``openai`` kind: /infill and /completion for servers that only speak OpenAI's API (vLLM,
SGLang, Ollama, LM Studio).

localspec lays the FIM prompt out as text (:mod:`.fim_text`, the catalog model's FIM tokens,
local serving's layout), sends ``/v1/completions`` with the raw prompt and ``stream: true``
(:mod:`.openai_request`), applies the editor's stop rules to the stream and closes it once
every choice has stopped (:mod:`.openai_stream`), and answers in llama-server's shape, with
``timings`` measured here (prompt: request to first piece; generation: first piece to last).

The text layout budgets tokens at a conservative characters-per-token rate, yet code that
tokenizes worse (minified, non-Latin) can still pass the upstream's context: vLLM and SGLang
refuse it with a 400 naming the context length. An /infill is then laid out again to the
share of the context the error says fits, once; the editor never sees that 400.
"""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import httpx
import pydantic_core

from localspec.server.errors import ApiError, InvalidRequest, NotSupported
from localspec.server.requests import (
    CompletionRequest,
    GenerationFields,
    InfillRequest,
    parse_body,
    task_params,
)
from localspec.server.results import dumps, sse
from localspec.server.upstream.answer import SSE, Answer, error_answer, json_answer, upstream_error
from localspec.server.upstream.client import UNAVAILABLE, UpstreamFailure, failure, unavailable
from localspec.server.upstream.config import UpstreamSettings
from localspec.server.upstream.fim_text import CHARS_PER_TOKEN, infill_text
from localspec.server.upstream.health import Health
from localspec.server.upstream.openai_request import completion_body
from localspec.server.upstream.openai_stream import Collector

DEFAULT_N_CTX = 8192  # an upstream that does not say its context (Ollama, LM Studio)
# vLLM: "This model's maximum context length is 4096 tokens. However, you requested 4300
# tokens (...)"; SGLang: "... exceeds the model's maximum context length of 4096 tokens. You
# requested a total of 4300 tokens: ..."
_OVERFLOW = re.compile(r"maximum context length|context length exceeded|context window", re.I)
_SIZES = re.compile(
    r"context length (?:is |of )?(\d+) tokens.*?requested (?:a total of )?(\d+)", re.I | re.S
)
SHRINK = 0.75  # of the first layout's size the next takes when the error gives no sizes


class ContextOverflow(Exception):
    """The upstream refused a prompt (with its completion) longer than its context."""

    def __init__(self, raw: bytes) -> None:
        super().__init__(raw.decode("utf-8", "replace"))
        self.raw = raw

    def share(self) -> float:
        """The share of the refused layout's size the next one takes: what the upstream said
        fits over what was asked, with a margin; else ``SHRINK``."""
        sizes = _SIZES.search(str(self))
        if sizes is None or int(sizes.group(2)) <= 0:
            return SHRINK
        return min(SHRINK, 0.9 * int(sizes.group(1)) / int(sizes.group(2)))


@dataclass(frozen=True)
class Limits:
    """The daemon's own rules that apply to a translated request too."""

    n_cmpl_max: int = 16
    spm_infill: bool = False
    infill_room: int = 256
    infill_window: int = 1024  # cache.infill_window, in tokens


async def _events(lines: AsyncIterator[str], url: str) -> AsyncIterator[dict[str, Any] | None]:
    """The ``data:`` objects of a server-sent event stream; None for ``[DONE]``. An event that
    is not a completion chunk fails the answer: skipping it would drop its text unseen."""
    async for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            yield None
            return
        try:
            obj = pydantic_core.from_json(data)
        except ValueError:
            raise UpstreamFailure(
                "error", f"the upstream {url} sent an event that is not JSON: {data[:200]!r}"
            ) from None
        if isinstance(obj, dict) and isinstance(obj.get("error"), dict | str):
            # an error mid-stream (vLLM, SGLang)
            raise UpstreamFailure("error", f"the upstream failed mid-answer: {obj['error']}")
        yield _chunk(obj, url)


async def _whole(raw: bytes, url: str) -> AsyncIterator[dict[str, Any] | None]:
    """A whole (not streamed) completion answer as the one event it amounts to."""
    try:
        obj = pydantic_core.from_json(raw)
    except ValueError:
        raise UpstreamFailure(
            "error", f"the upstream {url} answered no JSON: {raw[:200]!r}"
        ) from None
    if not isinstance(obj, dict) or not obj.get("choices"):
        raise UpstreamFailure("error", f"the upstream {url} answered no choices: {raw[:200]!r}")
    yield _chunk(obj, url)
    yield None


_CHOICE_TYPES = {"index": int, "text": str, "finish_reason": str}


def _chunk(obj: Any, url: str) -> dict[str, Any]:
    """``obj`` if it has the shape of an OpenAI completion chunk (what the collector reads)."""
    choices = obj.get("choices", []) if isinstance(obj, dict) else None
    if isinstance(choices, list) and all(
        isinstance(c, dict)
        and all(
            c.get(k) is None or (isinstance(c[k], t) and not isinstance(c[k], bool))
            for k, t in _CHOICE_TYPES.items()
        )
        for c in choices
    ):
        return obj
    raise UpstreamFailure(
        "error", f"the upstream {url} sent what is not a completion chunk: {str(obj)[:200]}"
    )


async def _usage(collector: Collector, events: AsyncIterator[dict[str, Any] | None]) -> None:
    """The usage report that follows the last choice's end (when the upstream ended every
    choice itself: then the rest of the stream is a few bytes away)."""
    if not collector.upstream_finished:
        return
    try:
        async for obj in events:
            if obj is None:
                return
            collector.feed(obj)
    except (httpx.HTTPError, UpstreamFailure):
        return  # the answer is complete; only the token counts are missing


def _text_only(name: str, value: Any) -> str:
    if isinstance(value, str):
        return value
    if all(isinstance(p, str) for p in value):
        return "".join(value)
    raise InvalidRequest(
        f"{name}: token ids need the model's own tokenizer, and backend.kind = openai sends "
        "text; send text"
    )


class OpenAIBackend:
    def __init__(
        self, cfg: UpstreamSettings, client: httpx.AsyncClient, health: Health, limits: Limits
    ) -> None:
        assert cfg.fim is not None
        self.cfg = cfg
        self.fim = cfg.fim
        self.client = client
        self.health = health
        self.limits = limits

    @property
    def model_name(self) -> str:
        return self.cfg.model or self.health.state.model or "upstream"

    @property
    def n_ctx(self) -> int:
        return self.health.state.n_ctx or DEFAULT_N_CTX

    def _params(self, body: GenerationFields) -> Any:
        if body.n_probs:
            raise NotSupported(
                "n_probs is not available with backend.kind = openai (no token ids or "
                "probabilities come back as llama-server reports them)"
            )
        return task_params(body, n_ctx=self.n_ctx, n_cmpl_max=self.limits.n_cmpl_max)

    async def infill(self, raw: bytes) -> Answer:
        try:
            body = parse_body(InfillRequest, raw)
            params = self._params(body)

            def layout(n_ctx: int) -> str:
                return infill_text(
                    self.fim,
                    input_prefix=_text_only("input_prefix", body.input_prefix),
                    input_suffix=_text_only("input_suffix", body.input_suffix),
                    input_extra=body.input_extra or (),
                    prompt=body.prompt or "",
                    n_ctx=n_ctx,
                    room=self.limits.infill_room,
                    window=self.limits.infill_window,
                    spm=self.limits.spm_infill,
                    ring_only=body.is_ring_warmup,
                )

            prompt = layout(self.n_ctx)
        except ApiError as exc:
            return error_answer(exc)
        # the tokens the upstream was asked for, as the layout counted them (its room included)
        asked = min(self.n_ctx, len(prompt) / CHARS_PER_TOKEN + self.limits.infill_room)
        return await self._run(prompt, params, shorter=lambda share: layout(int(asked * share)))

    async def completion(self, raw: bytes) -> Answer:
        try:
            body = parse_body(CompletionRequest, raw)
            params = self._params(body)
            prompt = _text_only("prompt", body.prompt)
        except ApiError as exc:
            return error_answer(exc)
        return await self._run(prompt, params)

    async def _run(
        self, prompt: str, params: Any, shorter: Callable[[float], str] | None = None
    ) -> Answer:
        """Send the prompt; one too long for the upstream's context goes once more as
        ``shorter`` lays it out, where the request has a layout to shorten (an /infill)."""
        try:
            return await self._send(prompt, params)
        except ContextOverflow as over:
            if shorter is None:
                return upstream_error(400, over.raw, self.cfg)
            share = over.share()
        try:
            return await self._send(shorter(share), params)
        except ContextOverflow as over:
            return upstream_error(400, over.raw, self.cfg)

    async def _send(self, prompt: str, params: Any) -> Answer:
        payload = completion_body(
            prompt=prompt,
            params=params,
            model=self.cfg.model or self.health.state.model,
            end=self.fim.end,
        )
        request = self.client.build_request(
            "POST", "/v1/completions", content=dumps(payload), headers=_HEADERS
        )
        t0 = time.perf_counter()
        try:
            response = await self.client.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise failure(exc, self.cfg.url) from None
        try:
            return await self._answer(response, prompt, params, t0)
        except httpx.HTTPError as exc:
            await response.aclose()
            raise failure(exc, self.cfg.url) from None
        except BaseException:  # a failure, or the editor left: the upstream stops now
            await response.aclose()
            raise

    async def _answer(
        self, response: httpx.Response, prompt: str, params: Any, t0: float
    ) -> Answer:
        if response.status_code in UNAVAILABLE:
            raw = await response.aread()
            raise unavailable(response.status_code, raw, response.headers, self.cfg.url)
        if response.status_code >= 400:
            raw = await response.aread()
            await response.aclose()
            if response.status_code == 400 and _OVERFLOW.search(raw.decode("utf-8", "replace")):
                raise ContextOverflow(raw)
            return upstream_error(response.status_code, raw, self.cfg)
        wants_prompt = not params.response_fields or any(
            f == "prompt" or f.startswith("prompt/") for f in params.response_fields
        )
        shown_prompt = prompt if wants_prompt else ""
        collector = Collector(params, end=self.fim.end, t_sent=t0)
        events = _events(response.aiter_lines(), self.cfg.url)
        if not response.headers.get("content-type", "").startswith("text/event-stream"):
            # a server that ignores stream: true
            events = _whole(await response.aread(), self.cfg.url)
        if not params.stream:
            await self._drain(collector, events)
            await response.aclose()
            finals = collector.finals(model=self.model_name, stream=False, prompt_text=shown_prompt)
            upstream_ms = (time.perf_counter() - t0) * 1e3
            return json_answer(finals[0] if len(finals) == 1 else finals, upstream_ms=upstream_ms)
        first = await self._first(collector, events)
        upstream_ms = (time.perf_counter() - t0) * 1e3
        chunks = self._stream(first, collector, events, response, shown_prompt)
        return Answer(200, SSE, chunks=chunks, close=response.aclose, upstream_ms=upstream_ms)

    async def _drain(
        self, collector: Collector, events: AsyncIterator[dict[str, Any] | None]
    ) -> None:
        async for obj in events:
            if obj is None:
                break
            collector.feed(obj)
            if collector.done:
                await _usage(collector, events)
                return
        else:
            raise UpstreamFailure(
                "closed", f"the upstream {self.cfg.url} ended the stream without [DONE]"
            )
        collector.close()

    async def _first(
        self, collector: Collector, events: AsyncIterator[dict[str, Any] | None]
    ) -> list[tuple[int, str]]:
        """Read until the first text (or the end): the answer is committed from there on."""
        async for obj in events:
            if obj is None:
                return collector.close()
            got = collector.feed(obj)
            if got or collector.done:
                return got
        raise UpstreamFailure(
            "closed", f"the upstream {self.cfg.url} ended the stream without [DONE]"
        )

    async def _stream(
        self,
        first: list[tuple[int, str]],
        collector: Collector,
        events: AsyncIterator[dict[str, Any] | None],
        response: httpx.Response,
        prompt: str,
    ) -> AsyncIterator[bytes]:
        try:
            for index, text in first:
                yield sse(collector.partial(index, text))
            while not collector.done:
                item = await anext(events, _ENDED)
                if item is _ENDED:
                    raise UpstreamFailure(
                        "closed", f"the upstream {self.cfg.url} ended the stream mid-answer"
                    )
                got = collector.close() if item is None else collector.feed(item)
                for index, text in got:
                    yield sse(collector.partial(index, text))
            await _usage(collector, events)
        except httpx.HTTPError as exc:
            raise failure(exc, self.cfg.url) from None
        finally:
            await response.aclose()
        for obj in collector.finals(model=self.model_name, stream=True, prompt_text=prompt):
            yield sse(obj)


_ENDED: Any = object()  # the stream stopped without [DONE]
_HEADERS = {"Content-Type": "application/json", "Accept": "text/event-stream"}
