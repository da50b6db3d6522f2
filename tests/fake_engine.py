"""A stand-in for the engine, for worker and route tests that need no model.

It satisfies the server's engine interface (``ServedEngine``, engine/api.py; a test holds it
against it). ``submit`` queues a task and each ``step`` runs the oldest one to its end on the
caller's thread with ``run`` (one call per completion), so a fake that blocks in ``run`` keeps
the worker's thread busy, as a long generation does."""

from __future__ import annotations

from collections import deque
from typing import Any

from localspec.engine.cache import SeqState
from localspec.engine.slot import Slot, Task
from localspec.engine.threads import ThreadGovernor
from localspec.engine.types import GenerationResult
from localspec.engine.vocab import FimTokens


class FakeVocab:
    n_vocab = 1000
    bos = None
    add_bos = False
    fim = FimTokens(pre=1, suf=2, mid=3, rep=4, sep=5)

    def __init__(self) -> None:
        self.piece_calls = 0

    def tokenize(self, text: str, *, special: bool = False) -> list[int]:
        return [10 + ord(c) % 900 for c in text]

    def piece(self, token: int, *, special: bool = False) -> bytes:
        self.piece_calls += 1
        # some tokens are half a UTF-8 character: pieces must be joined before decoding
        return {7: b"\xc3", 8: b"\xa9"}.get(token, chr(32 + token % 90).encode())

    def detokenize(self, tokens: list[int], *, special: bool = False) -> str:
        return b"".join(self.piece(t, special=special) for t in tokens).decode("utf-8", "replace")


class StepEngine:
    n_ctx = 64
    n_slots = 1
    n_batch = 64
    n_ctx_train = 4096
    max_completions = 16
    model_path = "fake.gguf"
    draft_path: str | None = None
    governor: ThreadGovernor | None = None
    kv_holes = (0, 0)

    def __init__(self) -> None:
        self.tasks: deque[Task] = deque()
        self.vocab: Any = FakeVocab()
        self.slots = tuple(Slot(i, self.n_ctx, SeqState(i), None) for i in range(self.n_slots))

    @property
    def busy(self) -> bool:
        return bool(self.tasks)

    def submit(self, task: Task) -> None:
        self.tasks.append(task)
        self.slots[task.slot].submitted(task)

    def busy_besides(self, slot: int) -> bool:
        return len(self.tasks) > 1

    def slot_tokens(self, slot: int) -> list[int]:
        return self.slots[slot].cached()

    def prompt_cost(self, slot: int, layout: Any) -> tuple[int, float]:
        return len(layout.tokens), -1.0  # never measured: a budget answer never starts here

    spare_sequences = 0

    def clear_slot(self, slot: int) -> None:
        self.slots[slot].target.tokens = []
        self.slots[slot].hold([])

    def memory_report(self) -> dict[str, Any]:
        return {}  # no llama.cpp model loaded

    def close(self) -> None:
        pass

    def abort(self, exc: BaseException) -> None:
        while self.tasks:
            task = self.tasks.popleft()
            task.error, task.done = exc, True
            self.slots[task.slot].ended(task)
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
        self.slots[task.slot].ended(task)
        if task.on_done is not None:
            task.on_done(task)
        return self.busy

    def run(self, req: Any, **_: Any) -> GenerationResult:
        raise NotImplementedError
