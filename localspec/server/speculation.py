"""Speculation as the user can see it: each request's language, acceptance by language and by
draft position (in /metrics, the request log, the answer's timings, ``localspec status``), and
the recent requests the /stats page draws.

The language is resolved when the route has parsed the body (``begin``): the client's word at
once, or a guess on ``LanguageBook``'s thread while the request queues and runs. ``record``
runs once the answer is written; a guess not finished by then records when it is.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter
from starlette.requests import Request

from localspec.engine.acceptance import MAX_POSITION, POSITION_LABELS, Acceptance
from localspec.engine.types import GenerationResult
from localspec.language import OTHER, LanguageBook, code_in_chat, from_filename, label
from localspec.rejections import RejectionFile
from localspec.rejections import record as rejection_record
from localspec.server import dispatch

LANG_KEY = "localspec.language"
RECENT = 512  # requests the /stats page keeps (its charts' history)
CODE_TAIL = 1500  # code before the cursor a guess reads
CODE_AHEAD = 500  # and after it
KEY_CHARS = 256  # the code's head: while it stays, a slot keeps its language


@dataclass(frozen=True)
class Point:
    """One finished request, as the /stats page plots it."""

    t: float  # wall clock, seconds
    endpoint: str
    language: str
    latency_ms: float
    predicted: int
    gen_ms: float
    reused: int
    evaluated: int
    drafted: int
    accepted: int
    threads: int
    load: float  # the machine's 1-minute load average when it ended

    @property
    def tokens_per_s(self) -> float:
        return self.predicted / self.gen_ms * 1e3 if self.gen_ms > 0 else 0.0


def _text(value: Any) -> str:
    """A prompt field's text (a list may mix token ids and text: the text parts)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "".join(v for v in value if isinstance(v, str))
    return ""


def _message_texts(messages: Any) -> Iterable[str]:
    if not isinstance(messages, list):
        return
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, str):
            yield content
        elif isinstance(content, list):
            parts = [p for p in content if isinstance(p, dict) and p.get("type") == "text"]
            yield "".join(str(p.get("text", "")) for p in parts)


def _majority(labels: Iterable[str | None]) -> str | None:
    counts: dict[str, int] = {}
    for lb in labels:
        if lb is not None and lb != OTHER:
            counts[lb] = counts.get(lb, 0) + 1
    return max(counts, key=lambda k: counts[k]) if counts else None


