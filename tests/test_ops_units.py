"""Pure and fake-engine checks of the operations pieces: bounded queues, request log shapes."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest

from localspec.engine.types import GenerationResult, PromptLayout
from localspec.server import logs
from localspec.server.errors import Unavailable
from localspec.server.requests import CompletionRequest, task_params
from localspec.server.worker import MIN_CALL_QUEUE, EngineThread, Job, Worker
from tests.fake_engine import StepEngine


class BlockingEngine(StepEngine):
    """Generates nothing until released: the worker thread stays busy meanwhile."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.started = threading.Event()

    def run(self, req: Any, **_: Any) -> GenerationResult:
        self.started.set()
        self.release.wait(30)
        return GenerationResult(tokens=[], text="", stop_type="limit")


def test_calls_and_jobs_waiting_behind_a_generation_are_bounded() -> None:
    engine = BlockingEngine()
    with _serving(engine, queue_limit=2) as worker:
        params = task_params(CompletionRequest(prompt="a"), n_ctx=64, n_cmpl_max=1)
        running = Job(params, lambda _e: PromptLayout([1, 2]))
        worker.submit(running)
        assert engine.started.wait(10)
        for _ in range(2):
            worker.submit(Job(params, lambda _e: PromptLayout([1, 2])))
        with pytest.raises(Unavailable) as full:
            worker.submit(Job(params, lambda _e: PromptLayout([1, 2])))
        assert full.value.headers == {"Retry-After": "1"}
        calls = [worker.call(lambda _e: "ok") for _ in range(MIN_CALL_QUEUE)]
        with pytest.raises(Unavailable, match="tokenizer calls"):
            worker.call(lambda _e: "ok")
        engine.release.set()
        assert [c.result(10) for c in calls] == ["ok"] * MIN_CALL_QUEUE
        assert running.future.result(10).completions


def test_request_log_outcomes_and_text_line() -> None:
    entry = logs.RequestLog("POST", "/infill", route="/infill", status=200, slot=0, reused=10)
    assert entry.final_outcome() == "ok"
    assert entry.message().startswith("POST /infill 200 ok slot=0 reused=10")
    for status, outcome in ((499, "client left"), (503, "unavailable"), (500, "error"),
                            (413, "rejected")):  # fmt: skip
        assert logs.RequestLog("POST", "/x", status=status).final_outcome() == outcome
    cut = logs.RequestLog("POST", "/completion", status=200, outcome="client left")
    assert cut.fields()["outcome"] == "client left"
    quoted = logs.RequestLog("GET", "/", status=400, error="bad thing").message()
    assert 'error="bad thing"' in quoted


def test_unused_engine_namespace_is_enough_for_probes() -> None:
    from localspec.server.metrics import Restores
    from localspec.server.state import _probes

    worker = SimpleNamespace(
        queued=0, busy=False, n_cancelled=0, slots=[],
        engine=SimpleNamespace(model_path="/m/t.gguf", draft_path="/m/d.gguf"),
    )  # fmt: skip
    probes = _probes(worker, Restores())  # type: ignore[arg-type]
    assert probes.model_files() == {"target": "/m/t.gguf", "draft": "/m/d.gguf"}


class CancellableEngine(BlockingEngine):
    """Blocks until released or cancelled; a cancelled run says so, like the real engine."""

    n_slots = 2

    def run(self, req: Any, *, cancel: threading.Event | None = None, **_: Any) -> Any:
        self.started.set()
        while not self.release.is_set():
            if cancel is not None and cancel.wait(0.01):
                return GenerationResult(tokens=[], text="", stop_type="none", cancelled=True)
        return GenerationResult(tokens=[], text="", stop_type="limit")


def _ready(worker: Worker) -> None:
    for _ in range(500):
        if worker.state == "ready":
            return
        threading.Event().wait(0.01)
    raise AssertionError("worker did not start")


