"""The daemon's life outside the server: who holds the port, pid files, detaching, stopping.

``up`` asks :func:`probe_port` before loading anything: a localspec daemon already answering
means "say so and exit 0", anything else holding the port is named (pid and program via
psutil where the OS lets us see it). A pid file per port in :func:`localspec.paths.state_dir`
lets ``down`` and ``status`` find the process; a stale one (dead pid, or a pid reused by some
other program) is ignored and removed.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import psutil

from localspec import paths

MARKER = "localspec"  # what /props (or the Server header) must mention to count as ours


def log_file() -> Path:
    return paths.state_dir() / "localspec.log"


def connect_host(host: str) -> str:
    """Where a client reaches a server bound to ``host`` (a wildcard bind answers on loopback)."""
    if host in ("0.0.0.0", "", "*"):
        return "127.0.0.1"
    if host == "::":
        return "::1"
    return host


def base_url(host: str, port: int) -> str:
    host = connect_host(host)
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}"


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


# --- who holds the port ----------------------------------------------------------------------


@dataclass
class PortOwner:
    kind: Literal["free", "localspec", "other"]
    pid: int | None = None
    name: str | None = None
    detail: str = ""

    def describe(self) -> str:
        who = f"{self.name or 'a process'}" + (f" (pid {self.pid})" if self.pid else "")
        return f"{who}{': ' + self.detail if self.detail else ''}"


def listener_pid(port: int) -> int | None:
    """The pid listening on ``port``, when the OS shows it to this user (not always on macOS)."""
    with contextlib.suppress(psutil.Error, OSError):
        for conn in psutil.net_connections(kind="tcp"):
            listening = conn.status == psutil.CONN_LISTEN and conn.laddr
            if listening and conn.laddr.port == port and conn.pid:
                return conn.pid
    return None


def _process_name(pid: int | None) -> str | None:
    if pid is None:
        return None
    try:
        proc = psutil.Process(pid)
        cmdline = proc.cmdline()
        return " ".join(cmdline[:4]) if cmdline else proc.name()
    except psutil.Error:
        return None


def _port_is_bound(host: str, port: int) -> bool:
    """Try to bind as the server would: a failure means someone else has it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        if os.name != "nt":  # the server sets SO_REUSEADDR too; TIME_WAIT is no owner
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except socket.gaierror:
            return False  # no such host: nobody holds it, and the server's bind says so
        except OSError:
            return True
    return False


def is_localspec(url: str, api_key: str | None = None, timeout: float = 2.0) -> bool | None:
    """True: a localspec server answers; False: some other HTTP or TCP service; None: nothing."""
    import httpx  # here, not at the top: `localspec --help` stays fast

    try:
        response = httpx.get(f"{url}/props", headers=_headers(api_key), timeout=timeout)
    except httpx.TransportError:
        return None
    if MARKER in response.headers.get("server", "").lower():
        return True
    return MARKER in response.text.lower()


def probe_port(host: str, port: int, api_key: str | None = None) -> PortOwner:
    url = base_url(host, port)
    answer = is_localspec(url, api_key)
    pid = listener_pid(port)
    info = read_pid_file(port)
    if answer is False and (info or (pid and _looks_like_localspec(pid))):
        answer = True  # a localspec still loading answers 503 without the marker
    if answer is True:
        pid = info.pid if info else pid
        return PortOwner("localspec", pid, "localspec", url)
    if answer is None and not _port_is_bound(host, port):
        return PortOwner("free")
    detail = f"answers HTTP at {url} but is not localspec" if answer is False else ""
    detail = detail or f"port {port} is in use"
    return PortOwner("other", pid, _process_name(pid), detail)


# --- pid files -------------------------------------------------------------------------------


@dataclass
class PidInfo:
    pid: int
    host: str
    port: int
    started: float  # time.time() when the daemon started
    log: str | None = None


def pid_file(port: int) -> Path:
    return paths.state_dir() / f"localspec-{port}.pid"


def write_pid_file(host: str, port: int, log: Path | None = None) -> Path:
    path = pid_file(port)
    path.parent.mkdir(parents=True, exist_ok=True)
    info = PidInfo(os.getpid(), host, port, time.time(), str(log) if log else None)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(info)), encoding="utf-8")
    tmp.replace(path)
    return path


def remove_pid_file(port: int) -> None:
    """Remove this process's pid file (never another daemon's)."""
    info = read_pid_file(port, check_alive=False)
    if info is not None and info.pid == os.getpid():
        pid_file(port).unlink(missing_ok=True)


def _runs_up(proc: psutil.Process) -> bool:
    """Whether ``proc`` is a ``localspec up`` (a path that merely names localspec, a
    checkout's venv or `localspec logs -f`, is not)."""
    words = [Path(arg).name.lower() for arg in proc.cmdline()]
    return any(MARKER in w and words[i + 1 : i + 2] == ["up"] for i, w in enumerate(words))


def _looks_like_localspec(pid: int) -> bool:
    try:
        return _runs_up(psutil.Process(pid))
    except psutil.Error:
        return False


def _wrote(info: PidInfo) -> bool:
    """Whether ``info.pid`` is still the ``localspec up`` that wrote the file: a pid reused
    since (by `localspec logs -f`, an editor on the config: anything naming localspec) is a
    process started after the file was, and must never get a `down`'s SIGTERM."""
    try:
        proc = psutil.Process(info.pid)
        # the file is written after the start: a later start is a reused pid
        return _runs_up(proc) and proc.create_time() <= info.started + 1.0
    except psutil.Error:
        return False


