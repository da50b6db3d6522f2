"""Test-side steering of what a machine would otherwise decide: how fast it is, what it measured.

A test must hold on any CPU under any load. Where its subject is a decision the engine takes
from measured times (the speculation cost model, the draft prefill rule), the test sets those
times; where it needs requests still running when it acts (an abort, a full queue, a
timeout), it holds them until they are cancelled, instead of hoping that a 3000-token answer
outlasts a sleep: a fast machine finishes it first, a loaded one is slow to start it.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from localspec.engine.policy import SpecPolicy, VerifyCost
from localspec.engine.slot import Task

HOLD_S = 60.0  # a hold lets go after this long (the test then fails on its own checks)


class Hold:
    """What a hold hands the test: ``reached`` is set once every request in the engine waits
    at the hold; ``release`` lets them all go on."""

    def __init__(self) -> None:
        self.reached = threading.Event()
        self.release = threading.Event()

    def wait_reached(self, timeout: float = HOLD_S) -> None:
        if not self.reached.wait(timeout):
            raise AssertionError("the requests never reached the hold")


@contextlib.contextmanager
def _held(engine: Any, *, tokens: int | None, steps: int | None) -> Iterator[Hold]:
    """Engine steps stop (the caller's thread goes on: the worker still starts, queues and
    cancels jobs) once every request in the engine has delivered ``tokens`` tokens, or had
    ``steps`` steps, until one of them is cancelled or the hold is released."""
    hold = Hold()
    real_submit, real_step = engine.submit, engine.step
    seen: dict[int, list[int]] = {}  # id(task) -> [tokens delivered, steps run]
    live: list[Task] = []
    started = time.monotonic()

    def submit(task: Task) -> None:
        count = seen[id(task)] = [0, 0]
        sink = task.on_token

        def on_token(index: int, event: Any) -> None:
            count[0] += 1
            if sink is not None:
                sink(index, event)

        task.on_token = on_token
        live.append(task)
        real_submit(task)

    def waiting(task: Task) -> bool:
        count = seen[id(task)]
        if task.cancel is not None and task.cancel.is_set():
            return False
        return count[0] >= tokens if tokens is not None else count[1] >= (steps or 0)

    def step() -> bool:
        live[:] = [t for t in live if not t.done]
        if (
            live
            and not hold.release.is_set()
            and time.monotonic() - started < HOLD_S
            and all(waiting(t) for t in live)
        ):
            hold.reached.set()
            time.sleep(0.002)
            return True
        for task in live:
            seen[id(task)][1] += 1
        return real_step()

    engine.submit, engine.step = submit, step
    try:
        yield hold
    finally:
        hold.release.set()
        del engine.submit, engine.step


def held_generation(engine: Any, after: int = 1) -> contextlib.AbstractContextManager[Hold]:
    """Requests stop generating after their ``after``-th token until they are cancelled or the
    hold is released: they are generating, on any machine, when the test acts."""
    return _held(engine, tokens=after, steps=None)


def held_prefill(engine: Any) -> contextlib.AbstractContextManager[Hold]:
    """Requests stop after their first step (the first piece of their prompt) until they are
    cancelled or the hold is released: a client that leaves then leaves mid-prefill."""
    return _held(engine, tokens=None, steps=1)


def fixed_costs(
    monkeypatch: pytest.MonkeyPatch,
    verify_ms: dict[int, float],
    *,
    draft_ms: float | None = None,
    prefill_ms: float | None = None,
) -> None:
    """Speculation's measured costs, as this machine would have measured them: an engine step
    of each batch size in ``verify_ms`` (interpolated between), a draft token ``draft_ms``, a
    prompt token ``prefill_ms`` (draft and target). The engine's own measurements are ignored,
    so the cost model decides the same on any CPU and under any load."""

    def observe(self: VerifyCost, n: int, ms: float) -> None:
        self.ms = dict(verify_ms)

    monkeypatch.setattr(VerifyCost, "observe", observe)
    if draft_ms is not None:

        def observe_draft_cost(self: SpecPolicy, source: str, ms_per_token: float) -> None:
            if source not in self.hidden:
                self.source(source).cost_ms = draft_ms

        monkeypatch.setattr(SpecPolicy, "observe_draft_cost", observe_draft_cost)
    if prefill_ms is not None:

        def observe_prefill(self: SpecPolicy, n_tokens: int, ms: float) -> None:
            self.draft_prefill_ms = self.target_prefill_ms = prefill_ms

        monkeypatch.setattr(SpecPolicy, "observe_draft_prefill", observe_prefill)
        monkeypatch.setattr(SpecPolicy, "observe_target_prefill", observe_prefill)