@contextlib.contextmanager
def _serving(engine: BlockingEngine, queue_limit: int) -> Iterator[Worker]:
    """A started, ready worker on ``engine``; the engine released and the worker stopped after."""
    worker = Worker(lambda: engine, queue_limit=queue_limit)
    worker.start()
    try:
        _ready(worker)
        yield worker
    finally:
        engine.release.set()
        worker.stop()


def _job(n_predict: int, slot: int) -> Job:
    body = CompletionRequest(prompt="a", n_predict=n_predict, id_slot=slot)
    return Job(task_params(body, n_ctx=64, n_cmpl_max=1), lambda _e: PromptLayout([1, 2]))


def test_a_completion_stops_a_running_warmup_on_its_slot_only() -> None:
    """The editor's warm-up caches the ring that heads the keystroke's own prompt: the keystroke
    takes over at once rather than waiting behind it. A warm-up never stops a completion, and
    another slot's completion leaves the warm-up alone."""
    engine = CancellableEngine()
    with _serving(engine, queue_limit=4) as worker:
        warm = _job(0, slot=0)
        worker.submit(warm)
        assert engine.started.wait(10)
        worker.submit(_job(0, slot=0))  # another warm-up: queued behind, no preemption
        other = _job(4, slot=1)
        worker.submit(other)  # another slot's completion: queued, no preemption
        threading.Event().wait(0.1)
        assert not warm.future.done()
        key = _job(4, slot=0)
        engine.started.clear()
        worker.submit(key)
        done = warm.future.result(10)
        assert done.cancelled == "superseded by a completion for the same slot"
        assert engine.started.wait(10)  # the next job runs (not stopped by anyone)
        threading.Event().wait(0.1)
        assert not other.future.done() and not key.future.done()
        engine.release.set()
        assert key.future.result(10).cancelled is None
        assert other.future.result(10).cancelled is None


def test_a_queued_completion_is_never_dropped_for_a_newer_one() -> None:
    """llama-vscode and llama.vim both pin slot 0: the newer completion may be another
    editor's. Each editor gets its answer, in turn (its own stale ones it cancels itself)."""
    engine = CancellableEngine()
    with _serving(engine, queue_limit=4) as worker:
        running = _job(4, slot=0)
        worker.submit(running)
        assert engine.started.wait(10)
        first, second = _job(4, slot=0), _job(4, slot=0)
        worker.submit(first)
        worker.submit(second)
        threading.Event().wait(0.1)
        assert worker.queued == 2 and not first.future.done()
        engine.release.set()
        for job in (running, first, second):
            assert job.future.result(10).cancelled is None


class PrefillingEngine(BlockingEngine):
    """Hands back the prefill rule it was given and waits for the test to release it."""

    def __init__(self) -> None:
        super().__init__()
        self.rule: Any = None

    def run(self, req: Any, *, prefill_cancel: Any = None, **_: Any) -> Any:
        self.rule = prefill_cancel
        self.started.set()
        self.release.wait(30)
        return GenerationResult(tokens=[], text="", stop_type="none", cancelled=True)


def test_a_left_clients_prompt_is_evaluated_on_until_someone_else_waits() -> None:
    """The next keystroke's prompt starts with the left one's tokens: its prefill goes on while
    the engine would otherwise idle, and stops for a live job, a tokenizer call, or the worker
    stopping it (a superseded warm-up)."""
    engine = PrefillingEngine()
    with _serving(engine, queue_limit=4) as worker:
        key = _job(4, slot=0)
        worker.submit(key)
        assert engine.started.wait(10)
        rule = engine.rule
        assert not rule.is_set()  # the client is still there
        worker.abandon(key)
        assert not rule.is_set()  # gone, but nobody waits: evaluate on
        dropped = _job(4, slot=1)
        worker.submit(dropped)
        worker.abandon(dropped)
        assert not rule.is_set()  # a queued job whose client left too does not count
        waiting = _job(4, slot=1)
        worker.submit(waiting)
        assert rule.is_set()  # a live request waits: stop at the next chunk
        worker.abandon(waiting)
        assert not rule.is_set()
        key.stopped_by = "superseded by a completion for the same slot"
        assert rule.is_set()


