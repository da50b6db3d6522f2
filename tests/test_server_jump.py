"""A cold jump answered within the client's ``t_max_prompt_ms`` (``cache.jump_policy`` budget),
over real HTTP on a real target+draft pair.

The prefill price is pinned (``PRICE_MS`` per token, as if this machine had measured it) so
the decision is the same on any CPU; everything else is measured and real: the answer comes
from the cursor's nearest lines, is marked in the response, the log, /metrics and `status`,
the full context fills the slot behind it (the client leaving does not stop that), and the
next keystroke at that place finds it cached.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from localspec.commands.lifecycle import metric_totals, render_status, summarise
from localspec.engine.cache import SlotCaches
from localspec.engine.slot import Task
from localspec.engine.types import SpecSettings
from localspec.server.app import create_app
from localspec.server.logs import REQUESTS
from localspec.server.options import ServerSettings
from tests.ops_support import wait_until
from tests.test_server_http import Live, engine_settings, start, stop

PRICE_MS = 1.0  # ms per prompt token, pinned
BUDGET_MS = 200  # the client's t_max_prompt_ms: 200 tokens at that price


def source(name: str, n: int) -> list[str]:
    return [f"def {name}_{i}(value):\n    return value * {i} + len('{name}')\n" for i in range(n)]


def body(lines: list[str], at: int, typed: str = "", **over: Any) -> dict[str, Any]:
    """llama-vscode's /infill with the cursor on line ``at`` of ``lines``."""
    return {
        "id_slot": 0,
        "input_prefix": "".join(lines[:at]),
        "input_suffix": "".join(lines[at:]),
        "input_extra": [],
        "prompt": typed,
        "n_predict": 8,
        "top_k": 1,
        "samplers": ["top_k"],
        "cache_prompt": True,
        "t_max_prompt_ms": BUDGET_MS,
        "t_max_predict_ms": 500,
        **over,
    }


def serve(target: Path, draft: Path, policy: str) -> Live:
    pair = replace(
        engine_settings(target, draft, n_slots=1),
        spec=SpecSettings(mode="draft", pipeline=False),
        host_cache_bytes=0,  # (a restore would make the jump cheap: not what is tested here)
    )
    return start(create_app(ServerSettings(port=0, jump_policy=policy), pair))  # type: ignore[arg-type]


@pytest.fixture
def pinned_price(monkeypatch: pytest.MonkeyPatch) -> None:
    def observe(self: SlotCaches, n_tokens: int, ms: float) -> None:
        self.ms_per_token = PRICE_MS

    monkeypatch.setattr(SlotCaches, "_observe_price", observe)


@pytest.fixture
def budget(qwen_target: Path, qwen_draft: Path, pinned_price: None) -> Iterator[Live]:
    live = serve(qwen_target, qwen_draft, "budget")
    yield live
    stop(live)


def infill(c: httpx.Client, b: dict[str, Any]) -> dict[str, Any]:
    r = c.post("/infill", json=b)
    assert r.status_code == 200, r.text
    return r.json()


def idle(live: Live) -> None:
    wait_until(lambda: not live.service.worker.busy, timeout=60)


def test_a_cold_jump_is_answered_from_the_nearest_lines_and_fills_behind(
    budget: Live, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=REQUESTS)
    a, b = source("alpha", 120), source("beta", 120)
    engine = budget.service.worker.engine
    with budget.client() as c:
        first = infill(c, body(a, 60))  # no price measured yet: the whole prompt, as `wait`
        assert "prompt_budget" not in first and first["timings"]["prompt_n"] > 600
        idle(budget)
        jump = infill(c, body(b, 70))
        used = jump["prompt_budget"]
        assert used["used"] is True and used["t_max_prompt_ms"] == BUDGET_MS
        assert used["n_uncached"] > 600 and used["est_prompt_ms"] > BUDGET_MS
        # the short prompt: sized to the budget at the price (its FIM tokens besides)
        assert used["n_ctx_tokens"] <= BUDGET_MS / PRICE_MS + 8
        assert jump["timings"]["prompt_n"] == used["n_ctx_tokens"]
        # the full context fills the slot behind the answer
        idle(budget)
        full = engine.slot_tokens(0)
        assert len(full) > 600 and len(full) == len(budget.service.worker.slots[0].tokens)
        # the next keystroke at that place: no budget answer, the filled context reused
        nxt = infill(c, body(b, 70, typed="    x"))
        assert "prompt_budget" not in nxt
        assert nxt["tokens_cached"] >= len(full) - 1 and nxt["timings"]["prompt_n"] <= 8
        totals = metric_totals(c.get("/metrics").text)
    lines = [r.getMessage() for r in caplog.records if r.name == REQUESTS]
    assert sum("budget=1" in m for m in lines) == 1
    assert totals["localspec_budget_answers_total"] == 1
    status = render_status({"url": budget.url, "health": "ok", "metrics": summarise(totals)})
    assert "1 answered from the nearest lines" in status


