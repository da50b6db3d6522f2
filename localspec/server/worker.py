"""The one thread that owns the engine: loads it, then runs queued jobs one at a time.

HTTP handlers never touch llama.cpp; they submit a :class:`Job` and await its future. The
queue is bounded (past ``queue_limit`` a submit raises 503 with Retry-After), a job whose
client left is dropped before it runs, a newer job pinned to a slot supersedes older queued
jobs for that slot, and a running job's cancel event stops the engine within one step.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol

from localspec.engine.types import Cancel, GenerationRequest, GenerationResult, TokenEvent
from localspec.server.errors import ContextExceeded, Unavailable
from localspec.server.logs import REQUESTS
from localspec.server.params import TaskParams
from localspec.server.prompts import truncate
from localspec.server.results import Completion
from localspec.server.slots import SlotInfo, choose_slot, pinned_slot

log = logging.getLogger("localspec.server")
# a request cut short is logged by its route when the client leaves, before the engine has
# stopped: what the engine did with it (work kept in the cache) is logged here
_requests_log = logging.getLogger(REQUESTS)

MIN_CALL_QUEUE = 16  # tokenize/detokenize calls that may wait (at least; else queue_limit)


class EngineLike(Protocol):
    """The part of localspec.engine.Engine the worker uses."""

    n_ctx: int
    n_slots: int

    def slot_tokens(self, slot: int) -> list[int]: ...  # a fresh list, the caller keeps it

    def generate(
        self,
        req: GenerationRequest,
        *,
        cancel: Cancel | None = None,
        on_token: Callable[[TokenEvent], None] | None = None,
        prefill_cancel: Cancel | None = None,
    ) -> GenerationResult: ...


TokenSink = Callable[[int, TokenEvent], None]  # (completion index, event), on the worker thread


@dataclass(eq=False)
class Job:
    params: TaskParams
    prepare: Callable[[Any], list[int]]  # builds the prompt tokens, on the worker thread
    detokenize: Callable[[list[int]], str] | None = None  # set when the answer shows the prompt
    on_token: TokenSink | None = None
    cancel: threading.Event = field(default_factory=threading.Event)
    future: Future[JobResult] = field(default_factory=Future)
    t_submit: float = field(default_factory=time.perf_counter)
    slot: int = -1  # set by the worker before the first token is streamed
    n_prompt: int = 0
    truncate: bool = False  # a prompt longer than the context is cut (llama-server's rule)
    stopped_by: str = ""  # why the worker cancelled it while running (else: the client left)

    @property
    def cache_only(self) -> bool:
        return self.params.request.n_predict == 0


@dataclass
class JobResult:
    completions: list[Completion]
    n_prompt: int = 0
    cancelled: str | None = None  # why it stopped early: "client left", "superseded", ...
    t_queue_ms: float = 0.0
    t_prep_ms: float = 0.0
    t_engine_ms: float = 0.0
    t_post_ms: float = 0.0  # after the engine: slot bookkeeping, the prompt's text
    t_done: float = 0.0  # perf_counter when the worker handed the result over


State = Literal["loading", "ready", "failed", "stopping", "stopped"]


class Worker:
    def __init__(
        self,
        load: Callable[[], Any],
        *,
        queue_limit: int = 16,
        on_ready: Callable[[], None] | None = None,
        on_failure: Callable[[BaseException], None] | None = None,
    ) -> None:
        self._load = load
        self._queue_limit = queue_limit
        self._on_ready = on_ready
        self._on_failure = on_failure
        self._cond = threading.Condition()
        self._queue: deque[Job] = deque()
        self._calls: deque[_Call] = deque()
        self._running: Job | None = None
        self._thread = threading.Thread(target=self._main, name="localspec-engine", daemon=True)
        self.state: State = "loading"
        self.error: BaseException | None = None
        self.engine: Any = None
        self.slots: list[SlotInfo] = []
        self.n_done = 0
        self.n_cancelled = 0  # jobs that ended early: client left, superseded, timed out
        # prompt tokens the engine evaluated for every job, those the client left included
        self.n_prompt_evaluated = 0

    # ------------------------------------------------------------------ control

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel everything, let the thread free the models, wait for it."""
        with self._cond:
            if self.state in ("loading", "ready"):
                self.state = "stopping"
            for job in self._queue:
                _finish(job, JobResult([], cancelled="server shutting down"))
            self._queue.clear()
            for call in self._calls:
                call.future.set_exception(Unavailable("Server is stopping"))
            self._calls.clear()
            if self._running is not None:
                self._running.cancel.set()
            self._cond.notify_all()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def cancel_running(self) -> None:
        with self._cond:
            if self._running is not None:
                self._running.cancel.set()

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def busy(self) -> bool:
        return self._running is not None

    # ------------------------------------------------------------------ submit

    def submit(self, job: Job) -> None:
        """Queue a job; raises Unavailable when not ready or when the queue is full."""
        with self._cond:
            if self.state != "ready":
                loading = self.state == "loading"
                raise Unavailable("Loading model" if loading else "Server is stopping")
            self._supersede(job)
            if len(self._queue) >= self._queue_limit and (self._running or self._queue):
                raise Unavailable(
                    f"Server busy: {len(self._queue)} requests are queued; retry shortly",
                    headers={"Retry-After": "1"},
                )
            job.t_submit = time.perf_counter()  # queued now: "parse" ends, "queue" starts
            self._queue.append(job)
            self._cond.notify()

    def call(self, fn: Callable[[Any], Any]) -> Future[Any]:
        """Run ``fn(engine)`` on the worker thread ahead of queued jobs (tokenize, detokenize).

        The vocabulary's helpers share buffers, so even cheap calls go through the owner thread.
        """
        call = _Call(fn)
        with self._cond:
            if self.state != "ready":
                raise Unavailable(
                    "Loading model" if self.state == "loading" else "Server is stopping"
                )
            if len(self._calls) >= max(MIN_CALL_QUEUE, self._queue_limit):
                # calls wait behind a running generation: bound them like the jobs
                raise Unavailable(
                    f"Server busy: {len(self._calls)} tokenizer calls are queued; retry shortly",
                    headers={"Retry-After": "1"},
                )
            self._calls.append(call)
            self._cond.notify()
        return call.future

    def abandon(self, job: Job, reason: str = "client left") -> None:
        """The client is gone: drop the job if queued, stop it within one step if running."""
        job.cancel.set()
        with self._cond:
            if job in self._queue:
                self._queue.remove(job)
                _finish(job, JobResult([], cancelled=reason))
                self.n_cancelled += 1

    def others_wait(self) -> bool:
        """A live job or a tokenizer call is queued (or the worker is stopping)."""
        with self._cond:
            return (
                self.state == "stopping"
                or bool(self._calls)
                or any(not q.cancel.is_set() for q in self._queue)
            )

    def _supersede(self, job: Job) -> None:
        """A newer job pinned to a slot replaces older queued ones for that slot.

        A cache warm-up (n_predict 0) only replaces other warm-ups: a client still waiting
        for a completion must not lose it to a background cache fill. A completion also stops
        a warm-up *running* on its slot: the editor's warm-up caches the ring buffer that
        heads the completion's own prompt, so the completion's prefill takes over from where
        the warm-up got to, instead of the keystroke waiting seconds behind it.
        """
        n_slots = max(1, len(self.slots))
        slot = pinned_slot(job.params.id_slot, n_slots)
        if slot is None:
            return
        running = self._running
        if (
            not job.cache_only
            and running is not None
            and running.cache_only
            and pinned_slot(running.params.id_slot, n_slots) == slot
        ):
            running.stopped_by = "superseded by a completion for the same slot"
            running.cancel.set()
        stale = [
            q
            for q in self._queue
            if pinned_slot(q.params.id_slot, n_slots) == slot
            and (not job.cache_only or q.cache_only)
        ]
        for q in stale:
            self._queue.remove(q)
            q.cancel.set()
            _finish(q, JobResult([], cancelled="superseded by a newer request for the same slot"))
            self.n_cancelled += 1

    # ------------------------------------------------------------------ thread

    def _main(self) -> None:
        try:
            engine = self._load()
        except BaseException as exc:  # reported to the caller, never raised here
            if self._on_failure is None:
                log.error("the model failed to load: %s", exc)
            with self._cond:
                self.error = exc
                self.state = "failed"
            if self._on_failure is not None:
                self._on_failure(exc)
            return
        with self._cond:
            self.engine = engine
            self.slots = [
                SlotInfo(id=i, n_ctx=engine.n_ctx, tokens=[]) for i in range(engine.n_slots)
            ]
            stopping = self.state == "stopping"
            if not stopping:
                self.state = "ready"
        if not stopping and self._on_ready is not None:
            self._on_ready()
        while (job := self._take()) is not None:
            if isinstance(job, _Call):
                job.run(engine)
                continue
            try:
                result = self._run(job)
            except BaseException as exc:  # one request's failure, not the daemon's
                if not isinstance(exc, (Unavailable, ContextExceeded)):
                    log.exception("request failed")
                if not job.future.done():
                    job.future.set_exception(exc)
            else:
                self.n_prompt_evaluated += sum(c.result.n_evaluated for c in result.completions)
                _finish(job, result)
                if result.cancelled:
                    self.n_cancelled += 1
                    _log_cut_short(job, result)
            finally:
                with self._cond:
                    self._running = None
                    self.n_done += 1
        self._close(engine)

    def _take(self) -> Job | _Call | None:
        with self._cond:
            while True:
                if self.state == "stopping":
                    return None
                if self._calls:
                    return self._calls.popleft()
                while self._queue:
                    job = self._queue.popleft()
                    if job.cancel.is_set():
                        _finish(job, JobResult([], cancelled="client left"))
                        self.n_cancelled += 1
                        continue
                    self._running = job
                    return job
                self._cond.wait()

    def _close(self, engine: Any) -> None:
        close = getattr(engine, "close", None)
        try:
            if callable(close):
                close()
        finally:
            with self._cond:
                self.engine = None
                self.state = "stopped"

    def _run(self, job: Job) -> JobResult:
        engine = self.engine
        t_start = time.perf_counter()
        out = JobResult([], t_queue_ms=(t_start - job.t_submit) * 1e3)
        params = job.params
        prompt = job.prepare(engine)
        n_ctx = engine.n_ctx
        truncated = len(prompt) >= n_ctx
        if truncated:
            if not job.truncate:
                raise ContextExceeded(len(prompt), n_ctx)
            n_before = len(prompt)
            prompt = truncate(prompt, n_ctx, params.n_keep)
            log.info("prompt of %d tokens truncated to %d (n_ctx %d)", n_before, len(prompt), n_ctx)
        out.n_prompt = len(prompt)
        out.t_prep_ms = (time.perf_counter() - t_start) * 1e3
        slot_id = choose_slot(prompt, self.slots, params.id_slot)
        job.slot, job.n_prompt = slot_id, len(prompt)
        slot = self.slots[slot_id]
        slot.is_processing = True
        seeds = params.seeds()
        try:
            for index in range(params.n_cmpl):
                if job.cancel.is_set():
                    out.cancelled = job.stopped_by or "client left"
                    break
                if not prompt:  # llama-server answers an empty prompt with an empty completion
                    result = GenerationResult(tokens=[], text="", stop_type="none")
                else:
                    req = params.request_for(index, seeds, slot_id, prompt)
                    room = n_ctx - len(prompt)
                    if req.n_predict > room:  # the context ends first: say so up front
                        req = replace(req, n_predict=room)
                    on_token = _bind(job.on_token, index)
                    t0 = time.perf_counter()
                    try:
                        result = engine.generate(
                            req,
                            cancel=job.cancel,
                            on_token=on_token,
                            prefill_cancel=_UntilOthersWait(job, self),
                        )
                    except BaseException:
                        self._reset_slot(slot)  # its cache may be half-written: start it afresh
                        raise
                    finally:
                        out.t_engine_ms += (time.perf_counter() - t0) * 1e3
                slot.tokens = engine.slot_tokens(slot_id)  # a copy already: ~6k ids, not twice
                slot.last_prompt_n, slot.last_cache_n = result.n_evaluated, result.n_cached
                hit_end = (
                    result.stop_type == "limit" and len(prompt) + len(result.tokens) >= n_ctx - 1
                )
                out.completions.append(
                    Completion(
                        result,
                        index,
                        slot_id,
                        len(slot.tokens),
                        truncated=truncated or hit_end,
                    )
                )
                if result.cancelled:
                    out.cancelled = job.stopped_by or "client left"
                    break
                if params.request.n_predict == 0:
                    break  # a warm-up fills the cache once; more copies would do nothing
        finally:
            slot.is_processing = False
            slot.last_used = time.monotonic()
            slot.n_requests += 1
        t_post = time.perf_counter()
        if job.detokenize is not None and out.completions:
            text = job.detokenize(prompt)
            for done in out.completions:
                done.prompt_text = text
        out.t_post_ms = (time.perf_counter() - t_post) * 1e3
        return out

    def _reset_slot(self, slot: SlotInfo) -> None:
        slot.tokens = []
        clear = getattr(self.engine, "clear_slot", None)
        if callable(clear):
            try:
                clear(slot.id)
            except Exception:
                log.exception("could not clear slot %d after a failed request", slot.id)


