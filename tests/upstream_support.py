"""Real servers for the team-backend tests: localspec daemons as processes (an upstream, and
the daemon under test in front of it) and small scripted servers on loopback (an OpenAI-style
upstream that streams known text, a slow one, an HTTPS one with a self-signed certificate)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from localspec.catalog import load_catalog
from tests.ops_support import spawn

QWEN_FIM = load_catalog().model("qwen2.5-coder-1.5b").tokenizer.fim_text
assert QWEN_FIM is not None

DAEMON = """
import json, sys
from localspec.catalog import FimText
from localspec.engine.types import EngineSettings, ModelSettings, SpecSettings
from localspec.server import ServerSettings, UpstreamSettings, logs, serve

args = json.loads(sys.argv[1])
log_file = open(args["log_file"], "a", buffering=1) if args.get("log_file") else None
logs.configure("info", "json", True, stream=log_file)
engine = None
if args.get("model"):
    model = ModelSettings(path=args["model"], n_ctx=args.get("n_ctx", 2048), n_batch=512,
                          n_ubatch=512, n_threads=1, n_threads_batch=1)
    engine = EngineSettings(target=model, n_slots=args.get("n_slots", 1),
                            spec=SpecSettings(mode="off"))
upstream = None
if args.get("upstream"):
    up = dict(args["upstream"])
    fim = FimText(**up.pop("fim")) if up.get("fim") else None
    upstream = UpstreamSettings(**up, fim=fim)
rc = serve(
    ServerSettings(port=args.get("port", 0), host="127.0.0.1", api_key=args.get("api_key"),
                   model_alias=args.get("alias")),
    engine,
    upstream=upstream,
    on_ready=lambda: print("READY", flush=True),
    on_bound=lambda addrs: print("BOUND " + json.dumps(addrs), flush=True),
)
print("RC", rc, flush=True)
sys.exit(rc)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Daemon:
    proc: subprocess.Popen[str]
    port: int = 0
    log_file: Path | None = None
    out: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def read_until(self, prefix: str, timeout: float = 180.0) -> str:
        """The rest of the first stdout line starting with ``prefix``."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        for line in self.proc.stdout:
            self.out.append(line)
            if line.startswith(prefix):
                return line[len(prefix) :].strip()
            if time.monotonic() > deadline:
                break
        err = self.proc.stderr.read() if self.proc.stderr else ""
        raise AssertionError(f"daemon ended before {prefix!r}: {''.join(self.out)} {err[-3000:]}")

    def records(self, timeout: float = 5.0) -> list[dict[str, Any]]:
        """The log's JSON records written so far. The daemon may be writing one as the test
        reads: that one is waited for (the log ends a line), never read in half."""
        assert self.log_file is not None
        deadline = time.monotonic() + timeout
        while True:
            text = self.log_file.read_text() if self.log_file.exists() else ""
            if text.endswith("\n") or not text or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        whole = text[: text.rfind("\n") + 1]
        return [json.loads(line) for line in whole.splitlines() if line.startswith("{")]

    def requests(self) -> list[dict[str, Any]]:
        """The request log lines written so far (JSON)."""
        return [e for e in self.records() if e.get("logger") == "localspec.requests"]

    def lines(self, path: str, n: int = 1, timeout: float = 10.0) -> list[dict[str, Any]]:
        """The request log lines for ``path``, once there are at least ``n`` (a line is
        written just after its answer went out)."""
        found: list[dict[str, Any]] = []

        def enough() -> bool:
            found[:] = [e for e in self.requests() if e.get("path") == path]
            return len(found) >= n

        wait_for(enough, timeout, f"{n} log line(s) for {path}")
        return found

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)


def launch(tmp: Path, *, ready: bool = True, **args: Any) -> Daemon:
    """A localspec daemon as its own process (``serve`` as ``localspec up`` runs it)."""
    log_file = tmp / f"daemon-{time.monotonic_ns()}.log"
    daemon = Daemon(spawn(DAEMON, {"log_file": str(log_file), **args}), log_file=log_file)
    try:
        daemon.port = json.loads(daemon.read_until("BOUND "))[0][1]
        if ready:
            daemon.read_until("READY")
    except BaseException:
        daemon.kill()
        raise
    return daemon


@contextlib.contextmanager
def daemon(tmp: Path, **args: Any) -> Iterator[Daemon]:
    d = launch(tmp, **args)
    try:
        yield d
    finally:
        d.kill()


def upstream_config(url: str, kind: str = "llama-server", **over: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "kind": kind,
        "url": url,
        "health_interval_s": 0.5,
        "fallback_ms": 0.0,
        "read_timeout_s": 30.0,
    }
    if kind == "openai":
        config["fim"] = QWEN_FIM.model_dump()
        config["fim_model"] = "qwen2.5-coder-1.5b"
    config.update(over)
    return config


def wait_for(check: Callable[[], bool], timeout: float = 30.0, what: str = "") -> float:
    """Seconds until ``check()`` holds (polled every 20 ms)."""
    t0 = time.monotonic()
    while not check():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.02)
    return time.monotonic() - t0


def props(url: str, **kw: Any) -> dict[str, Any]:
    r = httpx.get(url + "/props", timeout=30, **kw)
    assert r.status_code == 200, r.text
    return r.json()


def wait_local(d: Daemon, timeout: float = 120.0) -> None:
    """Until the daemon's local fallback model has loaded (READY came from the upstream)."""
    wait_for(
        lambda: props(d.url)["backend"]["local_state"] == "ready", timeout, "the local model loads"
    )


