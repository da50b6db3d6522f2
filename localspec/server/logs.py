"""The daemon's logs: one line per request, text or JSON, bodies only at debug level.

Everything goes to stderr (or the ``localspec up --log-file``): nothing leaves the machine.
A request line carries no prompt text; the bodies logger (debug only) does, and says so.

``configure(level, fmt, requests)`` is what the CLI calls; the request line itself is built by
the gate (``RequestLog``), filled in by the routes as the request runs.
"""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, TextIO

REQUESTS = "localspec.requests"  # one INFO line per request
BODIES = "localspec.bodies"  # request bodies, DEBUG only
BODY_LOG_LIMIT = 65536  # characters of a body written to the debug log

LogFormat = Literal["text", "json"]

_TEXT_FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"
BODY_WARNING = "debug logging writes request bodies (prompt text: the code being edited) to the log"


@dataclass
class RequestLog:
    """What one request did, filled in as it runs; logged and counted when it ends."""

    method: str
    path: str
    route: str = "other"  # a known route or "other" (bounded label set for metrics)
    status: int = 0
    outcome: str = ""  # set by the route when it knows better than the status
    slot: int | None = None
    n_prompt: int | None = None
    evaluated: int | None = None
    reused: int | None = None
    approx: int | None = None  # prompt tokens on KV a cold evaluation computes differently
    predicted: int | None = None
    drafted: int | None = None
    accepted: int | None = None
    # n_cmpl > 1: tokens drawn at another completion's rows while their tokens agreed
    followed: int | None = None
    threads: str | None = None  # the target's threads at the end: "single tokens/batches"
    # the host cache (engine/hostcache.py): context tokens put back into the slot from RAM
    # instead of evaluated, the copy's time, and tokens of the slot's old context kept there
    restored: int | None = None
    restore_ms: float | None = None
    stashed: int | None = None
    # answered from the cursor's nearest lines within t_max_prompt_ms (server/jump.py): 1,
    # and that short prompt's tokens
    budget: int | None = None
    budget_ctx: int | None = None
    queue_ms: float | None = None
    prompt_ms: float | None = None
    gen_ms: float | None = None
    total_ms: float = 0.0
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def final_outcome(self) -> str:
        if self.outcome:
            return self.outcome
        if self.status == 499:
            return "client left"
        if self.status == 503:
            return "unavailable"
        if self.status >= 500:
            return "error"
        if self.status >= 400:
            return "rejected"
        return "ok"

    def fields(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if v is not None and k != "extra"}
        out["outcome"] = self.final_outcome()
        out.update(self.extra)
        for key in ("queue_ms", "prompt_ms", "gen_ms", "total_ms", "restore_ms"):
            if key in out:
                out[key] = round(out[key], 2)
        return out

    def message(self) -> str:
        f = self.fields()
        head = f"{self.method} {self.path} {self.status} {f['outcome']}"
        skip = {"method", "path", "status", "outcome", "route"}
        rest = " ".join(f"{k}={_text(v)}" for k, v in f.items() if k not in skip)
        return f"{head} {rest}"


def _text(value: Any) -> str:
    if isinstance(value, str) and (" " in value or not value):
        return json.dumps(value)
    return str(value)


# looked up once: getLogger takes the logging module's lock on every call
_requests_log = logging.getLogger(REQUESTS)
_bodies_log = logging.getLogger(BODIES)


def log_request(entry: RequestLog) -> None:
    logger = _requests_log
    if logger.isEnabledFor(logging.INFO):
        logger.info(entry.message(), extra={"fields": entry.fields()})


def log_body(method: str, path: str, body: bytes) -> None:
    logger = _bodies_log
    if logger.isEnabledFor(logging.DEBUG):
        text = body[:BODY_LOG_LIMIT].decode("utf-8", "replace")
        more = f" (+{len(body) - BODY_LOG_LIMIT} bytes)" if len(body) > BODY_LOG_LIMIT else ""
        logger.debug("%s %s body: %s%s", method, path, text, more, extra={"fields": {}})


class JsonFormatter(logging.Formatter):
    """One JSON object per line; a request line's fields become top-level keys."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            entry.update({k: v for k, v in fields.items() if k not in entry})
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False, default=str)


def formatter(fmt: LogFormat) -> logging.Formatter:
    if fmt == "json":
        return JsonFormatter()
    if fmt == "text":
        return logging.Formatter(_TEXT_FORMAT, "%H:%M:%S")
    raise ValueError(f"unknown log format {fmt!r}: use 'text' or 'json'")


def configure(
    level: str = "info",
    fmt: LogFormat = "text",
    requests: bool = False,
    *,
    stream: TextIO | None = None,
) -> logging.Handler:
    """Send every localspec log to ``stream`` (stderr) in ``fmt``; the handler is returned.

    ``requests`` turns the per-request INFO line on (always on at debug level). Debug level
    also logs request bodies, and warns once that it does.
    """
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {level!r}: use debug, info, warning or error")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(formatter(fmt))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(numeric)
    debug = numeric <= logging.DEBUG
    logging.getLogger(REQUESTS).setLevel(logging.INFO if requests or debug else logging.WARNING)
    logging.getLogger(BODIES).setLevel(logging.DEBUG if debug else logging.WARNING)
    # the HTTP clients' own line per request only when debugging: the team-server client's
    # (the request line says the same: backend=upstream upstream_ms=...), and the one
    # huggingface_hub downloads with (httpx2), whose lines would break up the progress bars
    for client in ("httpx", "httpx2"):
        logging.getLogger(client).setLevel(logging.DEBUG if debug else logging.WARNING)
    if debug:
        logging.getLogger("localspec.server").warning(BODY_WARNING)
    return handler