class _Call:
    def __init__(self, fn: Callable[[Any], Any]) -> None:
        self.fn = fn
        self.future: Future[Any] = Future()

    def run(self, engine: Any) -> None:
        try:
            self.future.set_result(self.fn(engine))
        except BaseException as exc:
            self.future.set_exception(exc)


def _bind(sink: TokenSink | None, index: int) -> Callable[[TokenEvent], None] | None:
    if sink is None:
        return None
    return lambda event: sink(index, event)


def _finish(job: Job, result: JobResult) -> None:
    if not job.future.done():
        result.t_done = time.perf_counter()
        job.future.set_result(result)


@dataclass
class _UntilOthersWait:
    """The prompt of a job whose client left is evaluated on, as a cache fill, until someone
    else waits: the next keystroke's prompt starts with the same tokens (everything but the
    cursor line, which sits at the end), so this is work it would otherwise queue behind and
    redo, and the engine would idle until it came. A job the worker itself stopped
    (``stopped_by``) stops at once. Checked between prompt chunks, never during generation."""

    job: Job
    worker: Worker

    def is_set(self) -> bool:
        if not self.job.cancel.is_set():
            return False
        return bool(self.job.stopped_by) or self.worker.others_wait()


def _log_cut_short(job: Job, result: JobResult) -> None:
    if not result.completions or not _requests_log.isEnabledFor(logging.INFO):
        return
    r = result.completions[-1].result
    fields = {"slot": job.slot, "n_prompt": result.n_prompt, "evaluated": r.n_evaluated,
              "reused": r.n_cached, "predicted": len(r.tokens),
              "engine_ms": round(result.t_engine_ms, 2)}  # fmt: skip
    text = " ".join(f"{k}={v}" for k, v in fields.items())
    fields.update(outcome="engine stopped", why=result.cancelled)
    _requests_log.info(
        "engine stopped a cut-short request (%s): %s", result.cancelled, text,
        extra={"fields": fields},
    )  # fmt: skip
