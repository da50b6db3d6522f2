"""The servers a benchmark starts: llama.cpp's llama-server (the anchor) and localspec's daemon.

Both run as child processes on free loopback ports with the same model files, context,
batch and threads, so the replay compares servers, not settings. Output goes to a log file
whose tail is shown when a server fails to come up.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx

from localspec.engine.llama import default_repack_weights
from localspec.planning.team import UNIFIED_KV

LLAMA_SERVER_ENV = "LLAMA_SERVER_BIN"

# llama-server speculation per bench mode; anything else is passed as --spec-type verbatim.
LLAMA_MODES = ("plain", "ngram", "draft")


@dataclass(frozen=True)
class ServeSettings:
    """What both servers share: model files and the knobs that shape latency."""

    target: Path
    draft: Path | None = None
    ctx: int = 4096
    threads: int = 2
    batch: int = 1024
    cache_reuse: int = 256
    cache_exact_ms: float | None = None  # localspec only; None: its default
    ring_attention: str | None = None  # localspec only ("causal" | "blocks"); None: default
    draft_max: int = 16
    draft_p_min: float = 0.75
    n_predict: int = 128  # llama-server's default n_predict (the client's value)
    # slots: localspec --slots N; llama-server -np N x n_cmpl, as many x ctx cells in all
    # (it decodes a request's extra completions in other, idle slots: n_cmpl must not exceed
    # its n_parallel)
    slots: int = 1
    n_cmpl: int = 1
    # llama-server -kvu: one KV buffer every slot may fill (as localspec's). Its slots then
    # see N x ctx as their context, which also widens /infill's extra-context budget: off for
    # the editor replay, on for plain /completion throughput
    kv_unified: bool = False
    flash_attn: str | None = None  # localspec only ("on" | "off"); None: its default
    # localspec only: an instruct model that answers chat beside the target (its own worker)
    chat_target: Path | None = None


@dataclass
class ServerSpec:
    name: str
    argv: list[str]
    port: int
    env: dict[str, str] = field(default_factory=dict)
    chat_model: str | None = None  # the model name its chat answers under, when it serves one

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def find_llama_server(explicit: str | None = None) -> Path:
    """$LLAMA_SERVER_BIN (or ``explicit``), else llama-server on PATH; a clear error if neither."""
    candidate = explicit or os.environ.get(LLAMA_SERVER_ENV) or shutil.which("llama-server")
    if not candidate:
        raise FileNotFoundError(
            f"no llama-server binary: set {LLAMA_SERVER_ENV} (build one with "
            "scripts/build-llama-server.sh; see docs/benchmarks.md)"
        )
    path = Path(candidate).expanduser()
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise FileNotFoundError(f"{LLAMA_SERVER_ENV}={candidate} is not an executable file")
    return path


def llama_server_spec(
    binary: Path, serve: ServeSettings, mode: str, port: int | None = None
) -> ServerSpec:
    """``llama-server`` as llama-vscode's presets run it, with one speculation mode.

    ``MODE+fa-off`` runs that mode with flash attention off (llama-server's own default is
    auto, which turns it on for the CPU): the same attention path localspec takes there.
    """
    mode, _, variant = mode.partition("+")
    if variant not in ("", "fa-off"):
        raise ValueError(f"unknown llama-server variant +{variant} (known: +fa-off)")
    port = port or free_port()
    argv = [
        str(binary),
        "-m", str(serve.target),
        "--host", "127.0.0.1",
        "--port", str(port),
        "-c", str(serve.ctx * serve.slots * serve.n_cmpl),
        "-np", str(serve.slots * serve.n_cmpl),
        "-b", str(serve.batch),
        "-ub", str(serve.batch),
        "-t", str(serve.threads),
        "-tb", str(serve.threads),
        "--cache-reuse", str(serve.cache_reuse),
        # llama-server sizes the FIM ring budget with its own default n_predict (-1), which
        # overflows n_ctx by 3 tokens once the ring is full; the client's 128 keeps it inside.
        "-n", str(serve.n_predict),
        "--no-webui",
        "--metrics",  # the bench reads llamacpp:prompt_tokens_total around each location
    ]  # fmt: skip
    # several types joined by "&" are tried in that order each step ("ngram-mod&draft": the
    # n-gram draft when it finds one, else the draft model's)
    aliases = {"draft": "draft-simple", "ngram": "ngram-simple"}
    types = [aliases.get(t, t) for t in mode.split("&")] if mode != "plain" else []
    if "draft-simple" in types:
        if serve.draft is None:
            raise ValueError(f"llama-server mode {mode!r} needs a draft model (--draft)")
        argv += [
            "-md", str(serve.draft),
            "--spec-draft-n-max", str(serve.draft_max),
            "--spec-draft-p-min", str(serve.draft_p_min),
            "-td", str(serve.threads),
            "-tbd", str(serve.threads),
        ]  # fmt: skip
    if types:
        argv += ["--spec-type", ",".join(types)]
    if variant:
        argv += ["--flash-attn", "off"]
    if serve.kv_unified:
        argv += UNIFIED_KV  # as a team server runs it (planning.team)
    if not default_repack_weights():
        # where llama.cpp runs AMX kernels, its AMX weight buffers crash on some CPUs (see
        # engine.llama): llama-server loads as localspec does there
        argv += ["--no-repack"]
    return ServerSpec(f"llama-server/{mode}{'+' + variant if variant else ''}", argv, port)


def localspec_spec(
    serve: ServeSettings, spec_mode: str | None = None, port: int | None = None
) -> ServerSpec:
    """localspec's daemon (``localspec up``) serving the given files on a loopback port."""
    port = port or free_port()
    argv = [
        sys.executable, "-m", "localspec", "up",
        "--target", str(serve.target),
        "--host", "127.0.0.1",
        "--port", str(port),
        "--ctx-size", str(serve.ctx),
        "--slots", str(serve.slots),
        "--threads", str(serve.threads),
        "--cache-reuse", str(serve.cache_reuse),
        # llama-server's /infill window is its -b: the same window, whatever batch localspec runs
        "--infill-window", str(serve.batch),
        "--log-requests",  # one line per request in the kept log: what each keystroke did
    ]  # fmt: skip
    if serve.draft is not None:
        argv += ["--draft", str(serve.draft)]
    if spec_mode:
        argv += ["--spec-mode", spec_mode]
    if serve.cache_exact_ms is not None:
        argv += ["--cache-exact-ms", str(serve.cache_exact_ms)]
    if serve.ring_attention is not None:
        argv += ["--ring-attention", serve.ring_attention]
    if serve.flash_attn is not None:
        argv += ["--flash-attn", serve.flash_attn]
    if serve.chat_target is not None:
        argv += ["--chat-target", str(serve.chat_target)]
    name = "localspec" if not spec_mode else f"localspec/{spec_mode}"
    chat_model = serve.chat_target.name if serve.chat_target is not None else None
    if chat_model is not None:
        name += "+chat"
    return ServerSpec(name, argv, port, chat_model=chat_model)


