"""``serve``: bind, load the models in the background, serve until a signal, free the models.

``localhost`` binds both 127.0.0.1 and ::1 (llama-vscode's default URL resolves to either).
SIGINT/SIGTERM cancel the request in flight (the engine stops within one step), close the
listeners, free the models and return 0. A model that fails to load stops the daemon with a
clear log line and a non-zero return.
"""

from __future__ import annotations

import errno
import logging
import signal
import socket
from collections.abc import Callable
from types import FrameType
from typing import Any

import uvicorn

from localspec.engine.errors import OutOfMemoryError
from localspec.engine.types import EngineSettings
from localspec.server.app import create_app
from localspec.server.options import ServerSettings
from localspec.server.upstream.config import UpstreamSettings

log = logging.getLogger("localspec.server")

EXIT_LOAD_FAILED = 3
EXIT_BIND_FAILED = 4
EXIT_OUT_OF_MEMORY = 5  # loading failed for memory: a smaller layout may load (``up`` re-plans)


def _listen(host: str, port: int, family: socket.AddressFamily) -> socket.socket:
    # proto=IPPROTO_TCP lets asyncio set TCP_NODELAY on accepted connections; with proto 0
    # it does not, and Nagle + delayed ACK add ~40 ms to every response sent in two writes.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind((host, port))
        sock.listen(128)
        sock.set_inheritable(True)
    except OSError:
        sock.close()
        raise
    return sock


def bind_sockets(host: str, port: int) -> list[socket.socket]:
    """Listening sockets for ``host``; ``localhost`` gives IPv4 and (when available) IPv6."""
    if host != "localhost":
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, _, _, _, addr = infos[0]
        return [_listen(addr[0], port, family)]
    v4 = _listen("127.0.0.1", port, socket.AF_INET)
    port = v4.getsockname()[1]  # port 0: IPv6 takes the same port as IPv4
    try:
        return [v4, _listen("::1", port, socket.AF_INET6)]
    except OSError as exc:
        if exc.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):
            log.warning("IPv6 loopback unavailable (%s); serving on 127.0.0.1 only", exc)
            return [v4]
        v4.close()
        raise


def uvicorn_config(
    app: Any, log_level: str = "warning", max_connections: int | None = None
) -> uvicorn.Config:
    """uvicorn as the daemon runs it (``serve``, and the overhead benchmark measures the same).

    ``http``/``loop`` stay "auto": httptools and uvloop when installed (both are dependencies;
    uvloop has no Windows build), the pure-Python h11 and asyncio otherwise.
    """
    return uvicorn.Config(
        app,
        log_config=None,
        log_level=log_level,
        access_log=False,  # the gate writes one line per request (localspec.requests)
        server_header=False,  # the gate names the server: localspec/<version>
        proxy_headers=False,  # no X-Forwarded-* rewriting: nothing here reads the client address
        timeout_graceful_shutdown=5,
        lifespan="on",
        # past this many open connections uvicorn answers 503 instead of accepting more work
        limit_concurrency=max_connections,
    )


class _Server(uvicorn.Server):
    """uvicorn's server, plus: a signal first cancels the request in flight, and a stop by
    signal is a clean exit (uvicorn would re-raise the signal after shutting down)."""

    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_exit = on_exit

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.should_exit:  # the log says why the daemon went away (a second signal:
            log.info("stopping on %s", signal.Signals(sig).name)  # uvicorn forces the exit)
        self._on_exit()
        super().handle_exit(sig, frame)
        captured = getattr(self, "_captured_signals", None)
        if isinstance(captured, list):
            captured.clear()


def serve(
    server_settings: ServerSettings,
    engine_settings: EngineSettings | None,
    *,
    chat_engine_settings: EngineSettings | None = None,
    on_ready: Callable[[], None] | None = None,
    on_bound: Callable[[list[tuple[str, int]]], None] | None = None,
    log_level: str = "warning",
    upstream: UpstreamSettings | None = None,
) -> int:
    """Serve until SIGINT/SIGTERM; 0 on a clean stop, non-zero when loading (3; 5: for memory)
    or binding (4) failed.
    ``upstream``: a team server answers, the local model (``engine_settings``; None: none)
    only while it cannot. ``chat_engine_settings``: a second pair that answers chat (its own
    worker)."""
    server_settings.check()
    failure: list[BaseException] = []
    server: _Server | None = None

    def failed(exc: BaseException) -> None:
        failure.append(exc)
        log.error("localspec could not load the model: %s", exc)
        if server is not None:
            server.should_exit = True

    app = create_app(
        server_settings,
        engine_settings,
        on_ready=on_ready,
        on_failure=failed,
        chat_engine_settings=chat_engine_settings,
        upstream=upstream,
    )
    svc = app.state.service
    try:
        sockets = bind_sockets(server_settings.host, server_settings.port)
    except OSError as exc:
        busy = exc.errno == errno.EADDRINUSE
        log.error(
            "cannot listen on %s:%d: %s%s",
            server_settings.host,
            server_settings.port,
            exc,
            " (is another server already running there?)" if busy else " (check server.host)",
        )
        return EXIT_BIND_FAILED
    addresses = [s.getsockname()[:2] for s in sockets]
    # uvicorn's own log config would give its lines their own handlers and format; without
    # it they go through the root handler like every other line (text or JSON, one stream)
    for name in ("uvicorn", "uvicorn.error"):
        logging.getLogger(name).setLevel(log_level.upper())
    config = uvicorn_config(app, log_level, server_settings.max_connections)
    server = _Server(config, on_exit=svc.worker.cancel_running)
    if on_bound is not None:
        on_bound(addresses)
    try:
        server.run(sockets=sockets)
    finally:
        for sock in sockets:
            sock.close()
    if failure:
        return EXIT_OUT_OF_MEMORY if isinstance(failure[0], OutOfMemoryError) else EXIT_LOAD_FAILED
    log.info("stopped")
    return 0
