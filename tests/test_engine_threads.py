"""Threads follow the load: each evaluation runs on the cores other processes leave free."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from localspec.engine import Engine, EngineSettings, GenerationRequest, ModelSettings
from localspec.engine.threads import (
    CpuSample,
    free_cores,
    other_busy_cores,
    sample_cpu,
)
from tests.cpu_support import OtherLoad


@pytest.mark.parametrize(
    ("cores", "other_busy", "free"),
    [
        (2, 0.0, 2),
        (2, 0.29, 2),  # light background work keeps both cores
        (2, 0.3, 1),  # a third of a core busy: a thread there would be descheduled often
        (2, 1.0, 1),  # one busy process
        (2, 2.0, 1),  # never below one
        (8, 2.5, 5),
        (1, 0.9, 1),
    ],
)
def test_free_cores(cores: int, other_busy: float, free: int) -> None:
    assert free_cores(cores, other_busy) == free


def test_other_processes_load_is_the_machine_less_this_process() -> None:
    before = CpuSample(busy_s=100.0, own_s=10.0, wall_s=0.0)
    after = CpuSample(busy_s=101.5, own_s=10.5, wall_s=1.0)  # 1.5 cores busy, 0.5 ours
    assert other_busy_cores(before, after) == pytest.approx(1.0)
    assert other_busy_cores(after, after) == 0.0


def test_the_governor_re_decides_as_the_load_changes() -> None:
    load = OtherLoad()
    gov = load.governor(2)
    assert gov.threads() == 2
    for cores, want in ((1.0, 1), (0.5, 1), (0.1, 2), (2.0, 1), (0.0, 2)):
        before = gov.free
        load.run(seconds=0.1, other_cores=cores)
        assert gov.threads() == before  # within the interval: the last decision stands
        load.run(seconds=0.2, other_cores=cores)
        assert gov.threads() == want, cores
        assert gov.other_busy == pytest.approx(cores)
    assert gov.n_changes == 4


def test_a_busy_process_is_seen_as_other_load() -> None:
    """The real /proc reading: a busy loop in another process counts, this one's does not."""
    start = sample_cpu()
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(1.0)
        seen = other_busy_cores(start, sample_cpu())
    finally:
        busy.kill()
        busy.wait()
    mine = sample_cpu()
    deadline = time.perf_counter() + 0.5
    while time.perf_counter() < deadline:  # this process busy: not other load
        pass
    own = other_busy_cores(mine, sample_cpu())
    assert seen >= 0.5  # a whole core where one is free; half of one on a crowded machine
    assert own < seen


def test_every_decode_runs_on_the_free_cores(qwen_target: Path) -> None:
    """The engine applies the governor's choice before each decode, capped by its settings,
    and says in the result what the request ran on."""
    settings = EngineSettings(
        target=ModelSettings(str(qwen_target), n_ctx=512, n_batch=256, n_ubatch=256, n_threads=2)
    )
    load = OtherLoad()
    with Engine.load(settings) as eng:
        eng.pair.tctx.governor = load.governor(4)
        prompt = eng.vocab.tokenize("def add(a, b):\n    return a + b\n")
        load.run(seconds=1.0, other_cores=3.0)
        res = eng.generate(GenerationRequest(slot=0, prompt=prompt, n_predict=2))
        assert res.threads == (1, 1) == eng.pair.tctx.threads_now
        load.run(seconds=1.0, other_cores=0.0)
        res = eng.generate(GenerationRequest(slot=0, prompt=[*prompt, 11], n_predict=2))
        assert res.threads == (2, 2)  # four free cores, capped at the configured two


def test_the_load_is_measured_while_the_engine_idles(qwen_target: Path) -> None:
    """A request's first decode decides on the last fraction of a second: the governor is
    re-measured on its own thread while no request runs (measured only by decodes, the first
    one after a pause would average the whole pause, and a build that ran and ended in it
    would cost the request a core). Closing the engine stops the thread."""
    from tests.ops_support import wait_until

    settings = EngineSettings(target=ModelSettings(str(qwen_target), n_ctx=256, n_threads=1))
    before = set(threading.enumerate())
    with Engine.load(settings) as eng:
        gov = eng.governor
        assert gov is not None
        start = gov.n_samples
        wait_until(lambda: gov.n_samples >= start + 2, timeout=30.0)
        keeper = [t for t in threading.enumerate() if t.name == "localspec-load"]
        keeper = [t for t in keeper if t not in before]
        assert len(keeper) == 1
    assert not keeper[0].is_alive()
    quiet = EngineSettings(target=ModelSettings(str(qwen_target), n_ctx=256), follow_load=False)
    with Engine.load(quiet) as eng:
        assert eng.governor is None
