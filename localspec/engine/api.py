"""What a server holds of an engine: the one typed boundary between server/ and engine/.

:class:`~localspec.engine.engine.Engine` satisfies it, and so does the tests' stand-in
(tests/fake_engine.py); a test holds both against it. The server's worker thread is the only
caller (the engine is not thread-safe).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from localspec.engine.slot import Slot, Task
from localspec.engine.threads import ThreadGovernor
from localspec.engine.types import PromptLayout
from localspec.engine.vocab import Vocab


class ServedEngine(Protocol):
    """A loaded model pair that runs :class:`Task`s in steps (engine/scheduler.py)."""

    n_ctx: int  # each slot's context
    n_slots: int
    n_batch: int
    n_ctx_train: int
    model_path: str
    draft_path: str | None
    vocab: Vocab  # tokenizer and token texts (only on the engine's thread)
    governor: ThreadGovernor | None  # follows the cores other processes leave free
    slots: Sequence[Slot]  # each slot's sequences, request and report (engine/slot.py)

    @property
    def max_completions(self) -> int:
        """The most completions one request may ask for."""
        ...

    @property
    def kv_holes(self) -> tuple[int, int]:
        """(cells freed below kept ones, compactions done) in the target's KV buffer."""
        ...

    @property
    def busy(self) -> bool:
        """A task runs or waits."""
        ...

    def submit(self, task: Task) -> None:
        """Queue a task; a bad one raises ValueError here. ``step`` runs it."""
        ...

    def step(self) -> bool:
        """One step of every active task; returns whether work is left."""
        ...

    def abort(self, exc: BaseException) -> None:
        """Fail every task with ``exc``."""
        ...

    def busy_besides(self, slot: int) -> bool:
        """A task of another slot runs, or any task waits."""
        ...

    def slot_tokens(self, slot: int) -> list[int]:
        """The tokens the slot's sequence holds in the target's cache."""
        ...

    def prompt_cost(self, slot: int, layout: PromptLayout) -> tuple[int, float]:
        """(tokens of ``layout`` the idle ``slot`` would evaluate, measured ms per prompt
        token or -1 before one was measured)."""
        ...

    @property
    def spare_sequences(self) -> int:
        """Sequences free now for extra completions or an answer apart from its slot."""
        ...

    def clear_slot(self, slot: int) -> None:
        """Forget what the slot holds."""
        ...

    def memory_report(self) -> dict[str, Any]:
        """llama.cpp's backends and the plan's memory beside what it allocated, per device
        (/props' ``llama_cpp``; empty where no llama.cpp model is loaded)."""
        ...

    def close(self) -> None:
        """Free the models (idempotent)."""
        ...
