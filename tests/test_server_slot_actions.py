"""POST /slots/{id}?action=save|restore|erase over real HTTP on a real target+draft pair:
llama-server's answers and refusals, and a restored slot that answers as the saved one did,
evaluating only the new tokens."""

from __future__ import annotations

import errno
import os
import tempfile
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from localspec.engine import slotstate_io
from localspec.engine.slotstate import file_identity
from localspec.engine.types import SpecSettings
from localspec.server.app import create_app
from localspec.server.options import ServerSettings
from tests.test_server_http import Live, engine_settings, start, stop

PROMPT = "".join(f"def f{i}(x):\n    return x + {i}\n\n" for i in range(30))
MORE = "def g(x):\n    return"
ASK = {"n_predict": 12, "top_k": 1, "samplers": ["top_k"], "n_probs": 2, "id_slot": 0}


@pytest.fixture(scope="module")
def saving(
    qwen_target: Path, qwen_draft: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Live]:
    directory = tmp_path_factory.mktemp("slots")
    settings = ServerSettings(port=0, slot_save_path=directory)
    # the draft model drafts every request: its cache holds the slot's window too
    pair = replace(engine_settings(qwen_target, qwen_draft), spec=SpecSettings(mode="draft"))
    live = start(create_app(settings, pair))
    yield live
    stop(live)


@pytest.fixture
def c(saving: Live) -> Iterator[httpx.Client]:
    with saving.client() as client:
        yield client


def context_restores(c: httpx.Client) -> dict[str, tuple[float, float, float]]:
    """/metrics' restored slot contexts by source: (contexts, tokens, seconds)."""
    values: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(c.get("/metrics").text):
        if family.name.startswith("localspec_context_"):
            for sample in family.samples:
                values.setdefault(sample.labels["source"], {})[sample.name] = sample.value
    return {
        source: (
            v["localspec_context_restores_total"],
            v["localspec_context_restored_tokens_total"],
            v["localspec_context_restore_seconds_total"],
        )
        for source, v in values.items()
    }


def full_disk(monkeypatch: pytest.MonkeyPatch, directory: Path) -> None:
    """Files written into ``directory`` through a temporary file (slotstate_io's atomic write)
    go to /dev/full: each write fails with the kernel's own ENOSPC, as on a full disk, without
    root, a mount or a disk to fill. The temporary file is still made there (its removal after
    the failure is what is checked); other directories are untouched."""
    original = tempfile.mkstemp

    def mkstemp(*args: Any, **kw: Any) -> tuple[int, str]:
        fd, name = original(*args, **kw)
        if Path(name).parent != directory:
            return fd, name
        os.close(fd)
        return os.open("/dev/full", os.O_WRONLY), name

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)


def held(live: Live, slot: int) -> list[int]:
    return list(live.service.worker.slots[slot].tokens)