class SpecStats:
    """Acceptance by language and position, and the recent requests; thread-safe (the event
    loop records, and so does the guess thread for a request it finished late)."""

    def __init__(
        self,
        registry: CollectorRegistry | None,
        book: LanguageBook | None = None,
        rejections: RejectionFile | None = None,
    ):
        self.book = book or LanguageBook()
        self.rejections = rejections  # where rejected drafts go (opt-in), else None
        self._lock = threading.Lock()
        self.by_language: dict[str, Acceptance] = {}
        self.requests: dict[str, int] = {}
        self.recent: deque[Point] = deque(maxlen=RECENT)
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self._metrics = registry is not None
        if registry is None:
            return
        self.m_requests = Counter(
            "localspec_language_requests",
            "Completion requests by the language of their code",
            ["language"],
            registry=registry,
        )
        self.m_drafts = Counter(
            "localspec_language_drafts",
            "Drafts verified, by language (llama-server: spec_decode_num_drafts)",
            ["language"],
            registry=registry,
        )
        self.m_drafted = Counter(
            "localspec_language_draft_tokens",
            "Drafted tokens, by language",
            ["language"],
            registry=registry,
        )
        self.m_accepted = Counter(
            "localspec_language_draft_tokens_accepted",
            "Drafted tokens the target accepted, by language",
            ["language"],
            registry=registry,
        )
        self.m_reached = Counter(
            "localspec_draft_position_reached",
            "Draft tokens judged at each position (1-based; the ones before it were accepted)",
            ["language", "position"],
            registry=registry,
        )
        self.m_pos_accepted = Counter(
            "localspec_draft_position_accepted",
            "Draft tokens accepted at each position (llama-server: "
            "spec_decode_num_accepted_tokens_per_pos, 0-based there)",
            ["language", "position"],
            registry=registry,
        )

    # ------------------------------------------------------------------ a request's language

    def begin(self, request: Request, body: Any) -> None:
        """Start resolving the language of ``body``'s code (kept in the request's scope)."""
        slot = getattr(body, "id_slot", None)
        slot = -1 if slot is None else slot
        given = label(getattr(body, "language", None)) or from_filename(
            getattr(body, "filename", None)
        )
        fallback = None
        messages = getattr(body, "messages", None)
        if messages is not None:  # chat: the code being edited (a fenced block) or the text
            hint, code = code_in_chat(_message_texts(messages))
            given = given or hint
            key = code[:KEY_CHARS]
            code = code[-(CODE_TAIL + CODE_AHEAD) :]
        elif hasattr(body, "input_prefix"):  # FIM
            prefix = _text(body.input_prefix)
            code = prefix[-CODE_TAIL:] + (body.prompt or "") + _text(body.input_suffix)[:CODE_AHEAD]
            key = prefix[:KEY_CHARS] + "\0" + _text(body.input_suffix)[-KEY_CHARS:]
            fallback = _majority(from_filename(c.filename) for c in body.input_extra or ())
        else:
            prompt = _text(getattr(body, "prompt", ""))
            code = prompt[-CODE_TAIL:] + (getattr(body, "suffix", None) or "")[:CODE_AHEAD]
            key = prompt[:KEY_CHARS]
        request.scope[LANG_KEY] = self.book.resolve(
            slot, given=given, code=code, key_text=key, fallback=fallback
        )

    @staticmethod
    def language(request: Request) -> str | None:
        """The request's language if known by now (None: no code, or the guess is running)."""
        future: Future[str] | None = request.scope.get(LANG_KEY)
        if future is None or not future.done() or future.exception() is not None:
            return None
        return future.result()

    # ------------------------------------------------------------------ recording

    def record(
        self,
        request: Request,
        endpoint: str,
        runs: list[GenerationResult],
        *,
        latency_s: float,
    ) -> None:
        """One answered request: into the request log now, into the counters once its
        language is known."""
        future: Future[str] | None = request.scope.get(LANG_KEY)
        if future is None:
            return
        acc = Acceptance()
        for r in runs:
            acc.merge(Acceptance.of_steps(r.spec_steps))
        entry = request.scope.get(dispatch.LOG_KEY)  # the request's log line (logs.RequestLog)
        lang = self.language(request)
        if entry is not None and lang is not None:
            entry.extra["language"] = lang
        if entry is not None and acc.drafts:
            # the positions where drafts were first rejected, 1-based: "3:6,1:1" reads
            # "6 drafts cut at position 3, one at 1" (a dict would nest in a JSON log line)
            at = zip(POSITION_LABELS, acc.rejected_at, strict=True)
            entry.extra["rejected_at"] = ",".join(f"{lb}:{n}" for lb, n in at if n) or "-"
        first = runs[0] if runs else None
        point = {
            "t": time.time(),
            "endpoint": endpoint,
            "latency_ms": latency_s * 1e3,
            "predicted": sum(len(r.tokens) for r in runs),
            "gen_ms": max((r.predicted_ms for r in runs), default=0.0),
            "reused": first.n_cached if first else 0,
            "evaluated": first.n_evaluated if first else 0,
            "drafted": acc.drafted,
            "accepted": acc.accepted,
            "threads": runs[-1].threads[0] if runs else 0,
            "load": os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0,
        }

        cut = [x for r in runs for x in r.rejections]
        t_now = point["t"]

        def count(f: Future[str]) -> None:
            language = OTHER if f.exception() is not None else f.result()
            self._count(Point(language=language, **point), acc)
            if self.rejections is not None and cut:
                lines = [rejection_record(x, language, t_now) for x in cut]
                self.book.later(self.rejections.append, lines)  # file writes off the loop

        future.add_done_callback(count)

    def _child(self, metric: Any, *labels: str) -> Any:
        key = (id(metric), labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found

    def _count(self, point: Point, acc: Acceptance) -> None:
        lang = point.language
        with self._lock:
            self.recent.append(point)
            self.requests[lang] = self.requests.get(lang, 0) + 1
            self.by_language.setdefault(lang, Acceptance()).merge(acc)
            if not self._metrics:
                return
            child = self._child
            child(self.m_requests, lang).inc()
            if not acc.drafts:
                return
            child(self.m_drafts, lang).inc(acc.drafts)
            child(self.m_drafted, lang).inc(acc.drafted)
            child(self.m_accepted, lang).inc(acc.accepted)
            for i in range(MAX_POSITION):
                if acc.reached[i]:
                    child(self.m_reached, lang, POSITION_LABELS[i]).inc(acc.reached[i])
                if acc.accepted_at[i]:
                    child(self.m_pos_accepted, lang, POSITION_LABELS[i]).inc(acc.accepted_at[i])

    # ------------------------------------------------------------------ reading

    def snapshot(self, since: float = 0.0) -> dict[str, Any]:
        """Acceptance by language and position, and the requests that ended after ``since``."""
        with self._lock:
            total = Acceptance()
            for acc in self.by_language.values():
                total.merge(acc)
            languages = {
                lang: {"requests": self.requests.get(lang, 0), **acc.to_json()}
                for lang, acc in sorted(self.by_language.items())
            }
            recent = [
                {**asdict(p), "tokens_per_s": round(p.tokens_per_s, 2)}
                for p in self.recent
                if p.t > since
            ]
        return {"languages": languages, "total": total.to_json(), "recent": recent}
