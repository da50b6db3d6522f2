"""Shared pieces of the operations tests: a live daemon on loopback (in this process, or as its
own process, as ``localspec up`` runs it) and llama-vscode-like request bodies."""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from localspec.engine.types import EngineSettings, ModelSettings, SpecSettings
from localspec.server import ServerSettings, create_app
from localspec.server.run import bind_sockets, uvicorn_config
from localspec.server.state import Service

KEY = "ops-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


def engine_settings(
    path: Path, *, n_ctx: int = 1024, n_batch: int = 512, n_slots: int = 2, mode: str = "ngram"
) -> EngineSettings:
    model = ModelSettings(
        path=str(path), n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch, n_threads=1,
        n_threads_batch=1,
    )  # fmt: skip
    return EngineSettings(target=model, n_slots=n_slots, spec=SpecSettings(mode=mode))  # type: ignore[arg-type]


@dataclass
class Live:
    url: str
    server: uvicorn.Server
    thread: threading.Thread
    service: Service

    def client(self, **kw: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=120, **kw)


def start(settings: ServerSettings, engine: EngineSettings) -> Live:
    """The app under uvicorn on a free loopback port, in a thread of this process."""
    app = create_app(settings, engine)
    sockets = bind_sockets("127.0.0.1", 0)
    port = sockets[0].getsockname()[1]
    server = uvicorn.Server(uvicorn_config(app, "warning", settings.max_connections))
    thread = threading.Thread(target=server.run, kwargs={"sockets": sockets}, daemon=True)
    thread.start()
    live = Live(f"http://127.0.0.1:{port}", server, thread, app.state.service)
    wait_ready(live.url)
    return live


def stop(live: Live) -> None:
    live.server.should_exit = True
    live.thread.join(60)


def wait_ready(url: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=5) as c:
        while time.monotonic() < deadline:
            try:
                if c.get(url + "/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
    raise RuntimeError(f"{url} did not become ready in {timeout} s")


# ------------------------------------------------------------------ the daemon as a process

DAEMON = """
import json, sys
from localspec.engine.types import EngineSettings, ModelSettings, SpecSettings
from localspec.server import ServerSettings, serve
from localspec.server import logs

args = json.loads(sys.argv[1])
logs.configure(args.get("log_level", "warning"), args.get("log_format", "text"),
               args.get("requests", False))
model = ModelSettings(path=args["model"], n_ctx=args.get("n_ctx", 1024),
                      n_batch=args.get("n_batch", 512), n_ubatch=args.get("n_batch", 512),
                      n_threads=1, n_threads_batch=1)
rc = serve(
    ServerSettings(port=args.get("port", 0), queue_limit=args.get("queue_limit", 16)),
    EngineSettings(target=model, n_slots=args.get("n_slots", 2),
                   spec=SpecSettings(mode=args.get("mode", "ngram"))),
    on_ready=lambda: print("READY", flush=True),
    on_bound=lambda addrs: print("BOUND " + json.dumps(addrs), flush=True),
)
print("RC", rc, flush=True)
sys.exit(rc)
"""


@dataclass
class Daemon:
    proc: subprocess.Popen[str]
    url: str = ""

    def read_until(self, prefix: str) -> str:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(prefix):
                return line[len(prefix) :].strip()
        err = self.proc.stderr.read() if self.proc.stderr else ""
        raise AssertionError(f"daemon ended before {prefix!r}: {err[-2000:]}")


def spawn(script: str, args: dict[str, Any]) -> subprocess.Popen[str]:
    """``python -c script '<args as JSON>'``, its output piped as text."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, "-c", script, json.dumps(args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def launch(**args: Any) -> Daemon:
    return Daemon(spawn(DAEMON, args))


@contextlib.contextmanager
def running_daemon(**args: Any) -> Iterator[Daemon]:
    """A started daemon that is ready; killed afterwards whatever happened."""
    daemon = launch(**args)
    try:
        addrs = json.loads(daemon.read_until("BOUND "))
        daemon.read_until("READY")
        daemon.url = f"http://127.0.0.1:{addrs[0][1]}"
        yield daemon
    finally:
        if daemon.proc.poll() is None:
            daemon.proc.kill()
        daemon.proc.wait(30)


# ------------------------------------------------------------------ request bodies


def stdlib_lines(module: Any) -> list[str]:
    return inspect.getsource(module).splitlines(keepends=True)


def ring(n: int = 8, lines: int = 6) -> list[dict[str, Any]]:
    """llama-vscode's ring buffer: chunks of real code (the stdlib) with file names."""
    import json.decoder as source_module

    source = stdlib_lines(source_module)
    return [
        {"text": "".join(source[i * lines : (i + 1) * lines]), "time": 1724000000 + i,
         "filename": f"/proj/mod{i}.py"}
        for i in range(n)
    ]  # fmt: skip


def infill_body(doc: int, *, n_predict: int = 8, **over: Any) -> dict[str, Any]:
    """A greedy /infill request at one of several places of a real stdlib file."""
    import textwrap as source_module

    source = stdlib_lines(source_module)
    cut = 40 + 17 * doc
    body = {
        "input_prefix": "".join(source[max(0, cut - 40) : cut]),
        "input_suffix": "".join(source[cut + 1 : cut + 12]),
        "input_extra": ring(),
        "prompt": source[cut][: len(source[cut]) // 2],
        "n_predict": n_predict,
        "top_k": 1,
        "samplers": ["top_k"],
        "cache_prompt": True,
        "t_max_predict_ms": 0,
    }
    body.update(over)
    return body


def wait_until(cond: Callable[[], object], timeout: float = 60.0) -> None:
    """Poll ``cond`` until it holds (what a test waits for happens on another thread)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.005)


@contextlib.contextmanager
def http_server(
    body: bytes, status: int = 200, headers: dict[str, str] | None = None
) -> Iterator[int]:
    """Another program's HTTP server on a loopback port (its port yielded): every GET gets
    ``body`` (a llama-server on llama-vscode's port, a stand-in for "not localspec")."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
