"""A stand-in for the engine's task API, for worker and route tests that need no model.

``submit`` queues a task and each ``step`` runs the oldest one to its end on the caller's
thread with ``run`` (one call per completion), so a fake that blocks in ``run`` keeps the
worker's thread busy, as a long generation does."""

from __future__ import annotations

from collections import deque
from typing import Any

from localspec.engine.scheduler import Task
from localspec.engine.types import GenerationResult


class StepEngine:
    n_ctx = 64
    n_slots = 1
    max_completions = 16
    model_path = "fake.gguf"
    draft_path = None

    def __init__(self) -> None:
        self.tasks: deque[Task] = deque()

    @property
    def busy(self) -> bool:
        return bool(self.tasks)

    def submit(self, task: Task) -> None:
        self.tasks.append(task)

    def waiting_for_prompt(self) -> bool:
        return len(self.tasks) > 1

    def slot_tokens(self, slot: int) -> list[int]:
        return []

    def abort(self, exc: BaseException) -> None:
        while self.tasks:
            task = self.tasks.popleft()
            task.error, task.done = exc, True
            if task.on_done is not None:
                task.on_done(task)

    def step(self) -> bool:
        task = self.tasks.popleft()
        try:
            task.results = [
                self.run(req, cancel=task.cancel, prefill_cancel=task.prefill_cancel)
                for req in task.requests
            ]
        except BaseException as exc:
            task.error = exc
        task.done = True
        if task.on_done is not None:
            task.on_done(task)
        return self.busy

    def run(self, req: Any, **_: Any) -> GenerationResult:
        raise NotImplementedError
