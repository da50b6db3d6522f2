"""The thread that owns the engines: loads a model, then starts jobs and runs the engine's steps.

HTTP handlers never touch llama.cpp; they submit a :class:`Job` and await its future. Jobs on
different slots run at the same time (the engine puts all their sequences in one batch per
step); a job waits in the queue while its slot is busy. The queue is bounded (past
``queue_limit`` a submit raises 503 with Retry-After), a job whose client left is dropped
before it starts, a newer job pinned to a slot supersedes the cache warm-ups queued for that
slot, and a running job's cancel event stops its sequences within one step.

A daemon's workers (the completion pair's and a chat pair's) share one :class:`EngineThread`:
every llama.cpp call of the daemon runs on it, one worker's turn after another's.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Generic, Literal, TypeVar

from localspec.engine.api import ServedEngine
from localspec.engine.cache_plan import choose_slot, pinned_slot
from localspec.engine.hostcache import Recall
from localspec.engine.slot import Slot, Task
from localspec.engine.types import GenerationRequest, GenerationResult, PromptLayout, TokenEvent
from localspec.server.errors import ContextExceeded, InvalidRequest, Unavailable
from localspec.server.jump import PromptBudget, ShortPrompt, short_prompt
from localspec.server.logs import REQUESTS
from localspec.server.prompts import truncate
from localspec.server.requests import TaskParams
from localspec.server.results import FinishedCompletion
from localspec.settings import JumpPolicy, SlotRule

log = logging.getLogger("localspec.server")
# a request cut short is logged by its route when the client leaves, before the engine has
# stopped: what the engine did with it (work kept in the cache) is logged here
_requests_log = logging.getLogger(REQUESTS)

MIN_CALL_QUEUE = 16  # tokenize/detokenize calls that may wait (at least; else queue_limit)
T = TypeVar("T")


TokenSink = Callable[[int, TokenEvent], None]  # (completion index, event), on the worker thread


@dataclass(eq=False)
class Job:
    params: TaskParams
    prepare: Callable[[ServedEngine], PromptLayout]  # builds the prompt, on the worker thread
    detokenize: Callable[[list[int]], str] | None = None  # set when the answer shows the prompt
    on_token: TokenSink | None = None
    cancel: threading.Event = field(default_factory=threading.Event)
    future: Future[JobResult] = field(default_factory=Future)
    t_submit: float = field(default_factory=time.perf_counter)
    slot: int = -1  # set by the worker before the first token is streamed (or when it waits)
    n_prompt: int = 0
    truncate: bool = False  # a prompt longer than the context is cut (llama-server's rule)
    stopped_by: str = ""  # why the worker cancelled it while running (else: the client left)
    # while it runs: what it is filling in, and when the engine took it
    out: JobResult | None = None
    prompt: list[int] = field(default_factory=list)
    layout: PromptLayout | None = None  # the prompt built (and cut to fit), kept while it waits
    cut: bool = False  # the prompt was longer than the context and cut
    t_start: float = 0.0
    on_slot: bool = False  # it took its slot: a failure there leaves the slot's cache suspect
    # the code's language, resolved beside the queue (server/speculation.py); the engine
    # gets it when it is known by the time the job starts
    language: Future[str] | None = None
    # the cursor's nearest lines as a prompt of a given window (/infill: a budget answer's)
    short: ShortPrompt | None = None
    # started while its slot fills a cache (a warm-up, a budget answer's fill): it answers
    # apart or goes back to wait for the slot (once)
    beside: bool = False
    beside_tried: bool = False

    @property
    def cache_only(self) -> bool:
        return self.params.request.n_predict == 0


@dataclass
class JobResult:
    completions: list[FinishedCompletion]
    n_prompt: int = 0
    truncated: bool = False  # the prompt was cut to fit the context
    cancelled: str | None = None  # why it stopped early: "client left", "superseded", ...
    t_queue_ms: float = 0.0
    t_prep_ms: float = 0.0
    t_engine_ms: float = 0.0
    t_post_ms: float = 0.0  # after the engine: slot bookkeeping, the prompt's text
    t_done: float = 0.0  # perf_counter when the worker handed the result over
    recall: Recall | None = None  # a context the host cache stashed/restored before it ran
    budget: PromptBudget | None = None  # answered from the nearest lines (server/jump.py)


State = Literal["loading", "ready", "failed", "stopping", "stopped"]


class EngineThread:
    """The one thread that makes a daemon's llama.cpp calls: it loads each worker's model, one
    after the other, then runs every loaded worker's calls, job starts and engine step, one
    worker's turn after another's. (A pipelined draft's thread is its request's own, beside
    its engine's steps, and ends with the request.)

    Why one thread, loads included. Each thread that calls llama.cpp keeps an OpenMP team of
    its own: with a chat model's worker on a second thread, the process held more OpenMP
    threads than cores once chat had answered, libgomp then cut every barrier's spin short,
    and the completion engine decoded far slower for the rest of the daemon's life
    (bench/results/throughput/history-22-*.json). And with the two models loading on two
    threads at once, daemons crashed (SIGSEGV in the CPU backend's matrix multiply) on their
    first chat request, whether or not their decodes took turns; with every call on one
    thread, none did (docs/engine.md, "One process, one engine thread"). The daemon answers
    nothing until both models are loaded, so loading them in turn costs no request anything.

    The thread runs while a worker is loading or loaded and not stopped, and starts again for
    the next.
    """

    def __init__(self, name: str = "localspec-engine") -> None:
        self.name = name
        self.cond = threading.Condition()  # the workers' lock: a submit to any wakes the thread
        self._loads: deque[Worker] = deque()  # started, not loaded yet: loaded in this order
        self._workers: list[Worker] = []
        self._thread: threading.Thread | None = None

    def load(self, worker: Worker) -> None:
        """Load the worker's model (after those already waiting), then run its turns."""
        with self.cond:
            self._loads.append(worker)
            if self._thread is None:
                self._thread = threading.Thread(target=self._main, name=self.name, daemon=True)
                self._thread.start()
            self.cond.notify_all()

    def is_current(self) -> bool:
        return threading.current_thread() is self._thread

    def _main(self) -> None:
        while True:
            with self.cond:
                while True:
                    if self._loads:
                        loading = self._loads.popleft()
                        break
                    loading = None
                    if not self._workers:
                        self._thread = None
                        return
                    turns = [(w, w.next_turn()) for w in self._workers]
                    due = [(w, t) for w, t in turns if t is not None]
                    if due:
                        break
                    self.cond.wait()
            if loading is not None:
                if loading.load_here():
                    with self.cond:
                        self._workers.append(loading)
                continue
            for worker, turn in due:
                if not worker.play(turn):
                    with self.cond:
                        self._workers.remove(worker)


@dataclass
class _Turn:
    """What a worker does in its next turn (chosen under the lock, done outside it)."""

    calls: list[_Call] = field(default_factory=list)
    starts: list[Job] = field(default_factory=list)
    stop: bool = False


class Worker:
    def __init__(
        self,
        load: Callable[[], ServedEngine],
        *,
        queue_limit: int = 16,
        on_ready: Callable[[], None] | None = None,
        on_failure: Callable[[BaseException], None] | None = None,
        engine_thread: EngineThread | None = None,
        slot_choice: SlotRule = "pinned",
        before_close: Callable[[ServedEngine], object] | None = None,
        jump_policy: JumpPolicy = "wait",
    ) -> None:
        """``slot_choice`` (``server.slot_choice``): pinned, a request's ``id_slot`` picks its
        slot (llama-server's rule); cache, it only breaks ties, and the slot whose cache holds
        most of the prompt answers (``cache_plan.choose_slot``). ``before_close``: run on the
        engine before it is freed (the slots' contexts kept for the next start, server/keep.py).
        ``jump_policy`` (``cache.jump_policy``): budget, a prompt the slot lacks too much of
        for ``t_max_prompt_ms`` is answered from its nearest lines (server/jump.py)."""
        self._before_close = before_close
        self._jump_policy = jump_policy
        self._load = load
        self._queue_limit = queue_limit
        self._follow_pins = slot_choice == "pinned"
        self._on_ready = on_ready
        self._on_failure = on_failure
        self._engine_thread = engine_thread or EngineThread()
        self._cond = self._engine_thread.cond
        self._queue: deque[Job] = deque()
        self._calls: deque[_Call] = deque()
        self._started = False
        self._stopped = threading.Event()  # the engine is closed (or was never loaded)
        self.state: State = "loading"
        self.error: BaseException | None = None
        self.engine: ServedEngine | None = None
        self.n_done = 0
        self.n_cancelled = 0  # jobs that ended early: client left, superseded, timed out
        # prompt tokens the engine evaluated for every job, those the client left included
        self.n_prompt_evaluated = 0
        self.n_budget = 0  # answers made from the nearest lines (server/jump.py)

    # ------------------------------------------------------------------ control

    def start(self) -> None:
        """Queue the model's load on the engine thread."""
        with self._cond:
            self._started = True
        self._engine_thread.load(self)

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
            for job in self.running_jobs():
                job.cancel.set()
            self._cond.notify_all()
        if self._started and not self._engine_thread.is_current():
            self._stopped.wait(timeout)

    def cancel_running(self) -> None:
        with self._cond:
            for job in self.running_jobs():
                job.cancel.set()

    def job_on(self, slot: int) -> Job | None:
        """The job whose task runs (or is about to start) on ``slot``: the engine's slot
        holds it."""
        slots = self.slots
        task = slots[slot].task if 0 <= slot < len(slots) else None
        owner = task.owner if task is not None else None
        return owner if isinstance(owner, Job) else None

    def running_jobs(self) -> list[Job]:
        """The jobs on the engine's slots, by slot."""
        jobs = (self.job_on(slot) for slot in range(len(self.slots)))
        return [job for job in jobs if job is not None]

    @property
    def slots(self) -> Sequence[Slot]:
        """The engine's slots (none before it loads): what each holds and runs."""
        engine = self.engine
        return () if engine is None else engine.slots

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def busy(self) -> bool:
        return any(slot.is_processing for slot in self.slots)

    # ------------------------------------------------------------------ submit

    def submit(self, job: Job) -> None:
        """Queue a job; raises Unavailable when not ready or when the queue is full."""
        with self._cond:
            if self.state != "ready":
                loading = self.state == "loading"
                raise Unavailable("Loading model" if loading else "Server is stopping")
            self._supersede(job)
            full = len(self._queue) >= self._queue_limit
            if full and (self._queue or self.busy):
                raise Unavailable(
                    f"Server busy: {len(self._queue)} requests are queued; retry shortly",
                    headers={"Retry-After": "1"},
                )
            job.t_submit = time.perf_counter()  # queued now: "parse" ends, "queue" starts
            self._queue.append(job)
            self._cond.notify_all()

    def call(self, fn: Callable[[ServedEngine], T]) -> Future[T]:
        """Run ``fn(engine)`` on the worker thread ahead of queued jobs (tokenize, detokenize).

        The vocabulary's helpers share buffers, so even cheap calls go through the owner thread.
        """
        call: _Call[T] = _Call(fn)
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
            self._cond.notify_all()
        return call.future

    def abandon(self, job: Job, reason: str = "client left") -> None:
        """The client is gone: drop the job if queued, stop it within one step if running."""
        job.cancel.set()
        with self._cond:
            if job in self._queue:
                self._queue.remove(job)
                _finish(job, JobResult([], cancelled=reason))
                self.n_cancelled += 1

    def others_wait(self, slot: int) -> bool:
        """A live job or a tokenizer call is queued, the engine has other work than this
        slot's (or the worker is stopping)."""
        with self._cond:
            if (
                self.state == "stopping"
                or bool(self._calls)
                or any(not q.cancel.is_set() for q in self._queue)
            ):
                return True
        engine = self.engine
        return engine is not None and engine.busy_besides(slot)

    def _supersede(self, job: Job) -> None:
        """A newer job pinned to a slot replaces the cache warm-ups (n_predict 0) queued for
        that slot, and a completion also stops a warm-up *running* there: the editor's
        warm-up caches the ring buffer that heads the completion's own prompt, so the
        completion's prefill takes over from where the warm-up got to, instead of the
        keystroke waiting seconds behind it.

        A queued completion is never dropped: llama-vscode and llama.vim both pin slot 0, so
        a newer completion for the slot may be another editor's, and the editor whose own
        request went stale cancels it itself (closing its connection drops it here).

        With slot choice (pins not followed) the pin names no editor, so a running warm-up is
        not stopped here (it may be the other editor's): a completion stops its own editor's
        warm-up on the slot it chooses (``_wait_for_slot``). Queued warm-ups still give way.
        """
        n_slots = max(1, len(self.slots))
        slot = pinned_slot(job.params.id_slot, n_slots)
        if slot is None:
            return
        running = self.job_on(slot) if self._follow_pins else None
        if not job.cache_only and running is not None and running.cache_only:
            running.stopped_by = "superseded by a completion for the same slot"
            running.cancel.set()
        stale = [
            q
            for q in self._queue
            if pinned_slot(q.params.id_slot, n_slots) == slot and q.cache_only
        ]
        for q in stale:
            self._queue.remove(q)
            q.cancel.set()
            _finish(q, JobResult([], cancelled="superseded by a newer request for the same slot"))
            self.n_cancelled += 1

    # ------------------------------------------------------------------ thread

    def load_here(self) -> bool:
        """On the engine thread: load the model; True when the worker is ready to serve."""
        with self._cond:
            if self.state == "stopping":  # stopped before its turn to load
                self.state = "stopped"
                self._stopped.set()
                return False
        try:
            engine = self._load()
        except BaseException as exc:  # reported to the caller, never raised here
            if self._on_failure is None:
                log.error("the model failed to load: %s", exc)
            with self._cond:
                self.error = exc
                self.state = "failed"
            self._stopped.set()
            if self._on_failure is not None:
                self._on_failure(exc)
            return False
        with self._cond:
            self.engine = engine
            stopping = self.state == "stopping"
            if not stopping:
                self.state = "ready"
        if stopping:
            self._close(engine)
            return False
        if self._on_ready is not None:
            self._on_ready()
        return True

    def next_turn(self) -> _Turn | None:
        """Under the lock, on the engine thread: the queued calls, the jobs whose slots are
        free, and whether the engine has a step to run; None when there is nothing to do."""
        if self.state == "stopping":
            return _Turn(stop=True)
        calls = list(self._calls)
        self._calls.clear()
        starts = self._startable()
        assert self.engine is not None  # (loaded: only a loaded worker takes turns)
        if calls or starts or self.engine.busy:
            return _Turn(calls, starts)
        return None

    def play(self, turn: _Turn) -> bool:
        """On the engine thread: run the turn's calls, start its jobs, then one engine step.
        False once the worker has stopped (its engine closed)."""
        engine = self.engine
        assert engine is not None
        if turn.stop:
            self._close(engine)
            return False
        try:
            for call in turn.calls:
                call.run(engine)
            for job in turn.starts:
                self._start(engine, job)
            if engine.busy:
                try:
                    engine.step()
                except Exception as exc:  # a bug: the requests fail, the daemon goes on
                    log.exception("an engine step failed; failing the requests it held")
                    engine.abort(exc)
        except BaseException:  # a bug outside the step: this worker stops, the others go on
            log.exception("the engine worker failed; closing its model")
            self._close(engine)
            return False
        return True

    def _startable(self) -> list[Job]:
        """Under the lock: queued jobs that can start now (their slot is free), in order; a
        job whose client left is dropped."""
        starts: list[Job] = []
        n_slots = max(1, len(self.slots))
        free = [s.id for s in self.slots if not s.is_processing]
        for job in list(self._queue):
            if job.cancel.is_set():
                self._queue.remove(job)
                _finish(job, JobResult([], cancelled="client left"))
                self.n_cancelled += 1
                continue
            pinned = job.slot if job.slot >= 0 else None  # the slot it chose to wait for
            if pinned is None and self._follow_pins:
                pinned = pinned_slot(job.params.id_slot, n_slots)
            if pinned is None and free:
                job.slot = -1  # any free slot: the one whose cache fits best, at start
            elif pinned is not None and pinned in free:
                job.slot = pinned
            elif (beside := self._beside(job, pinned, n_slots)) is not None:
                job.slot, job.beside = beside, True  # (the slot stays busy: no free one taken)
                self._queue.remove(job)
                starts.append(job)
                continue
            else:
                continue
            self._queue.remove(job)
            if job.slot >= 0:
                free.remove(job.slot)
            else:
                free.pop()  # reserves one: the choice among the free ones comes at start
            starts.append(job)
        return starts

    def _beside(self, job: Job, pinned: int | None, n_slots: int) -> int | None:
        """Under ``budget``: the busy slot a completion may answer beside, apart, now: one
        filling a cache (an editor's warm-up, a budget answer's fill), which it would
        otherwise wait for (seconds after a jump); None: it waits."""
        if self._jump_policy != "budget" or job.short is None or job.cache_only:
            return None
        slot = pinned if pinned is not None else (0 if n_slots == 1 else None)
        if job.beside_tried or slot is None:
            return None
        task = self.slots[slot].task
        if task is None or not (task.behind or task.first.n_predict == 0):
            return None
        return slot

    def _close(self, engine: ServedEngine) -> None:
        running = self.running_jobs()
        for job in running:
            job.cancel.set()
        try:
            if self._before_close is not None:
                try:
                    self._before_close(engine)
                except Exception:  # costs the next start speed, never the shutdown
                    log.exception("before closing the engine")
            engine.close()
        finally:
            with self._cond:
                for job in running:
                    _finish(job, JobResult([], cancelled="server shutting down"))
                self.engine = None
                self.state = "stopped"
            self._stopped.set()

    def _start(self, engine: ServedEngine, job: Job) -> None:
        """Build the job's prompt and hand its completions to the engine."""
        job.t_start = time.perf_counter()
        out = job.out = JobResult([], t_queue_ms=(job.t_start - job.t_submit) * 1e3)
        try:
            params = job.params
            n_ctx = engine.n_ctx
            if job.layout is None:
                job.layout = self._layout(engine, job)
            layout = job.layout
            prompt = layout.tokens
            out.truncated = job.cut
            job.prompt = prompt
            out.n_prompt = len(prompt)
            out.t_prep_ms = (time.perf_counter() - job.t_start) * 1e3
            if job.slot < 0 and self._wait_for_slot(job, prompt):
                return
            slot_id = job.slot
            job.n_prompt = len(prompt)
            job.on_slot = not job.beside  # (beside a busy slot it only answers apart)
            if not prompt:  # llama-server answers an empty prompt with an empty completion
                empty = GenerationResult(tokens=[], text="", stop_type="none")
                self._done(job, [empty], None)
                return
            recall = getattr(engine, "recall", None)  # the host cache (engine/hostcache.py)
            if recall is not None and not job.beside:
                # (cache_prompt false evaluates the prompt afresh: keep the old context, only)
                out.recall = recall(slot_id, layout, restore=params.request.cache_prompt)
            seeds = params.seeds()
            # a warm-up fills the cache once; more copies would do nothing
            n = 1 if params.request.n_predict == 0 else params.n_cmpl
            room = n_ctx - len(prompt)
            language = _known(job.language)
            reqs = []
            for index in range(n):
                req = params.request_for(index, seeds, slot_id, layout)
                if req.n_predict > room:  # the context ends first: say so up front
                    req = replace(req, n_predict=room)
                if language is not None:
                    req = replace(req, language=language)
                reqs.append(req)
            jump = self._jump(engine, job, layout, slot_id)
            if jump is not None:
                self._answer_apart(engine, job, reqs, *jump)
                return
            if job.beside:  # the whole prompt fits the budget: it waits for the slot
                job.beside, job.beside_tried = False, True
                with self._cond:
                    self._queue.appendleft(job)
                return
            engine.submit(
                Task(
                    reqs,
                    cancel=job.cancel,
                    prefill_cancel=_UntilOthersWait(job, self),
                    on_token=job.on_token,
                    on_done=lambda task: self._done(job, task.results, task.error),
                    owner=job,
                )
            )
        except BaseException as exc:  # one request's failure, not the daemon's
            self._failed(job, exc)

    def _jump(
        self, engine: ServedEngine, job: Job, layout: PromptLayout, slot: int
    ) -> tuple[PromptBudget, PromptLayout] | None:
        """Under ``budget``: the short prompt a request the slot lacks too much of is
        answered from (None: the whole prompt is evaluated, as under ``wait``)."""
        req = job.params.request
        if (
            self._jump_policy != "budget"
            or req.n_predict == 0
            or not req.cache_prompt
            or engine.spare_sequences < 1
        ):
            return None
        return short_prompt(
            engine, layout, slot, t_max_prompt_ms=job.params.t_max_prompt_ms, short=job.short
        )

    def _answer_apart(
        self,
        engine: ServedEngine,
        job: Job,
        reqs: list[GenerationRequest],
        budget: PromptBudget,
        nearest: PromptLayout,
    ) -> None:
        """Answer from ``nearest`` in spare sequences (as many completions as there are
        spare sequences) while the full prompt fills the slot behind it; the fill goes on
        after the answer, and after the client leaves, until a newer request wants the
        engine (``_UntilOthersWait``: then that request's own prefill takes over from it)."""
        assert job.out is not None
        job.out.budget = budget
        self.n_budget += 1
        room = engine.n_ctx - len(job.prompt) - len(nearest.tokens)
        answer = []
        for req in reqs[: engine.spare_sequences]:
            n_predict = room if req.n_predict < 0 or req.n_predict > room else req.n_predict
            short = replace(req, prompt=nearest.tokens, blocks=(), block_sink=False)
            answer.append(replace(short, n_predict=n_predict))
        engine.submit(  # (first: the fill starting after it sees nothing waiting)
            Task(
                answer,
                cancel=job.cancel,
                on_token=job.on_token,
                on_done=lambda task: self._done(job, task.results, task.error),
                owner=job,
                apart=True,
            )
        )
        engine.submit(
            Task(
                [replace(reqs[0], n_predict=0)],
                cancel=_FILL_RUNS,
                prefill_cancel=_UntilOthersWait(job, self, left=True),
                on_done=lambda task: self._filled(job, task),
                owner=job,
                behind=True,
            )
        )

    def _filled(self, job: Job, task: Task) -> None:
        """A budget answer's fill ended (on the worker thread): the slot holds what it got
        to (a failure cleared it)."""
        if task.error is not None:
            log.warning("filling slot %d behind a budget answer failed: %s", job.slot, task.error)
            return
        self.n_prompt_evaluated += sum(r.n_evaluated for r in task.results)

    def _layout(self, engine: ServedEngine, job: Job) -> PromptLayout:
        """The job's prompt, cut to the context where its endpoint allows (llama-server's
        rule), else refused."""
        layout = job.prepare(engine)
        prompt, n_ctx = layout.tokens, engine.n_ctx
        if len(prompt) < n_ctx:
            return layout
        if not job.truncate:
            raise ContextExceeded(len(prompt), n_ctx)
        job.cut = True
        cut = truncate(prompt, n_ctx, job.params.n_keep)
        log.info("prompt of %d tokens truncated to %d (n_ctx %d)", len(prompt), len(cut), n_ctx)
        return PromptLayout(cut)  # (a cut prompt's blocks are not what they were)

    def _wait_for_slot(self, job: Job, prompt: list[int]) -> bool:
        """Choose the slot of a job that may run on any (``choose_slot``); True when it goes
        back to the head of the queue to wait for a busy one. A keystroke stops a warm-up
        running on its slot and takes over from where it got to, as ``_supersede`` does."""
        choice = choose_slot(
            prompt, self.slots, job.params.id_slot, follow_pin=False, patient=job.cache_only
        )
        job.slot = choice.slot
        if not choice.wait:
            return False
        with self._cond:
            running = self.job_on(choice.slot)
            if running is None:  # (freed meanwhile: it runs now)
                return False
            if running.cache_only and not job.cache_only:
                running.stopped_by = "superseded by a completion for the same slot"
                running.cancel.set()
            self._queue.appendleft(job)
        return True

    def _done(self, job: Job, results: list[GenerationResult], error: BaseException | None) -> None:
        """The engine finished a job (on the worker thread)."""
        if error is not None:
            self._failed(job, error)
            return
        engine, out = self.engine, job.out
        assert engine is not None and out is not None
        out.t_engine_ms = (time.perf_counter() - job.t_start) * 1e3 - out.t_prep_ms
        # (the slot took its tokens when its task ended; an empty prompt ran no task)
        n_cached = len(engine.slots[job.slot].tokens) if job.prompt else 0
        n_ctx = engine.n_ctx
        budget = out.budget.to_json() if out.budget is not None else None
        for index, result in enumerate(results):
            hit_end = (
                result.stop_type == "limit" and len(job.prompt) + len(result.tokens) >= n_ctx - 1
            )
            out.completions.append(
                FinishedCompletion(
                    result,
                    index,
                    job.slot,
                    n_cached,
                    truncated=out.truncated or hit_end,
                    prompt_budget=budget,
                )
            )
        if any(r.cancelled for r in results):
            out.cancelled = job.stopped_by or "client left"
        t_post = time.perf_counter()
        if job.detokenize is not None and out.completions:
            text = job.detokenize(job.prompt)
            for done in out.completions:
                done.prompt_text = text
        out.t_post_ms = (time.perf_counter() - t_post) * 1e3
        self.n_prompt_evaluated += sum(c.result.n_evaluated for c in out.completions)
        self._release(job)
        _finish(job, out)
        if out.cancelled:
            self.n_cancelled += 1
            _log_cut_short(job, out)

    def _failed(self, job: Job, exc: BaseException) -> None:
        # (the client's mistakes are answered with a 400 and logged on the request's line)
        if not isinstance(exc, (Unavailable, ContextExceeded, InvalidRequest, ValueError)):
            log.error("request failed", exc_info=exc)
        if job.slot >= 0 and job.on_slot:
            self._reset_slot(job.slot)
        self._release(job)
        if not job.future.done():
            job.future.set_exception(exc)

    def _release(self, job: Job) -> None:
        with self._cond:
            self.n_done += 1
            self._cond.notify_all()

    def _reset_slot(self, slot: int) -> None:
        if self.engine is None:
            return
        try:
            self.engine.clear_slot(slot)
        except Exception:
            log.exception("could not clear slot %d after a failed request", slot)


class _Call(Generic[T]):
    def __init__(self, fn: Callable[[ServedEngine], T]) -> None:
        self.fn = fn
        self.future: Future[T] = Future()

    def run(self, engine: ServedEngine) -> None:
        try:
            self.future.set_result(self.fn(engine))
        except BaseException as exc:
            self.future.set_exception(exc)


def _known(future: Future[str] | None) -> str | None:
    """The future's result if it is done (never waits)."""
    if future is None or not future.done() or future.exception() is not None:
        return None
    return future.result()


def _finish(job: Job, result: JobResult) -> None:
    if not job.future.done():
        result.t_done = time.perf_counter()
        job.future.set_result(result)


@dataclass
class _UntilOthersWait:
    """The prompt of a job whose client left is evaluated on, as a cache fill, while the
    engine has nothing else to do: the next keystroke's prompt starts with the same tokens
    (everything but the cursor line, which sits at the end), so this is work it would
    otherwise redo, and the engine would idle until it came. It stops once anyone else waits
    or runs (it would share their steps), and at once for a job the worker itself stopped
    (``stopped_by``). Checked between prompt pieces, never during generation."""

    job: Job
    worker: Worker
    left: bool = False  # evaluate on as if the client had left (a budget answer's fill)

    def is_set(self) -> bool:
        if not (self.left or self.job.cancel.is_set()):
            return False
        return bool(self.job.stopped_by) or self.worker.others_wait(self.job.slot)


class _Never:
    """A cancel that is never set (a fill's own: its prefill cancel rules it)."""

    def is_set(self) -> bool:
        return False


_FILL_RUNS = _Never()


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