def test_answers_on_shifted_kv_are_counted() -> None:
    from prometheus_client import generate_latest

    from localspec.server.metrics import Metrics, Probes

    m = Metrics(Probes(queued=lambda: 0, busy=lambda: False), process=False)
    m.record(GenerationResult(tokens=[1, 2], text="ab", stop_type="limit", n_approx=300))
    m.record(GenerationResult(tokens=[1], text="a", stop_type="limit"))  # exact KV
    m.record(GenerationResult(tokens=[], text="", stop_type="limit", n_approx=300))  # a warm-up
    assert b"localspec_answers_on_shifted_kv_total 1.0" in generate_latest(m.registry)


class OverlapEngine(StepEngine):
    """Answers after a few ms inside ``step``, counting how many engines are inside one and
    noting the threads they ran on."""

    inside = 0
    most = 0
    threads: ClassVar[set[int]] = set()
    lock = threading.Lock()

    def run(self, req: Any, **_: Any) -> GenerationResult:
        cls = OverlapEngine
        with cls.lock:
            cls.inside += 1
            cls.most = max(cls.most, cls.inside)
            cls.threads.add(threading.get_ident())
        threading.Event().wait(0.002)
        with cls.lock:
            cls.inside -= 1
        return GenerationResult(tokens=[1], text="x", stop_type="limit")


def test_two_workers_share_one_engine_thread() -> None:
    """A chat model's worker and the completion engine's make every llama.cpp call on one
    thread, their loads included: a second thread keeps a second OpenMP team, which halved
    the completions' speed once chat had answered, and two models loading on two threads
    crashed one daemon in ten. Loads come in order, steps take turns, and the thread ends
    once both workers have stopped."""
    OverlapEngine.inside = OverlapEngine.most = 0
    OverlapEngine.threads = set()
    shared = EngineThread(name="two-workers-engine")
    engines = [OverlapEngine(), OverlapEngine()]
    loads: list[tuple[int, int]] = []

    def loader(i: int) -> Callable[[], OverlapEngine]:
        def load() -> OverlapEngine:
            loads.append((i, threading.get_ident()))
            return engines[i]

        return load

    workers = [Worker(loader(i), queue_limit=64, engine_thread=shared) for i in range(2)]
    for w in workers:
        w.start()
    try:
        for w in workers:
            _ready(w)
        jobs = [(w, _job(1, slot=-1)) for _ in range(40) for w in workers]  # none superseded
        for w, job in jobs:
            w.submit(job)
        for _, job in jobs:
            assert job.future.result(30).completions
    finally:
        for w in workers:
            w.stop()
    assert OverlapEngine.most == 1
    assert len(OverlapEngine.threads) == 1
    (engine_thread,) = OverlapEngine.threads
    assert loads == [(0, engine_thread), (1, engine_thread)]  # loaded there too, in order
    assert [w.state for w in workers] == ["stopped", "stopped"]
    for _ in range(200):  # the thread leaves right after the last worker's close
        if not any(t.name == shared.name for t in threading.enumerate()):
            break
        threading.Event().wait(0.01)
    else:
        raise AssertionError("the engine thread outlived its workers")


@pytest.mark.skipif(os.name != "posix", reason="file modes are POSIX")
def test_a_benchmarks_key_comes_from_a_file_never_the_command_line(tmp_path: Path) -> None:
    from localspec.bench import load
    from localspec.bench.command import key_from_file
    from localspec.settings import SettingsError

    with pytest.raises(SystemExit):  # it would show in ps
        load.main(["--api-key", "sk-in-argv"])
    key = tmp_path / "key"
    key.write_text("sk-1\n")
    key.chmod(0o600)
    assert key_from_file(key) == "sk-1" and key_from_file(None) is None
    key.chmod(0o644)
    with pytest.raises(SettingsError, match="chmod 600"):
        key_from_file(key)