def sse_objects(text: str) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


# ------------------------------------------------------------------ scripted servers


@dataclass
class Scripted:
    """A small OpenAI-style (and llama-server-style) server: it records each request body
    and streams the pieces a test gives it."""

    pieces: list[str] = field(default_factory=lambda: ["x"])
    finish: str | None = "stop"
    delay_s: float = 0.0  # before answering (a slow upstream)
    piece_s: float = 0.0  # between pieces
    status: int = 200
    error: dict[str, Any] | None = None
    key: str | None = None
    whole: bool = False  # answer one JSON object even when asked to stream (some servers do)
    # a prompt longer than this is refused as vLLM refuses one over its context (4096 tokens)
    max_prompt_chars: int | None = None
    bodies: list[dict[str, Any]] = field(default_factory=list)
    closed: list[bool] = field(default_factory=list)  # per request: the client left early
    usage: dict[str, Any] | None = field(
        default_factory=lambda: {
            "prompt_tokens": 40,
            "completion_tokens": 3,
            "prompt_tokens_details": {"cached_tokens": 30},
        }
    )

    def app(self) -> Starlette:
        async def authorized(request: Request) -> Response | None:
            if self.key and request.headers.get("authorization") != f"Bearer {self.key}":
                return JSONResponse(
                    {"error": {"message": "Incorrect API key provided", "type": "auth"}},
                    status_code=401,
                )
            return None

        async def completions(request: Request) -> Response:
            refused = await authorized(request)
            if refused is not None:
                return refused
            body = await request.json()
            self.bodies.append(body)
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            if self.status != 200:
                return JSONResponse(self.error or {"error": "no"}, status_code=self.status)
            n_chars = len(body.get("prompt") or "")
            if self.max_prompt_chars is not None and n_chars > self.max_prompt_chars:
                asked = 4096 * n_chars // self.max_prompt_chars
                message = (
                    "This model's maximum context length is 4096 tokens. However, you requested "
                    f"{asked} tokens ({asked - 8} in the messages, 8 in the completion)."
                )
                error = {"object": "error", "message": message, "type": "BadRequestError"}
                return JSONResponse({**error, "code": 400}, status_code=400)
            if self.whole:
                n = int(body.get("n") or 1)
                choices = [
                    {"index": i, "text": "".join(self.pieces), "finish_reason": self.finish}
                    for i in range(n)
                ]
                return JSONResponse({"choices": choices, "usage": self.usage})
            return StreamingResponse(self._stream(body), media_type="text/event-stream")

        async def chat(request: Request) -> Response:
            refused = await authorized(request)
            if refused is not None:
                return refused
            self.bodies.append(await request.json())
            message = {"role": "assistant", "content": "".join(self.pieces)}
            choice = {"index": 0, "message": message, "finish_reason": self.finish}
            return JSONResponse({"object": "chat.completion", "choices": [choice]})

        async def models(request: Request) -> Response:
            refused = await authorized(request)
            if refused is not None:
                return refused
            return JSONResponse(
                {"object": "list", "data": [{"id": "scripted", "max_model_len": 4096}]}
            )

        async def health(_request: Request) -> Response:
            return JSONResponse({"status": "ok"})

        async def props_route(_request: Request) -> Response:
            return JSONResponse({"total_slots": 4, "default_generation_settings": {"n_ctx": 4096}})

        async def infill(request: Request) -> Response:
            self.bodies.append(await request.json())
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            return JSONResponse({"content": "".join(self.pieces), "stop": True})

        return Starlette(
            routes=[
                Route("/v1/completions", completions, methods=["POST"]),
                Route("/v1/chat/completions", chat, methods=["POST"]),
                Route("/v1/models", models),
                Route("/health", health),
                Route("/props", props_route),
                Route("/infill", infill, methods=["POST"]),
            ]
        )

    async def _stream(self, body: dict[str, Any]) -> Any:
        record = len(self.closed)
        self.closed.append(True)
        n = int(body.get("n") or 1)
        for piece in self.pieces:
            if self.piece_s:
                await asyncio.sleep(self.piece_s)
            for i in range(n):
                chunk = {"choices": [{"index": i, "text": piece, "finish_reason": None}]}
                yield f"data: {json.dumps(chunk)}\n\n"
        for i in range(n):
            last = {"choices": [{"index": i, "text": "", "finish_reason": self.finish}]}
            yield f"data: {json.dumps(last)}\n\n"
        if self.usage:
            yield f"data: {json.dumps({'choices': [], 'usage': self.usage})}\n\n"
        yield "data: [DONE]\n\n"
        self.closed[record] = False