def twin(spec: ServerSpec) -> ServerSpec:
    """A second instance of ``spec`` (same files and flags) on its own port: the cold-cache
    oracle, so cold checks never touch the measured server's cache."""
    port = free_port()
    argv = list(spec.argv)
    argv[argv.index("--port") + 1] = str(port)
    return replace(spec, name=f"{spec.name}.cold", argv=argv, port=port, env=dict(spec.env))


class ServerError(RuntimeError):
    """A benchmark server did not come up; the message carries its log's tail."""


class ManagedServer:
    """A child server process: started, health-checked, stopped; its log kept for errors."""

    def __init__(self, spec: ServerSpec, log_dir: Path | None = None) -> None:
        self.spec = spec
        self._log_dir = log_dir or Path(tempfile.mkdtemp(prefix="localspec-bench-"))
        safe = spec.name.replace("/", "-")
        self.log_path = self._log_dir / f"{safe}-{spec.port}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self._log_dir.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                self.spec.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **self.spec.env},
            )

    def log_tail(self, n: int = 30) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def wait_ready(
        self, timeout_s: float = 600.0, on_wait: Callable[[float], None] | None = None
    ) -> None:
        """Poll /health until ``{"status":"ok"}``; fail fast when the process exits."""
        assert self.proc is not None, "start() first"
        t0 = time.monotonic()
        while True:
            code = self.proc.poll()
            if code is not None:
                raise ServerError(
                    f"{self.spec.name} exited with code {code} while loading; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            with contextlib.suppress(httpx.HTTPError):
                r = httpx.get(self.spec.url + "/health", timeout=2.0)
                if r.status_code == 200 and r.json().get("status") == "ok":
                    return
            elapsed = time.monotonic() - t0
            if elapsed > timeout_s:
                self.stop()
                raise ServerError(
                    f"{self.spec.name} not ready after {timeout_s:.0f} s; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            if on_wait is not None:
                on_wait(elapsed)
            time.sleep(0.25)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)

    def __enter__(self) -> ManagedServer:
        self.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()


@contextlib.contextmanager
def serving(
    specs: Sequence[ServerSpec], log_dir: Path, timeout_s: float, progress: Callable[[str], None]
) -> Iterator[list[ManagedServer]]:
    """``start_all``'s servers for the block, stopped when it ends however it ends."""
    started = start_all(specs, log_dir, timeout_s, progress)
    try:
        yield started
    finally:
        for server in started:
            server.stop()


def start_all(
    specs: Sequence[ServerSpec], log_dir: Path, timeout_s: float, progress: Callable[[str], None]
) -> list[ManagedServer]:
    """Start every server, one after the other (loading competes for the same cores)."""
    started: list[ManagedServer] = []
    try:
        for spec in specs:
            server = ManagedServer(spec, log_dir)
            started.append(server)
            server.start()
            shown = [0.0]

            def tick(elapsed: float, name: str = spec.name, shown: list[float] = shown) -> None:
                if elapsed - shown[0] >= 10.0:  # a line every 10 s while a model loads
                    shown[0] = elapsed
                    progress(f"loading {name} ({elapsed:.0f} s)")

            progress(f"loading {spec.name}")
            server.wait_ready(timeout_s, tick)
            progress(f"{spec.name} ready at {spec.url}")
    except BaseException:
        for server in started:
            server.stop()
        raise
    return started