def read_pid_file(port: int, *, check_alive: bool = True) -> PidInfo | None:
    """The pid file's contents; a stale one (dead or reused pid) is removed and None returned."""
    path = pid_file(port)
    try:
        info = PidInfo(**json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError):
        return None
    if check_alive and not _wrote(info):
        path.unlink(missing_ok=True)
        return None
    return info


# --- starting in the background --------------------------------------------------------------


def spawn_detached(args: Sequence[str], log: Path) -> subprocess.Popen:
    """Run ``python -m localspec <args>`` in a new session, its output appended to ``log``."""
    log.parent.mkdir(parents=True, exist_ok=True)
    kwargs: dict[str, Any] = {}
    if os.name == "nt":
        kwargs["creationflags"] = (
            subprocess.CREATE_NEW_PROCESS_GROUP | subprocess.DETACHED_PROCESS  # type: ignore[attr-defined]
        )
    else:
        kwargs["start_new_session"] = True
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "localspec", *args],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            close_fds=True,
            **kwargs,
        )


HealthState = Literal["ready", "loading", "down"]


def health(url: str, timeout: float = 2.0) -> tuple[HealthState, dict[str, Any]]:
    import httpx

    try:
        response = httpx.get(f"{url}/health", timeout=timeout)
    except httpx.TransportError:
        return "down", {}
    try:
        body = response.json()
    except ValueError:
        body = {}
    body = body if isinstance(body, dict) else {}
    return ("ready" if response.status_code == 200 else "loading"), body


def wait_until_ready(
    url: str,
    proc: subprocess.Popen | None,
    timeout: float,
    on_tick: Callable[[HealthState], None] | None = None,
    interval: float = 0.25,
) -> HealthState | int:
    """Poll /health until ready; the child's exit code if it dies first; the last state on
    timeout."""
    deadline = time.monotonic() + timeout
    state: HealthState = "down"
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            return proc.returncode
        state, _ = health(url)
        if on_tick:
            on_tick(state)
        if state == "ready":
            return state
        time.sleep(interval)
    return state


# --- stopping --------------------------------------------------------------------------------


def stop(
    pid: int, timeout: float = 60.0, force: bool = False
) -> Literal["stopped", "killed", "timeout", "gone"]:
    """SIGTERM (graceful: in-flight requests end, models are freed), then wait."""
    try:
        proc = psutil.Process(pid)
        if os.name == "nt":
            proc.terminate()
        else:
            proc.send_signal(signal.SIGTERM)
    except psutil.NoSuchProcess:
        return "gone"
    if _ended(proc, timeout):
        return "stopped"
    if not force:
        return "timeout"
    with contextlib.suppress(psutil.NoSuchProcess):
        proc.kill()
        _ended(proc, 10.0)
    return "killed"


def _ended(proc: psutil.Process, timeout: float) -> bool:
    """Whether ``proc`` exits within ``timeout`` s. An exited process its parent has not reaped
    yet (a zombie: an IDE or supervisor that started the daemon) has ended too, where
    psutil's wait would keep seeing it."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            proc.wait(max(0.0, min(0.1, deadline - time.monotonic())))  # reaps our own child
            return True
        except psutil.TimeoutExpired:
            pass
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        if time.monotonic() >= deadline:
            return False


# --- logs ------------------------------------------------------------------------------------


def lines_from(path: Path, offset: int) -> list[str]:
    """The lines written to ``path`` after byte ``offset`` (a start's own, in a shared log)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(offset)
            return fh.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return []


def tail(path: Path, lines: int, end: int | None = None) -> list[str]:
    """The last ``lines`` lines of a file before offset ``end`` (reads backwards from there,
    fine for big logs)."""
    if lines <= 0 or not path.exists():
        return []
    with open(path, "rb") as fh:
        fh.seek(0, os.SEEK_END)
        end = fh.tell() if end is None else min(end, fh.tell())
        block, data = 8192, b""
        while end > 0 and data.count(b"\n") <= lines:
            step = min(block, end)
            end -= step
            fh.seek(end)
            data = fh.read(step) + data
    return data.decode("utf-8", "replace").splitlines()[-lines:]


def follow(path: Path, interval: float = 0.5, start: int | None = None) -> Iterator[str]:
    """Lines written to ``path`` after offset ``start`` (default: its end, found now rather
    than at the first ``next``), forever; the caller stops on Ctrl-C. Follows truncation and
    rotation by reopening."""
    fh = open(path, "rb")  # noqa: SIM115 - closed by the generator
    if start is None:
        fh.seek(0, os.SEEK_END)
    else:
        fh.seek(start)
    return _follow(path, fh, interval)


def _follow(path: Path, fh: Any, interval: float) -> Iterator[str]:
    buffer = b""
    try:
        while True:
            chunk = fh.read()
            if chunk:
                buffer += chunk
                *complete, buffer = buffer.split(b"\n")
                for line in complete:
                    yield line.decode("utf-8", "replace")
                continue
            time.sleep(interval)
            try:
                rotated = os.stat(path).st_ino != os.fstat(fh.fileno()).st_ino
                truncated = os.stat(path).st_size < fh.tell()
            except OSError:
                continue
            if rotated or truncated:
                fh.close()
                fh = open(path, "rb")  # noqa: SIM115
    finally:
        fh.close()
