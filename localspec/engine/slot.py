"""One slot, as llama-server's ``server_slot``: its sequences, its request, what it reports.

A :class:`Slot` owns the slot's sequence in the target's cache and in the draft's, the
:class:`Task` queued for it or :class:`Running` on it (with that request's completions), its
:class:`SlotState`, and what the server reports about it and chooses slots by (/slots,
/metrics, ``cache_plan.choose_slot``). The scheduler (engine/scheduler.py) keeps it current;
the server only reads it, through the engine's ``slots``.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum

from localspec.engine.cache import PrefillResult, PrefillSteps, SeqState
from localspec.engine.cache_plan import cache_pieces
from localspec.engine.completion import Completion
from localspec.engine.llama import Segment
from localspec.engine.types import (
    Cancel,
    GenerationRequest,
    GenerationResult,
    IndexedTokenCallback,
)


@dataclass(eq=False)
class Task:
    """One request on one slot: a prompt evaluated once, and one or more completions.

    ``requests[i]`` is completion i's (its sampler, seed, stops); the first one's slot,
    prompt, blocks and cache rule are the task's. ``on_done`` is called on the engine's thread
    once ``results`` (or ``error``) is set."""

    requests: Sequence[GenerationRequest]
    cancel: Cancel | None = None
    prefill_cancel: Cancel | None = None  # stops the prompt's evaluation (default: cancel)
    on_token: IndexedTokenCallback | None = None
    on_done: Callable[[Task], None] | None = None
    owner: object = None  # who submitted it (the server's job), read back through Slot.task
    # evaluated and decoded in spare sequences of its own (a budget answer, ``jump_policy``):
    # the slot's KV is not touched, the slot does not hold it, and it waits for no slot
    apart: bool = False
    # a fill that yields: its prompt pieces run only in steps with no other task's work (the
    # slot's full context filling behind a budget answer on the same slot)
    behind: bool = False
    results: list[GenerationResult] = field(default_factory=list)
    error: BaseException | None = None
    done: bool = False

    @property
    def first(self) -> GenerationRequest:
        return self.requests[0]

    @property
    def slot(self) -> int:
        return self.requests[0].slot


@dataclass(frozen=True)
class Aux:
    """An extra completion's sequences: where it decodes, and where it drafts (None without
    a draft model)."""

    target: SeqState
    draft: SeqState | None


@dataclass(eq=False)
class Running:
    """A started task: its prompt's evaluation, then its completions."""

    task: Task
    t0: float
    inside0: float
    completions: list[Completion] = field(default_factory=list)
    aux: list[Aux] = field(default_factory=list)  # the extra completions' sequences
    # taken from the free ones when the task starts, so tasks evaluating their prompts at the
    # same time cannot all count on the same free sequences; used once the prompt is in
    reserved: list[Aux] = field(default_factory=list)
    steps: PrefillSteps | None = None  # the prompt's evaluation while it runs
    piece: Segment | None = None  # its next piece
    pre: PrefillResult | None = None
    prompt_ms: float = 0.0
    shared: bool = False  # the prompt shared steps with other sequences (no price sample)
    home: Aux | None = None  # an ``apart`` task's own sequences (its first completion's)


class SlotState(Enum):
    """Where a slot is in serving a request (llama-server: SLOT_STATE_*)."""

    IDLE = "idle"  # nothing runs or waits on it
    WAITING = "waiting"  # a task was submitted for it; it starts at a step
    WARMING = "warming"  # a cache fill (n_predict 0) evaluates its prompt
    PROMPT = "prompt"  # a request's prompt is being evaluated
    GENERATING = "generating"  # its completions decode


@dataclass(eq=False)
class Slot:
    """One slot: its sequences in both models, its request, and what it reports.

    ``tokens`` is what its target cache held after its last request: while a request runs
    the cache changes under it, and slot choice weighs what the slot held plus the prompt
    running there (``running``), which the slot holds once that request ends."""

    id: int
    n_ctx: int
    target: SeqState  # its sequence in the target's cache
    draft: SeqState | None  # and in the draft's (None without a draft model)
    queued: deque[Task] = field(default_factory=deque)  # submitted, not started
    run: Running | None = None  # the task started on it
    tokens: list[int] = field(default_factory=list)
    last_used: float = 0.0  # monotonic time its last request ended; 0 = never
    n_requests: int = 0
    last_prompt_n: int = 0  # prompt tokens its last request evaluated
    last_cache_n: int = 0  # and found in the cache
    _pieces: frozenset[int] | None = field(default=None, repr=False)
    _running_pieces: tuple[Sequence[int], frozenset[int]] | None = field(default=None, repr=False)

    @property
    def task(self) -> Task | None:
        """The task running on it, else the next one queued for it. (/slots and /metrics
        read this on other threads than the engine's: each field is read once.)"""
        run = self.run
        if run is not None:
            return run.task
        try:
            return self.queued[0]
        except IndexError:
            return None

    @property
    def state(self) -> SlotState:
        run = self.run
        if run is None:
            return SlotState.IDLE if self.task is None else SlotState.WAITING
        if run.task.first.n_predict == 0:
            return SlotState.WARMING
        return SlotState.PROMPT if run.pre is None else SlotState.GENERATING

    @property
    def is_processing(self) -> bool:
        return self.task is not None

    @property
    def running(self) -> Sequence[int]:
        """The prompt of the request running (or next) on it; empty when idle."""
        task = self.task
        return task.first.prompt if task is not None else ()

    @property
    def running_warm_up(self) -> bool:
        task = self.task
        return task is not None and task.first.n_predict == 0

    @property
    def pieces(self) -> frozenset[int]:
        """``cache_pieces(tokens)``, built when a choice of slot first needs it."""
        if self._pieces is None:
            self._pieces = cache_pieces(self.tokens)
        return self._pieces

    @property
    def running_pieces(self) -> frozenset[int]:
        """``cache_pieces(running)``, built once per running request that a choice reads."""
        running = self.running
        if self._running_pieces is None or self._running_pieces[0] is not running:
            self._running_pieces = (running, cache_pieces(running))
        return self._running_pieces[1]

    def cached(self) -> list[int]:
        """The tokens its target sequence holds now."""
        return list(self.target.tokens)

    def hold(self, tokens: list[int]) -> None:
        """Its cache now holds ``tokens`` (a request ended, or the slot was cleared)."""
        self.tokens, self._pieces = tokens, None

    def submitted(self, task: Task) -> None:
        self.queued.append(task)

    def started(self, run: Running) -> None:
        self.queued.remove(run.task)
        self.run = run

    def ended(self, task: Task) -> None:
        """``task`` is done (its ``results`` or ``error`` set): the slot is free of it and
        reports it."""
        if self.run is not None and self.run.task is task:
            self.run = None
        elif task in self.queued:
            self.queued.remove(task)
        results = task.results if task.error is None else []
        self.hold(self.cached() if results else [])
        if results:
            self.last_prompt_n, self.last_cache_n = results[0].n_evaluated, results[0].n_cached
        self.last_used = time.monotonic()
        self.n_requests += 1