def test_a_budget_answer_streams_and_the_fill_outlives_the_client(budget: Live) -> None:
    a, b = source("gamma", 120), source("delta", 120)
    engine = budget.service.worker.engine
    with budget.client() as c:
        infill(c, body(a, 50))
        idle(budget)
        events: list[dict[str, Any]] = []
        with c.stream("POST", "/infill", json=body(b, 40, stream=True, n_predict=4)) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
        final = events[-1]
        assert final["stop"] is True and final["prompt_budget"]["used"] is True
        idle(budget)
        # another jump whose client leaves at once: its answer stops, its fill goes on
        with c.stream("POST", "/infill", json=body(a, 90, stream=True, n_predict=64)) as r:
            next(r.iter_lines())
        idle(budget)
        assert budget.service.worker.n_budget == 2
        assert len(engine.slot_tokens(0)) > 600
        again = infill(c, body(a, 90))
        assert "prompt_budget" not in again and again["timings"]["prompt_n"] <= 2


@contextlib.contextmanager
def only_apart(engine: Any) -> Iterator[threading.Event]:
    """Engine steps run only while an answer apart is live, until the event is set: a
    warm-up stays where it is, on any machine, while a keystroke is answered beside it."""
    release, tasks = threading.Event(), []
    real_submit, real_step = engine.submit, engine.step

    def submit(task: Task) -> None:
        tasks.append(task)
        real_submit(task)

    def step() -> bool:
        if not release.is_set() and not any(t.apart and not t.done for t in tasks):
            time.sleep(0.002)
            return True
        return real_step()

    engine.submit, engine.step = submit, step
    try:
        yield release
    finally:
        release.set()
        del engine.submit, engine.step


def test_a_keystroke_behind_a_warm_up_is_answered_beside_it(budget: Live) -> None:
    """An editor's ring warm-up fills the slot (seconds after a jump): a keystroke under the
    budget does not wait for it, its answer comes apart at once, and its full prompt fills
    the slot once the warm-up is done."""
    a, b = source("eta", 120), source("theta", 120)
    ring = [{"filename": f"/p/m{i}.py", "text": "".join(source(f"r{i}", 8)), "time": i}
            for i in range(6)]  # fmt: skip
    engine = budget.service.worker.engine
    with budget.client() as c:
        infill(c, body(a, 60))
        idle(budget)
        warm = body([], 0, input_extra=ring, n_predict=0)
        with only_apart(engine) as release, ThreadPoolExecutor(1) as pool:
            warming = pool.submit(infill, c, warm)
            wait_until(lambda: budget.service.worker.busy)  # the warm-up holds the slot
            # (waiting for the warm-up instead, it would wait for ever: it is held)
            r = c.post("/infill", json=body(b, 70, input_extra=ring), timeout=30)
            assert r.status_code == 200 and r.json()["prompt_budget"]["used"] is True
            assert not warming.done()  # answered beside the warm-up, not after it
            release.set()
            assert warming.result()["timings"]["prompt_n"] > 0
        idle(budget)
        again = infill(c, body(b, 70, input_extra=ring))
        assert "prompt_budget" not in again and again["timings"]["prompt_n"] <= 2
        assert len(engine.slot_tokens(0)) > 600


def test_wait_evaluates_the_whole_prompt(
    qwen_target: Path, qwen_draft: Path, pinned_price: None
) -> None:
    live = serve(qwen_target, qwen_draft, "wait")
    try:
        a, b = source("alpha", 120), source("beta", 120)
        with live.client() as c:
            infill(c, body(a, 60))
            jump = infill(c, body(b, 70))
            props = c.get("/props").json()
        assert "prompt_budget" not in jump and jump["timings"]["prompt_n"] > 600
        assert props["jump_policy"] == "wait"
    finally:
        stop(live)
