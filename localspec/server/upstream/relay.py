"""The ``llama-server`` kind: every editor route is forwarded to an upstream llama-server (or
another localspec) as it came, streamed answers passed on chunk by chunk.

Two changes to a generation request's body: ``id_slot`` becomes this workstation's stable slot
(:mod:`.identity`), so its cache survives the other developers' traffic (a chat request's
becomes -1, the server's choice: a chat in that slot would evict the editor's ring of files),
and ``model`` becomes ``backend.model`` when set (a llama-server in router mode picks its
model by it), else the editor's own name is dropped (the server answers with its default
model). The editor's own ``Authorization`` never leaves the machine; the upstream gets
localspec's key.
"""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator
from typing import Any, NamedTuple

import httpx
import pydantic_core

from localspec.server.results import dumps
from localspec.server.upstream.answer import SSE, Answer, is_llama_error, upstream_error
from localspec.server.upstream.client import UNAVAILABLE, UpstreamFailure, failure, unavailable
from localspec.server.upstream.config import UpstreamSettings
from localspec.server.upstream.identity import stable_slot

# routes whose body is a generation request
GENERATION = frozenset(
    {"/infill", "/completion", "/completions", "/v1/completions", "/v1/chat/completions",
     "/chat/completions"}
)  # fmt: skip
# chat: kept off the stable slot (the editor's ring of files lives there), the server picks one
CHAT = frozenset({"/v1/chat/completions", "/chat/completions"})


def pinned_slot(cfg: UpstreamSettings, n_slots: int | None, identity: str) -> int:
    """The slot a generation request asks for: ``backend.slot`` if set, else the stable hash
    over the upstream's slots; -1 (any) while its slot count is not known."""
    if cfg.slot is not None:
        return cfg.slot
    return stable_slot(n_slots, identity) if n_slots else -1


class Prepared(NamedTuple):
    content: bytes
    stream: bool
    n_choices: int = 1  # completions asked for (n_cmpl, or n): each ends its own stream part


def prepare(
    raw: bytes, *, slot: int | None, model: str | None, replace_model: bool = False
) -> Prepared:
    """The body to send, with ``id_slot`` (unless None) and ``model`` (when given) set, whether
    it asks for a stream and for how many completions (one parse for all). ``replace_model``
    (a generation request): the editor's own ``model`` is dropped when no ``model`` replaces
    it, since the upstream would refuse a name it does not serve, or pick another model by it.
    A body that is not a JSON object goes as it is (the failover refuses a generation
    request's with the local route's 400 before it gets here)."""
    try:
        body = pydantic_core.from_json(raw) if raw else None
    except ValueError:
        return Prepared(raw, False)
    if not isinstance(body, dict):
        return Prepared(raw, False)
    stream = bool(body.get("stream"))
    n = body.get("n_cmpl", body.get("n"))
    n_choices = n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else 1
    drop = replace_model and not model and "model" in body
    if slot is None and not model and not drop:
        return Prepared(raw, stream, n_choices)
    if slot is not None:
        body["id_slot"] = slot
    if model:
        body["model"] = model
    elif drop:
        del body["model"]
    return Prepared(dumps(body), stream, n_choices)


async def open_upstream(
    client: httpx.AsyncClient,
    cfg: UpstreamSettings,
    method: str,
    path: str,
    query: str,
    content: bytes | None,
    *,
    stream: bool,
    n_choices: int = 1,
) -> Answer:
    """Send one request and return the committed answer (see :class:`Answer`); a failure
    before that is an UpstreamFailure. Cancelling this closes the upstream request."""
    headers = {"Accept": "text/event-stream" if stream else "application/json"}
    if stream:  # a compressing proxy in front of the team server would hold events back
        headers["Accept-Encoding"] = "identity"
    if content is not None:
        headers["Content-Type"] = "application/json"
    request = client.build_request(
        method, path, content=content, params=query or None, headers=headers
    )
    t0 = time.perf_counter()
    try:
        response = await client.send(request, stream=True)
    except httpx.HTTPError as exc:
        raise failure(exc, cfg.url) from None
    try:
        return await _commit(
            response,
            cfg,
            stream=stream,
            generation=path in GENERATION,
            n_choices=n_choices,
            t0=t0,
        )
    except BaseException:  # a failure, or the editor left (cancelled): end it upstream now
        await response.aclose()
        raise