def complete(c: httpx.Client, prompt: str, **kw: Any) -> dict[str, Any]:
    r = c.post("/completion", json={"prompt": prompt, **ASK, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def fill(c: httpx.Client, slot: int = 0) -> None:
    complete(c, PROMPT, n_predict=0, id_slot=slot)


def act(c: httpx.Client, slot: int | str, action: str, filename: str | None = None) -> Any:
    body = {} if filename is None else {"filename": filename}
    return c.post(f"/slots/{slot}", params={"action": action}, json=body)


def test_refused_without_a_save_directory(qwen_target: Path) -> None:
    live = start(create_app(ServerSettings(port=0), engine_settings(qwen_target, n_slots=1)))
    try:
        with live.client() as c:
            for action in ("save", "restore", "erase"):
                r = act(c, 0, action, "x.bin")
                assert r.status_code == 400
                err = r.json()["error"]
                assert err["type"] == "invalid_request_error"
                assert "--slot-save-path" in err["message"]
            assert c.get("/health").status_code == 200
    finally:
        stop(live)


def test_save_erase_restore_continues_as_the_saved_slot(saving: Live, c: httpx.Client) -> None:
    complete(c, PROMPT, n_predict=4)  # the draft model drafts: its cache holds the prompt too
    kept = held(saving, 0)
    r = act(c, 0, "save", "ctx.bin")
    assert r.status_code == 200, r.text
    drafts = saving.service.worker.engine.pair.dcache.slots[0]
    kept_draft = list(drafts.tokens)  # settled by the save
    assert len(kept_draft) > 100  # the draft's window: saved and restored beside the target's
    saved = r.json()
    assert saved["id_slot"] == 0 and saved["filename"] == "ctx.bin"
    assert saved["n_saved"] == len(kept) > 100
    path = saving.service.settings.slot_save_path / "ctx.bin"
    assert saved["n_written"] == path.stat().st_size and "save_ms" in saved["timings"]
    warm = complete(c, PROMPT + MORE)  # on the slot as it was saved
    n_new = warm["timings"]["prompt_n"]
    assert 0 < n_new < 10 and warm["tokens_cached"] >= len(kept)

    r = act(c, 0, "erase")
    assert r.status_code == 200 and r.json()["id_slot"] == 0
    assert r.json()["n_erased"] >= len(kept) and held(saving, 0) == []
    before = context_restores(c)
    r = act(c, 0, "restore", "ctx.bin")
    assert r.status_code == 200, r.text
    restored = r.json()
    assert restored["n_restored"] == len(kept) and restored["n_read"] == saved["n_written"]
    assert "restore_ms" in restored["timings"] and held(saving, 0) == kept
    # /metrics counts the restore under its source, with its tokens and the time it answered
    after = context_restores(c)
    pairs = zip(after["slot_file"], before["slot_file"], strict=True)
    contexts, tokens, seconds = (a - b for a, b in pairs)
    assert (contexts, tokens) == (1, len(kept))
    assert seconds == pytest.approx(restored["timings"]["restore_ms"] / 1e3, rel=1e-6)
    assert after["restart"] == before["restart"] == (0, 0, 0)
    assert drafts.tokens == kept_draft
    again = complete(c, PROMPT + MORE)
    # only the new tokens were evaluated, on the saved KV (the drafts' batches may differ
    # from the first run's, as the speculation policy learned: logits round apart by ~1e-6)
    assert again["timings"]["prompt_n"] == n_new
    assert again["content"] == warm["content"]
    for a, b in zip(
        again["completion_probabilities"], warm["completion_probabilities"], strict=True
    ):
        assert a["id"] == b["id"] and abs(a["logprob"] - b["logprob"]) < 1e-3
    # and a cold evaluation answers the same: no choice of it is a near tie that rounding
    # could part, so this holds on any CPU
    cold = complete(c, PROMPT + MORE, cache_prompt=False)
    top = [e["top_logprobs"] for e in cold["completion_probabilities"]]
    assert min(t[0]["logprob"] - t[1]["logprob"] for t in top) > 0.05, top
    assert again["content"] == cold["content"]
    assert cold["timings"]["prompt_n"] > 100


def test_bad_requests_answer_400(saving: Live, c: httpx.Client) -> None:
    for name in ("../escape.bin", "a/b.bin", "..", "", "x:y", " lead", "dot."):
        r = act(c, 0, "save", name)
        assert r.status_code == 400, name
        assert r.json()["error"] == {
            "code": 400,
            "message": "Invalid filename",
            "type": "invalid_request_error",
        }
    assert not (saving.service.settings.slot_save_path.parent / "escape.bin").exists()
    assert act(c, 0, "save").status_code == 400  # no filename
    assert act(c, 0, "jump", "x.bin").json()["error"]["message"] == "Invalid action"
    for slot in ("abc", "7", "-1"):
        assert act(c, slot, "erase").json()["error"]["message"] == "Invalid slot ID"
    before = context_restores(c)
    r = act(c, 0, "restore", "missing.bin")
    assert r.status_code == 400 and "Unable to restore slot" in r.json()["error"]["message"]
    assert context_restores(c) == before  # a refused restore is not counted


def _refused(saving: Live, c: httpx.Client, data: bytes, caplog: pytest.LogCaptureFixture) -> str:
    """Restore ``data`` into slot 0: refused, logged, and both slots keep what they held."""
    (saving.service.settings.slot_save_path / "bad.bin").write_bytes(data)
    before = held(saving, 0), held(saving, 1)
    caplog.clear()
    r = act(c, 0, "restore", "bad.bin")
    assert r.status_code == 400, r.text
    assert (held(saving, 0), held(saving, 1)) == before
    assert any("refused to restore slot 0" in rec.getMessage() for rec in caplog.records)
    assert complete(c, MORE, n_predict=2, id_slot=1)["tokens_predicted"] >= 1  # still serving
    return str(r.json()["error"]["message"])


def test_corrupt_truncated_and_other_models_states_are_refused(
    saving: Live, c: httpx.Client, qwen_target_f16: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fill(c, 0)
    fill(c, 1)
    assert act(c, 0, "save", "good.bin").status_code == 200
    before = context_restores(c)["slot_file"]
    good = (saving.service.settings.slot_save_path / "good.bin").read_bytes()
    flipped = bytearray(good)
    flipped[-100] ^= 0xFF
    assert "checksum" in _refused(saving, c, bytes(flipped), caplog)
    assert "truncated" in _refused(saving, c, good[: len(good) // 2], caplog)
    assert "magic" in _refused(saving, c, b"GGUF" + good[4:], caplog)
    # the same state, as a daemon serving another target would have written it
    engine = saving.service.worker.engine
    snap, _ = slotstate_io.read(
        saving.service.settings.slot_save_path / "good.bin", engine.identity
    )
    other = saving.service.settings.slot_save_path / "other.bin"
    slotstate_io.write(
        other, snap, {**engine.identity, "target": file_identity(str(qwen_target_f16))}
    )
    assert "other model files" in _refused(saving, c, other.read_bytes(), caplog)
    assert context_restores(c)["slot_file"] == before  # none of the refused ones counted
    assert act(c, 0, "restore", "good.bin").status_code == 200  # the good one still restores
    assert context_restores(c)["slot_file"][0] == before[0] + 1


def test_a_failed_write_is_a_500_and_keeps_the_old_file(
    saving: Live, c: httpx.Client, caplog: pytest.LogCaptureFixture
) -> None:
    """The directory cannot take the file (it is a file; a full disk: the next test): 500 in
    llama-server's format, a log line, the slot and the daemon as they were."""
    fill(c, 0)
    before = held(saving, 0)
    svc = saving.service
    original = svc.settings
    blocked = original.slot_save_path / "not-a-dir"
    blocked.write_bytes(b"x")
    svc.settings = replace(original, slot_save_path=blocked)
    try:
        r = act(c, 0, "save", "ctx.bin")
    finally:
        svc.settings = original
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    assert r.json()["error"]["message"].startswith("Unable to save slot")
    assert any("saving slot 0" in rec.getMessage() for rec in caplog.records)
    assert held(saving, 0) == before and blocked.read_bytes() == b"x"
    assert act(c, 0, "save", "after.bin").status_code == 200


def test_a_full_disk_is_a_500_and_keeps_the_old_file(
    saving: Live, c: httpx.Client, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The write itself fails for space (ENOSPC, mid-file): 500 with the system's reason, a
    log line, no temporary file left, the old file and the slot as they were, and the old
    file still restores."""
    directory = saving.service.settings.slot_save_path
    assert act(c, 0, "erase").status_code == 200
    fill(c, 0)
    r = act(c, 0, "save", "full.bin")
    assert r.status_code == 200, r.text
    n_old = r.json()["n_saved"]
    old = (directory / "full.bin").read_bytes()
    complete(c, PROMPT + MORE, n_predict=2)  # the slot now holds more than the old file
    before = held(saving, 0)
    assert len(before) > n_old
    with monkeypatch.context() as m:
        full_disk(m, directory)
        r = act(c, 0, "save", "full.bin")
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    assert r.json()["error"]["message"] == f"Unable to save slot: {os.strerror(errno.ENOSPC)}"
    assert any("saving slot 0" in rec.getMessage() for rec in caplog.records)
    assert (directory / "full.bin").read_bytes() == old
    assert not list(directory.glob(".full.bin.*"))  # the partial temporary file is gone
    assert held(saving, 0) == before and c.get("/health").status_code == 200
    r = act(c, 0, "restore", "full.bin")
    assert r.status_code == 200 and r.json()["n_restored"] == n_old


def test_an_action_on_a_busy_slot_waits_for_its_request(saving: Live, c: httpx.Client) -> None:
    """llama-server defers a slot action while the slot is processing: the save answers once
    the generation ended, with the slot's whole context."""
    import threading
    import time

    done: list[dict[str, Any]] = []
    body = {"prompt": PROMPT, "n_predict": 200, "ignore_eos": True, "id_slot": 1, "top_k": 1}

    def generate() -> None:
        with saving.client() as other:
            done.append(other.post("/completion", json=body).json())

    thread = threading.Thread(target=generate)
    thread.start()
    slots = saving.service.worker.slots
    busy = [s.id for s in slots if s.is_processing]
    while not busy and thread.is_alive():  # until the generation holds its slot
        time.sleep(0.001)
        busy = [s.id for s in slots if s.is_processing]
    r = act(c, busy[0], "save", "busy.bin")
    thread.join(120)
    assert r.status_code == 200, r.text
    # saved after the generation: its prompt and (all but the last of) its 200 tokens
    assert done and done[0]["id_slot"] == busy[0]
    assert r.json()["n_saved"] == len(held(saving, busy[0])) >= done[0]["tokens_evaluated"] + 199
