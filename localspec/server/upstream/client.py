"""The HTTP client that talks to the upstream (httpx), and its failures in words a user can act on.

TLS is verified by default (the system's trust store, or ``ca_bundle``); the key goes in an
``Authorization: Bearer`` header set once on the client, so no code path formats it. Proxies
come from the environment (``HTTPS_PROXY``/``NO_PROXY``), as for every other localspec
download.
"""

from __future__ import annotations

import ssl

import httpx

from localspec.retry_after import retry_after
from localspec.server.upstream.config import UpstreamSettings

KEEPALIVE = 32  # pooled connections kept open to the upstream (one editor needs one or two)
# An idle pooled connection is dropped before the servers close it themselves (llama-server's
# cpp-httplib, and uvicorn under vLLM, both after 5 s idle), so a request rarely meets a close.
KEEPALIVE_EXPIRY_S = 4.0
# what a request sent on a connection the server had just closed fails with, before any answer
_STALE = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)


class _FreshRetry(httpx.AsyncBaseTransport):
    """A request that failed on a reused (kept-alive) connection before any answer came is
    sent again, until it goes on a new connection: the server closing idle connections (all
    of them at once, often) as the request crossed one is no failure of the server (RFC 9112
    9.3.1), and must not mark it down. A failure on a new connection is the server's, and is
    raised; so is the first failure when the server no longer takes connections (it was
    killed mid-answer, not idle)."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        outer = request.extensions.get("trace")
        fresh = False

        async def trace(name: str, info: dict[str, object]) -> None:
            nonlocal fresh
            if name.startswith("connection.connect_"):  # a new connection, not a pooled one
                fresh = True
            if outer is not None:
                await outer(name, info)

        request.extensions = {**request.extensions, "trace": trace}
        stale: httpx.TransportError | None = None
        for _ in range(KEEPALIVE + 1):  # each failed pooled connection leaves the pool
            fresh = False
            try:
                return await self.inner.handle_async_request(request)
            except httpx.ConnectError:
                if stale is None:
                    raise
                raise stale from None  # it is gone: it closed mid-answer, as the first try said
            except _STALE as exc:
                if fresh:
                    raise
                stale = stale or exc
        assert stale is not None
        raise stale

    async def aclose(self) -> None:
        await self.inner.aclose()


def make_client(cfg: UpstreamSettings) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    verify: ssl.SSLContext | bool = True
    if cfg.url.startswith("https://"):
        verify = ssl.create_default_context(cafile=cfg.ca_bundle)
    limits = httpx.Limits(max_keepalive_connections=KEEPALIVE, keepalive_expiry=KEEPALIVE_EXPIRY_S)
    return httpx.AsyncClient(
        base_url=cfg.url,
        headers=headers,
        verify=verify,
        timeout=httpx.Timeout(cfg.read_timeout_s, connect=cfg.connect_timeout_s),
        limits=limits,
        transport=_FreshRetry(httpx.AsyncHTTPTransport(verify=verify, limits=limits)),
        follow_redirects=False,  # a redirect would carry the key to wherever it points
    )


class UpstreamFailure(Exception):
    """The upstream could not answer: unreachable, TLS refused, timed out, closed mid-answer,
    answered 429/502/503/504, or sent what is not an answer. ``reason`` is a short label
    (logs, metrics), ``message`` the sentence the editor and the log get."""

    def __init__(self, reason: str, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.retry_after_s = retry_after_s  # the upstream asked not to be sent more until then


UNAVAILABLE = frozenset({429, 502, 503, 504})  # the upstream cannot answer now: the local model may


def unavailable(status: int, raw: bytes, headers: httpx.Headers, url: str) -> UpstreamFailure:
    """An answer with a status in :data:`UNAVAILABLE` as the failure it is (with the wait its
    ``Retry-After`` asks for)."""
    return UpstreamFailure(
        "unavailable",
        f"the upstream {url} answered HTTP {status} ({raw[:200]!r})",
        retry_after_s=retry_after(headers.get("retry-after")),
    )


def _tls_cause(exc: BaseException) -> ssl.SSLError | None:
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ssl.SSLError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def failure(exc: httpx.HTTPError, url: str) -> UpstreamFailure:
    """An httpx error as an UpstreamFailure that says what happened and what to do."""
    tls = _tls_cause(exc)
    if tls is not None:
        detail = getattr(tls, "verify_message", None) or getattr(tls, "reason", None) or tls
        if isinstance(tls, ssl.SSLCertVerificationError):
            return UpstreamFailure(
                "tls",
                f"the upstream {url} presented a TLS certificate localspec does not trust "
                f"({detail}): set backend.ca_bundle to the PEM file of the CA that signed it",
            )
        return UpstreamFailure("tls", f"TLS with the upstream {url} failed ({detail})")
    if isinstance(exc, httpx.ConnectTimeout):
        return UpstreamFailure("timeout", f"the upstream {url} did not accept a connection in time")
    if isinstance(exc, httpx.ConnectError):
        return UpstreamFailure("unreachable", f"the upstream {url} is unreachable ({exc})")
    if isinstance(exc, httpx.ReadTimeout):
        return UpstreamFailure(
            "timeout", f"the upstream {url} went silent for longer than backend.read_timeout_s"
        )
    if isinstance(exc, httpx.TimeoutException):
        return UpstreamFailure("timeout", f"the upstream {url} timed out ({type(exc).__name__})")
    if isinstance(exc, httpx.RemoteProtocolError | httpx.ReadError | httpx.WriteError):
        return UpstreamFailure(
            "closed", f"the upstream {url} closed the connection mid-answer ({exc or 'no detail'})"
        )
    return UpstreamFailure("error", f"talking to the upstream {url} failed: {exc!r}")