@dataclass
class Served:
    url: str
    server: uvicorn.Server
    thread: threading.Thread


@contextlib.contextmanager
def serve_app(app: Any, *, ssl: tuple[Path, Path] | None = None) -> Iterator[Served]:
    """``app`` under uvicorn on a free loopback port, in a thread (https with ``ssl``)."""
    port = free_port()
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=port,
        log_level="warning",
        lifespan="off",
        ssl_certfile=str(ssl[0]) if ssl else None,
        ssl_keyfile=str(ssl[1]) if ssl else None,
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    scheme = "https" if ssl else "http"
    wait_for(lambda: server.started, 30, "the scripted server starts")
    try:
        yield Served(f"{scheme}://127.0.0.1:{port}", server, thread)
    finally:
        server.should_exit = True
        thread.join(30)


def self_signed(tmp: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (openssl's CLI); (cert, key)."""
    exe = shutil.which("openssl")
    if exe is None:
        import pytest

        pytest.skip("the TLS tests need the openssl command to make a self-signed certificate")
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    subprocess.run(
        [exe, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return cert, key


# ------------------------------------------------------------------ a byte-level upstream

Script = Callable[[str, dict[str, Any]], bytes]


class RawUpstream:
    """A team server written at the byte level (asyncio streams, no HTTP library), for what a
    framework would not send: streams cut or ended early, gzip a proxy added, a login page.
    Its checks (/health, /props, /v1/models) answer as a healthy server's, or never with
    ``checks_hang``; a generation request gets ``script(path, body)`` written as it is, then
    the connection closes (with ``keep_alive``: stays open for the next request).

    ``answers_per_connection``: a connection that has answered that many requests reads the
    next one and closes without answering, as a server whose idle timeout closes a kept-alive
    connection just as the client sends on it (the race every pooled client meets)."""

    def __init__(
        self,
        script: Script,
        *,
        checks_hang: bool = False,
        keep_alive: bool = False,
        answers_per_connection: int | None = None,
    ) -> None:
        self.script = script
        self.checks_hang = checks_hang
        self.keep_alive = keep_alive
        self.answers_per_connection = answers_per_connection
        self.dropped = 0  # requests read and left unanswered (answers_per_connection)
        self.posts: list[tuple[str, dict[str, str]]] = []  # (path, headers) per generation
        self.loop = asyncio.new_event_loop()
        self.port = free_port()
        started = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            self.loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", self.port))
            started.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        started.wait(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        async def shutdown() -> None:
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

        asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        answered = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                method, path = head.split(b" ", 2)[:2]
                lines = head.decode("latin-1").split("\r\n")[1:]
                headers = {
                    k.strip().lower(): v.strip()
                    for k, _, v in (x.partition(":") for x in lines)
                    if k
                }
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                if self.answers_per_connection is not None and (
                    answered >= self.answers_per_connection
                ):
                    self.dropped += 1
                    break
                answered += 1
                if method == b"GET":
                    if self.checks_hang:
                        await asyncio.sleep(3600)
                    writer.write(http_answer(200, _HEALTHY.get(path.decode(), {})))
                    await writer.drain()
                    continue
                self.posts.append((path.decode(), headers))
                writer.write(self.script(path.decode(), json.loads(body or b"{}")))
                await writer.drain()
                if not self.keep_alive:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


_HEALTHY: dict[str, Any] = {
    "/health": {"status": "ok"},
    "/props": {"total_slots": 4, "default_generation_settings": {"n_ctx": 4096}},
    "/v1/models": {"object": "list", "data": [{"id": "team", "max_model_len": 4096}]},
}


def http_answer(
    status: int, body: Any, *, content_type: str = "application/json", headers: str = ""
) -> bytes:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return (
        f"HTTP/1.1 {status} X\r\nContent-Type: {content_type}\r\nContent-Length: {len(data)}\r\n"
        f"{headers}\r\n"
    ).encode() + data


def event_stream(
    *events: Any, headers: str = "", encode: Callable[[bytes], bytes] = bytes
) -> bytes:
    """A close-delimited event stream of ``events`` (dicts, or raw ``data:`` text)."""
    data = b"".join(
        b"data: " + (e.encode() if isinstance(e, str) else json.dumps(e).encode()) + b"\n\n"
        for e in events
    )
    head = (
        f"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n{headers}\r\n"
    )
    return head.encode() + encode(data)
