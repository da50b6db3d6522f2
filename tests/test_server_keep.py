"""The slots' contexts across a restart, over real HTTP on a real target+draft pair: a clean
shutdown writes them, the next start reads them back and the first request evaluates only
its new tokens; a bad file or another model's directory costs speed, never the start."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from localspec.server.app import create_app
from localspec.server.keep import context_dir
from localspec.server.options import ServerSettings
from tests.test_server_http import Live, engine_settings, start, stop
from tests.test_server_slot_actions import context_restores, full_disk

PROMPT = "".join(f"def keep_{i}(x):\n    return x - {i}\n\n" for i in range(40))
MORE = "def last(x):\n    return"
ASK = {"n_predict": 8, "top_k": 1, "samplers": ["top_k"], "id_slot": 0}


def serve(target: Path, draft: Path, root: Path) -> Live:
    settings = ServerSettings(port=0, context_dir=root)
    pair = replace(engine_settings(target, draft, n_slots=1), host_cache_bytes=0)
    return start(create_app(settings, pair))


def complete(live: Live, prompt: str, **kw: Any) -> dict[str, Any]:
    with live.client() as c:
        r = c.post("/completion", json={"prompt": prompt, **ASK, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def first_life(target: Path, draft: Path, root: Path) -> tuple[list[int], Path]:
    """A daemon that served PROMPT and stopped cleanly: (its slot's tokens, the file)."""
    live = serve(target, draft, root)
    try:
        complete(live, PROMPT)
        held = list(live.service.worker.slots[0].tokens)
        directory = context_dir(root, live.service.worker.engine.identity)
    finally:
        stop(live)
    path = directory / "slot0.bin"
    assert path.is_file()
    return held, path


def test_a_restart_finds_the_context(qwen_target: Path, qwen_draft: Path, tmp_path: Path) -> None:
    held, _ = first_life(qwen_target, qwen_draft, tmp_path)
    live = serve(qwen_target, qwen_draft, tmp_path)
    try:
        assert live.service.worker.slots[0].tokens == held  # read back at start
        with live.client() as c:  # and counted in /metrics under its source
            restores = context_restores(c)
        contexts, tokens, seconds = restores["restart"]
        assert (contexts, tokens) == (1, len(held)) and seconds > 0
        assert restores["slot_file"] == (0, 0, 0) and "host_cache" not in restores  # none here
        answer = complete(live, PROMPT + MORE)
        assert answer["timings"]["prompt_n"] < 20 and answer["tokens_cached"] >= len(held) - 8
        cold = complete(live, PROMPT + MORE, cache_prompt=False)
        assert cold["timings"]["prompt_n"] > 300
    finally:
        stop(live)


def test_a_corrupt_file_costs_speed_only(
    qwen_target: Path, qwen_draft: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _, path = first_life(qwen_target, qwen_draft, tmp_path)
    data = bytearray(path.read_bytes())
    data[-64] ^= 0xFF
    path.write_bytes(bytes(data))
    live = serve(qwen_target, qwen_draft, tmp_path)
    try:
        assert live.service.worker.slots[0].tokens == []
        assert any("dropped the kept context" in r.getMessage() for r in caplog.records)
        with live.client() as c:
            assert context_restores(c)["restart"] == (0, 0, 0)  # a dropped file restored nothing
        assert complete(live, PROMPT)["timings"]["prompt_n"] > 300  # serving, cold
    finally:
        stop(live)
    assert path.is_file()  # the clean shutdown wrote a good one again


def test_another_model_never_reads_them(
    qwen_target: Path, qwen_draft: Path, qwen_target_f16: Path, tmp_path: Path
) -> None:
    _, path = first_life(qwen_target, qwen_draft, tmp_path)
    live = serve(qwen_target_f16, qwen_draft, tmp_path)
    try:
        assert live.service.worker.slots[0].tokens == []
        other = context_dir(tmp_path, live.service.worker.engine.identity)
        assert other != path.parent
    finally:
        stop(live)
    assert path.is_file()  # the first model's contexts are still there for it


def test_a_full_disk_at_shutdown_costs_speed_only(
    qwen_target: Path,
    qwen_draft: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The contexts' writes fail for space (the kernel's ENOSPC, tests/test_server_slot_
    actions.py's full_disk): the shutdown logs it and completes, leaves no partial file, and
    the next start serves, cold."""
    _, path = first_life(qwen_target, qwen_draft, tmp_path)
    live = serve(qwen_target, qwen_draft, tmp_path)
    try:
        complete(live, PROMPT)
        full_disk(monkeypatch, path.parent)
    finally:
        stop(live)
    messages = [r.getMessage() for r in caplog.records]
    assert any(
        "could not keep the slots' contexts" in m and "No space left on device" in m
        for m in messages
    ), messages
    assert list(path.parent.iterdir()) == []  # neither the old file nor a partial one
    monkeypatch.undo()
    live = serve(qwen_target, qwen_draft, tmp_path)
    try:
        assert live.service.worker.slots[0].tokens == []
        assert complete(live, PROMPT)["timings"]["prompt_n"] > 300  # serving, cold
    finally:
        stop(live)
