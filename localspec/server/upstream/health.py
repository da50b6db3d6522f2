"""The upstream's health, checked in the background and corrected by every answer.

A check asks what a request needs: llama-server's ``/health`` (503 while it loads) then its
``/props`` (the slot count for the stable slot, the context; a 401 there means the key is
wrong), or an OpenAI server's ``/v1/models`` (the model list, its context length where vLLM or
localspec report one). Between checks the request path reports too: a transport failure marks
the upstream down at once (and wakes the checker); the upstream is skipped for a while when it
asks for that (``Retry-After`` on a 429 or 503), when its answers come later than
``fallback_ms`` several times in a row (one check interval), and when several requests in a
row fail while its checks pass (a proxy in front of it that cuts streams: one interval, twice
as long each time it goes on).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal

import httpx

from localspec.server.upstream.client import UpstreamFailure, failure
from localspec.server.upstream.config import UpstreamSettings

log = logging.getLogger("localspec.upstream")

Status = Literal["unknown", "up", "loading", "down", "refused"]
Skip = Literal["slow", "busy", "failing"]  # why an upstream that answers checks is skipped
DOWN_RECHECK_S = 1.0  # while down, look again at least this often: switch back soon
CHECK_READ_S = 5.0  # /health and /props answer at once on a working server, busy or not
LONGEST_SKIP_S = 120.0


@dataclass(frozen=True)
class UpstreamState:
    """What is known of the upstream now (immutable: replaced as a whole, read without locks)."""

    status: Status = "unknown"
    since: float = 0.0  # wall-clock time of the last status change
    checked: float = 0.0  # wall-clock time of the last check
    error: str = ""  # why it is not up (or a warning while up)
    n_slots: int | None = None  # llama-server's total_slots
    n_ctx: int | None = None  # context per request the upstream allows
    model: str | None = None  # the upstream's (first) model id
    models: tuple[str, ...] = ()

    @property
    def answers(self) -> bool:
        """Whether requests should go to it ("unknown" counts: try until a check says no;
        "refused" too: its 401 reaches the editor, which is how a wrong key shows)."""
        return self.status in ("unknown", "up", "refused")


def _json(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return None


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _models_facts(body: Any) -> tuple[tuple[str, ...], int | None]:
    """Model ids and a context length from /v1/models (vLLM: max_model_len; localspec and
    llama-server: meta.n_ctx / meta.n_ctx_train)."""
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list):
        return (), None
    ids = tuple(str(m["id"]) for m in data if isinstance(m, dict) and "id" in m)
    n_ctx = None
    for m in data:
        if not isinstance(m, dict):
            continue
        meta = m.get("meta") if isinstance(m.get("meta"), dict) else {}
        n_ctx = (
            _int(m.get("max_model_len")) or _int(meta.get("n_ctx")) or _int(meta.get("n_ctx_train"))
        )
        if n_ctx:
            break
    return ids, n_ctx


class Health:
    def __init__(
        self,
        cfg: UpstreamSettings,
        client: httpx.AsyncClient,
        on_change: Callable[[UpstreamState, UpstreamState], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.client = client
        self.on_change = on_change
        self.state = UpstreamState(since=time.time())
        self.skip_until = 0.0  # monotonic: the upstream is skipped until then ...
        self.skip_reason: Skip = "slow"  # ... because of this
        self._late = 0  # answers in a row that came after fallback_ms
        self._failures = 0  # requests in a row that failed
        self._holds = 0  # skips in a row for failing
        self._check_timeout = httpx.Timeout(
            min(cfg.read_timeout_s, CHECK_READ_S), connect=cfg.connect_timeout_s
        )
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ routing

    @property
    def usable(self) -> bool:
        return self.state.answers and time.monotonic() >= self.skip_until

    def why_not(self) -> str:
        return self.skip_reason if time.monotonic() < self.skip_until else self.state.status

    # ------------------------------------------------------------------ reports

    def _set(self, **changes: Any) -> None:
        old = self.state
        new = replace(old, **changes)
        if new.status != old.status:
            new = replace(new, since=time.time())
            level = logging.INFO if new.status == "up" else logging.WARNING
            detail = f": {new.error}" if new.error else ""
            log.log(level, "upstream %s is %s%s", self.cfg.url, new.status, detail)
        self.state = new
        if self.on_change is not None and new.status != old.status:
            self.on_change(old, new)

    def _skip(self, seconds: float, reason: Skip, why: str) -> None:
        seconds = min(seconds, LONGEST_SKIP_S)
        if time.monotonic() + seconds <= self.skip_until:
            return
        self.skip_until, self.skip_reason = time.monotonic() + seconds, reason
        log.warning(
            "upstream %s %s: the local model answers for the next %g s", self.cfg.url, why, seconds
        )

    def mark_failed(self, exc: UpstreamFailure) -> None:
        """A request could not reach it or its answer broke: down now, and the checker looks
        again soon; skipped for a while when it asked for that or keeps failing."""
        self._set(status="down", error=exc.message)
        self._failures += 1
        if exc.retry_after_s:
            self._skip(exc.retry_after_s, "busy", "asked for a pause (Retry-After)")
        elif self._failures >= self.cfg.slow_strikes:
            self._failures = 0
            self._holds += 1
            self._skip(
                self.cfg.health_interval_s * 2 ** (self._holds - 1),
                "failing",
                f"failed {self.cfg.slow_strikes} requests in a row",
            )
        self._wake.set()

    def mark_answered(self, *, completion: bool = True) -> None:
        """An answer arrived whole (a stream: to its end). Only a completion's clears the
        strikes: a /props that answers says nothing of the streams a proxy cuts."""
        if completion:
            self._late = self._failures = self._holds = 0
        if self.state.status in ("unknown", "down"):
            self._set(status="up", error="")

    def mark_late(self) -> bool:
        """An answer did not start within fallback_ms; True when that made it skip the upstream
        for a check interval (``slow_strikes`` in a row)."""
        self._late += 1
        if self._late >= self.cfg.slow_strikes:
            self._late = 0
            self._skip(
                self.cfg.health_interval_s,
                "slow",
                f"answered later than {self.cfg.fallback_ms:g} ms "
                f"{self.cfg.slow_strikes} times in a row",
            )
            return True
        return False

    # ------------------------------------------------------------------ checks

    async def check(self) -> UpstreamState:
        """One check now; the new state is kept and returned."""
        try:
            if self.cfg.kind == "llama-server":
                changes = await self._check_llama_server()
            else:
                changes = await self._check_openai()
        except httpx.ReadTimeout:
            error = f"its health check got no answer in {self._check_timeout.read:g} s"
            changes = {"status": "down", "error": error}
        except httpx.HTTPError as exc:
            changes = {"status": "down", "error": failure(exc, self.cfg.url).message}
        self._set(checked=time.time(), **changes)
        return self.state

    async def _check_llama_server(self) -> dict[str, Any]:
        r = await self.client.get("/health", timeout=self._check_timeout)
        if r.status_code == 503:
            return {"status": "loading", "error": "the upstream is loading its model"}
        if r.status_code != 200:
            return {"status": "down", "error": f"its /health answered HTTP {r.status_code}"}
        props = await self.client.get("/props", timeout=self._check_timeout)
        if props.status_code in (401, 403):
            return {"status": "refused", "error": self.cfg.refused_message()}
        body = _json(props) if props.status_code == 200 else None
        if not isinstance(body, dict):
            return {"status": "up", "error": f"its /props answered HTTP {props.status_code}"}
        settings = body.get("default_generation_settings")
        n_ctx = _int(settings.get("n_ctx")) if isinstance(settings, dict) else None
        alias = body.get("model_alias") or body.get("model_path")
        return {
            "status": "up",
            "error": "",
            "n_slots": _int(body.get("total_slots")),
            "n_ctx": n_ctx or _int(body.get("n_ctx")),
            "model": str(alias) if alias else None,
        }

    async def _check_openai(self) -> dict[str, Any]:
        r = await self.client.get("/v1/models", timeout=self._check_timeout)
        if r.status_code in (401, 403):
            return {"status": "refused", "error": self.cfg.refused_message()}
        if r.status_code == 503:
            return {"status": "loading", "error": "the upstream answers 503 (loading?)"}
        if r.status_code != 200:
            return {"status": "down", "error": f"its /v1/models answered HTTP {r.status_code}"}
        ids, n_ctx = _models_facts(_json(r))
        error = ""
        if self.cfg.model and ids and self.cfg.model not in ids:
            error = f"backend.model {self.cfg.model!r} is not among its models {list(ids)}"
        return {
            "status": "up",
            "error": error,
            "models": ids,
            "model": self.cfg.model or (ids[0] if ids else None),
            "n_ctx": n_ctx,
        }

    # ------------------------------------------------------------------ background

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="localspec-upstream-health")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        while True:
            interval = self.cfg.health_interval_s
            if not self.state.answers:
                interval = min(interval, DOWN_RECHECK_S)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), interval)
                # woken by a failed request: at most one check per DOWN_RECHECK_S, so that
                # failing requests do not each bring two more to a struggling server
                await asyncio.sleep(self.state.checked + DOWN_RECHECK_S - time.time())
            self._wake.clear()
            try:
                await self.check()
            except Exception:  # a bug here must not end the checks for good
                log.exception("checking the upstream failed")