async def _commit(
    response: httpx.Response,
    cfg: UpstreamSettings,
    *,
    stream: bool,
    generation: bool,
    n_choices: int,
    t0: float,
) -> Answer:
    """The answer once it is sure to be one. A generation route's 200 must be JSON or an event
    stream that has begun: a login page of a proxy, or a stream closed before its first
    event, is a failure the local model can still answer."""
    status = response.status_code
    content_type = response.headers.get("content-type", "application/json").encode("latin-1")
    timing = response.headers.get("server-timing", "")
    try:
        if status in UNAVAILABLE:
            raw = await response.aread()
            raise unavailable(status, raw, response.headers, cfg.url)
        if status >= 400:
            raw = await response.aread()
            await response.aclose()
            if status not in (401, 403) and is_llama_error(raw):
                return Answer(status, content_type, raw, upstream_ms=_ms(t0))
            return upstream_error(status, raw, cfg)
        if not stream or not content_type.startswith(SSE):
            raw = await response.aread()
            await response.aclose()
            if generation and not _is_json(raw):
                raise UpstreamFailure(
                    "error",
                    f"the upstream {cfg.url} answered HTTP {status} with no JSON "
                    f"({content_type.decode('latin-1')}: {raw[:200]!r})",
                )
            return Answer(status, content_type, raw, upstream_ms=_ms(t0), upstream_timing=timing)
        chunks = response.aiter_bytes()  # decoded, should a proxy compress it anyway
        first = await anext(chunks, b"")
        if not first:
            raise UpstreamFailure(
                "closed", f"the upstream {cfg.url} ended its stream before the first event"
            )
    except httpx.HTTPError as exc:
        raise failure(exc, cfg.url) from None
    return Answer(
        status,
        content_type,
        chunks=_prepend(first, chunks, cfg, generation=generation, n_choices=n_choices),
        close=response.aclose,
        upstream_ms=_ms(t0),
    )


def _is_json(raw: bytes) -> bool:
    try:
        return isinstance(pydantic_core.from_json(raw), dict | list)
    except ValueError:
        return False


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1e3


async def _prepend(
    first: bytes,
    rest: AsyncIterator[bytes],
    cfg: UpstreamSettings,
    *,
    generation: bool,
    n_choices: int = 1,
) -> AsyncIterator[bytes]:
    """The stream as it came. A generation stream must end with its last event (with
    ``n_choices`` > 1: a final event for every choice): one closed before it (a server or
    proxy speaking HTTP/1.0, whose answer ends where the connection does) would otherwise
    reach the editor as a whole, shorter answer."""
    last = _LastEvent(n_choices)
    last.feed(first)
    yield first
    try:
        async for chunk in rest:
            last.feed(chunk)
            yield chunk
    except httpx.HTTPError as exc:
        raise failure(exc, cfg.url) from None
    if generation and not last.ends_a_stream():
        raise UpstreamFailure(
            "closed", f"the upstream {cfg.url} closed its stream before the last event"
        )


# what a finished llama-server (or localspec) stream's last event holds: ``"stop": true``
# (/completion, /infill), ``[DONE]`` (the OpenAI routes) or an error
_LAST_EVENT = re.compile(
    rb'(?<!\\)"stop"\s*:\s*true|^data: \[DONE\]|^error:|(?<!\\)"error"\s*:', re.M
)
_STOP = re.compile(rb'(?<!\\)"stop"\s*:\s*true')  # a choice's final event (llama-server)
_EVENT_END = re.compile(rb"\r?\n\r?\n")


class _LastEvent:
    """The last whole server-sent event of a stream and what follows it (one event's bytes
    at most are kept, however long the stream), and which choices' final events went by
    (``n_choices`` > 1: llama-server sends one per choice, each with its ``index``)."""

    def __init__(self, n_choices: int = 1) -> None:
        self.event = b""
        self.pending = b""
        self.n_choices = n_choices
        self.ended: set[int] = set()  # choices whose final event went by (n_choices > 1)

    def feed(self, chunk: bytes) -> None:
        data = self.pending + chunk
        end = max(data.rfind(b"\n\n"), data.rfind(b"\r\n\r\n"))
        if end < 0:
            self.pending = data
            return
        head = data[:end]
        if self.n_choices > 1 and _STOP.search(head):
            self._finals(head)
        start = max(head.rfind(b"\n\n"), head.rfind(b"\r\n\r\n"))
        self.event = head[start + 1 :] if start >= 0 else head
        self.pending = data[end:].lstrip(b"\r\n")

    def _finals(self, events: bytes) -> None:
        """Note the ``index`` of each final event among whole ``events`` (rare: parsed)."""
        for event in _EVENT_END.split(events):
            if not _STOP.search(event):
                continue
            for line in event.splitlines():
                if not line.startswith(b"data:"):
                    continue
                try:
                    obj = pydantic_core.from_json(line[5:].strip())
                except ValueError:
                    continue
                index = obj.get("index", 0) if isinstance(obj, dict) else None
                if isinstance(index, int) and obj.get("stop") is True:
                    self.ended.add(index)

    def ends_a_stream(self) -> bool:
        tail = self.pending if self.pending.strip() else self.event
        if self.n_choices > 1 and self.pending.strip():
            self._finals(self.pending)  # the last event, without its blank line
        found = _LAST_EVENT.search(tail)
        if found is None:
            return False
        if self.n_choices <= 1 or not _STOP.fullmatch(found.group()):
            return True  # one choice, [DONE] or an error event
        return self.ended >= set(range(self.n_choices))


def props_with(raw: bytes, backend: dict[str, Any]) -> bytes:
    """The upstream's /props with localspec's ``backend`` section added."""
    try:
        body = pydantic_core.from_json(raw)
    except ValueError:
        return raw
    if not isinstance(body, dict):
        return raw
    body["backend"] = backend
    return dumps(body)
