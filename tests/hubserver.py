"""A Hugging Face hub stand-in on 127.0.0.1 for tests, speaking what huggingface_hub calls.

Endpoints: ``HEAD``/``GET /{repo}/resolve/{revision}/{filename}`` (``ETag``, ``X-Repo-Commit``,
``X-Linked-Etag``, ``X-Linked-Size``, ``Content-Length``, ``Range`` -> 206),
``GET /api/models/{repo}[/revision/{rev}]`` (siblings; sizes and LFS sha256 with ``blobs=True``)
and ``POST /api/models/{repo}/paths-info/{rev}``. It counts every request, serves files from
bytes or from disk, and can cut a download off midway or serve corrupted bytes. It also
answers requests sent to it as an HTTP proxy (absolute-form targets) and can serve HTTPS.
"""

from __future__ import annotations

import hashlib
import json
import re
import ssl
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

_CHUNK = 64 * 1024


@dataclass
class HubFile:
    data: bytes | None = None
    path: Path | None = None
    sha256: str = ""
    size: int = 0

    def read(self, start: int, end: int) -> bytes:
        if self.data is not None:
            return self.data[start:end]
        assert self.path is not None
        with self.path.open("rb") as f:
            f.seek(start)
            return f.read(end - start)


@dataclass
class HubRepo:
    commit: str
    files: dict[str, HubFile] = field(default_factory=dict)


@dataclass
class Request:
    method: str
    path: str
    range: str | None
    status: int
    bytes_sent: int = 0
    authorization: str | None = None


class LocalHub:
    """Use as a context manager; ``url`` goes into ``HF_ENDPOINT`` or ``endpoint=``."""

    def __init__(self, *, tls_cert: Path | None = None, tls_key: Path | None = None) -> None:
        self.repos: dict[str, HubRepo] = {}
        self.requests: list[Request] = []
        self.lock = threading.Lock()
        self._cut: dict[str, int] = {}  # filename -> bytes to send before dropping the link
        self.failing: set[str] = set()  # filenames answered 503 (the "network" stays down)
        self.corrupt: set[str] = set()  # filenames served with flipped bytes
        self.fail_after_cut = True
        self.flaky: dict[str, int] = {}  # filename -> bytes every GET sends before the link drops
        self.portal: set[str] = set()  # filenames whose GET gets a login page (HEAD is fine)
        # (status, Retry-After or None, method or None for any): answered, in order, to the
        # next requests, as a mirror or proxy does for a moment
        self.blips: list[tuple[int, str | None, str | None]] = []
        self.ignore_range = False  # answer 200 with the whole file, as some CDNs do
        self.chunk_delay = 0.0  # seconds slept per 64 KiB sent: a slow link
        # when set: a download stops after its first 64 KiB until the event is set (a download
        # still under way whenever the test looks, however loaded the machine)
        self.paused: threading.Event | None = None
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self._server.daemon_threads = True
        self.scheme = "http"
        if tls_cert is not None:  # an HTTPS hub, for CA-bundle tests
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(tls_cert, tls_key)
            self._server.socket = context.wrap_socket(self._server.socket, server_side=True)
            self.scheme = "https"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    # -- setup ---------------------------------------------------------------------------
    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"{self.scheme}://{host!s}:{port}"

    def add_file(
        self, repo: str, filename: str, data: bytes | Path, *, commit: str | None = None
    ) -> HubFile:
        """Publish a file; a new ``commit`` (40 hex) moves the repo's main to it."""
        if isinstance(data, Path):
            digest = hashlib.sha256()
            with data.open("rb") as f:
                while block := f.read(1 << 20):
                    digest.update(block)
            hub_file = HubFile(path=data, sha256=digest.hexdigest(), size=data.stat().st_size)
        else:
            hub_file = HubFile(data=data, sha256=hashlib.sha256(data).hexdigest(), size=len(data))
        entry = self.repos.setdefault(repo, HubRepo(commit=commit or _commit_for(repo)))
        if commit is not None:
            entry.commit = commit
        entry.files[filename] = hub_file
        return hub_file

    def cut(self, filename: str, at: int, *, then_fail: bool = True) -> None:
        """The next GET of ``filename`` sends ``at`` bytes and drops the connection; with
        ``then_fail`` every later request for it gets 503 until ``heal``."""
        self._cut[filename] = at
        self.fail_after_cut = then_fail

    def heal(self) -> None:
        self._cut.clear()
        self.failing.clear()
        self.corrupt.clear()
        self.flaky.clear()
        self.portal.clear()
        self.blips.clear()

    def reset_counts(self) -> None:
        with self.lock:
            self.requests.clear()

    def bytes_served(self, filename: str | None = None) -> int:
        with self.lock:
            return sum(
                r.bytes_sent
                for r in self.requests
                if r.method == "GET" and (filename is None or r.path.endswith("/" + filename))
            )

    # -- lifecycle -----------------------------------------------------------------------
    def __enter__(self) -> LocalHub:
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._server.shutdown()
        self._server.server_close()


def _commit_for(repo: str) -> str:
    return hashlib.sha1(repo.encode()).hexdigest()


_RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<file>.+)$")
_INFO = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)(?:/revision/(?P<rev>[^/]+))?$")
_PATHS = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)/paths-info/(?P<rev>[^/]+)$")
_RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")


def _handler_for(hub: LocalHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:  # quiet test output
            return

        # -- plumbing --------------------------------------------------------------------
        def _record(self, status: int, sent: int = 0) -> Request:
            """Recorded before the answer goes out (a client that has read it finds it
            counted, however slow this thread is to get on)."""
            request = Request(
                self.command,
                self.path,
                self.headers.get("Range"),
                status,
                sent,
                self.headers.get("Authorization"),
            )
            with hub.lock:
                hub.requests.append(request)
            return request

        def _send(
            self, status: int, body: bytes = b"", headers: dict[str, str] | None = None
        ) -> None:
            self._record(status, 0 if self.command == "HEAD" else len(body))
            self.send_response(status)
            for key, value in (headers or {}).items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _json(self, status: int, payload: Any, headers: dict[str, str] | None = None) -> None:
            body = json.dumps(payload).encode()
            self._send(status, body, {"Content-Type": "application/json", **(headers or {})})

        def _error(self, status: int, code: str, message: str) -> None:
            self._json(status, {"error": message}, {"X-Error-Code": code})

        def _blip(self) -> bool:
            """Answer the next blip meant for this method, if any."""
            with hub.lock:
                i = next((i for i, b in enumerate(hub.blips) if b[2] in (None, self.command)), -1)
                if i < 0:
                    return False
                status, after, _ = hub.blips.pop(i)
            headers = {"Retry-After": after} if after is not None else None
            self._json(status, {"error": f"HTTP {status} from the mirror"}, headers)
            return True

        def _repo(self, repo_id: str, rev: str | None) -> HubRepo | None:
            repo = hub.repos.get(repo_id)
            if repo is None:
                self._error(401, "RepoNotFound", f"Repository {repo_id} not found")
                return None
            if rev not in (None, "main", repo.commit):
                self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
                return None
            return repo

        # -- routes ----------------------------------------------------------------------
        def do_HEAD(self) -> None:
            self._route()

        def do_GET(self) -> None:
            self._route()

        def do_POST(self) -> None:
            path = urlsplit(self.path).path
            length = int(self.headers.get("Content-Length") or 0)
            form = parse_qs(self.rfile.read(length).decode())
            if self._blip():
                return
            match = _PATHS.match(path)
            if not match:
                self._error(404, "NotFound", path)
                return
            repo = self._repo(unquote(match["repo"]), unquote(match["rev"]))
            if repo is None:
                return
            out = []
            for name in form.get("paths", []):
                f = repo.files.get(name)
                if f is not None:
                    out.append(
                        {
                            "type": "file",
                            "path": name,
                            "size": f.size,
                            "oid": hashlib.sha1(f.sha256.encode()).hexdigest(),
                            "lfs": {"oid": f.sha256, "size": f.size, "pointerSize": 134},
                        }
                    )
            self._json(200, out)

        def _route(self) -> None:
            if self._blip():
                return
            parts = urlsplit(self.path)
            path = unquote(parts.path)
            if match := _RESOLVE.match(path):
                self._resolve(match["repo"], match["rev"], match["file"])
            elif self.command == "GET" and (match := _INFO.match(path)):
                self._info(match["repo"], match["rev"], parse_qs(parts.query))
            else:
                self._error(404, "NotFound", path)

        def _info(self, repo_id: str, rev: str | None, query: dict[str, list[str]]) -> None:
            repo = self._repo(repo_id, rev)
            if repo is None:
                return
            blobs = query.get("blobs", ["false"])[0].lower() == "true"
            siblings = []
            for name, f in repo.files.items():
                sibling: dict[str, Any] = {"rfilename": name}
                if blobs:
                    sibling["size"] = f.size
                    sibling["blobId"] = hashlib.sha1(f.sha256.encode()).hexdigest()
                    sibling["lfs"] = {"size": f.size, "sha256": f.sha256, "pointerSize": 134}
                siblings.append(sibling)
            self._json(
                200, {"id": repo_id, "modelId": repo_id, "sha": repo.commit, "siblings": siblings}
            )

        def _resolve(self, repo_id: str, rev: str, filename: str) -> None:
            repo = self._repo(repo_id, rev)
            if repo is None:
                return
            f = repo.files.get(filename)
            if f is None:
                self._error(404, "EntryNotFound", f"{filename} does not exist at {rev}")
                return
            if filename in hub.failing:
                self._error(503, "Unavailable", "service unavailable")
                return
            headers = {
                "X-Repo-Commit": repo.commit,
                "ETag": f'"{f.sha256}"',
                "X-Linked-Etag": f'"{f.sha256}"',
                "X-Linked-Size": str(f.size),
                "Accept-Ranges": "bytes",
                "Content-Type": "application/octet-stream",
            }
            if self.command == "GET" and filename in hub.portal:  # a captive portal
                page = b"<!DOCTYPE html><html><body>Sign in to continue</body></html>"
                self._send(200, page, {"Content-Type": "text/html"})
                return
            start, status = 0, 200
            range_header = self.headers.get("Range")
            if range_header and self.command == "GET" and not hub.ignore_range:
                match = _RANGE.match(range_header.strip())
                if not match or int(match[1]) >= f.size:
                    self._send(416, b"", {"Content-Range": f"bytes */{f.size}"})
                    return
                start, status = int(match[1]), 206
                headers["Content-Range"] = f"bytes {start}-{f.size - 1}/{f.size}"
            record = self._record(status)
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(f.size - start))
            self.end_headers()
            if self.command == "HEAD":
                return
            limit = hub._cut.pop(filename, hub.flaky.get(filename))
            self._stream(f, start, filename, limit, record)
            if limit is not None:
                if hub.fail_after_cut and filename not in hub.flaky:
                    hub.failing.add(filename)
                self.close_connection = True

        def _stream(
            self, f: HubFile, start: int, filename: str, limit: int | None, record: Request
        ) -> None:
            end = f.size if limit is None else min(f.size, start + limit)
            pos = start
            while pos < end:
                block = bytearray(f.read(pos, min(end, pos + _CHUNK)))
                if filename in hub.corrupt and pos <= f.size // 2 < pos + len(block):
                    block[f.size // 2 - pos] ^= 0xFF
                with hub.lock:  # counted before the client can have it
                    record.bytes_sent += len(block)
                try:
                    self.wfile.write(block)
                except (BrokenPipeError, ConnectionResetError):
                    with hub.lock:
                        record.bytes_sent -= len(block)
                    break
                pos += len(block)
                if hub.chunk_delay:
                    time.sleep(hub.chunk_delay)
                if hub.paused is not None:
                    hub.paused.wait(60)
            if limit is not None:
                self.wfile.flush()

    return Handler
