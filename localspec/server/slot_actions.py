"""``POST /slots/{id}?action=save|restore|erase``: llama-server's slot actions.

Their answers, error texts and rules are llama-server's (tools/server: ``post_slots``,
``SERVER_TASK_TYPE_SLOT_*``): refused (400, where llama-server answers 501) while no save
directory is set (``server.slot_save_path``, its ``--slot-save-path``), a file name checked
by ``fs_validate_filename``'s rule, an action on a busy slot waiting until the slot is free.
The state is both models' KV of the slot (engine/slotstate.py) in a file tied to the model
files (engine/slotstate_io.py): a file from other models, or a corrupt or truncated one, is
refused with a log line and the slot keeps what it held. The KV is copied on the engine's
thread; the file is written and read (and checked) off it, so other slots keep serving.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response

from localspec.engine import slotstate_io
from localspec.engine.slotstate import SlotSnapshot, StateError
from localspec.server.dispatch import error_response
from localspec.server.errors import ApiError, InvalidRequest, NotSupported, Unavailable
from localspec.server.results import CompactJSONResponse

log = logging.getLogger("localspec.server")
router = APIRouter()
T = TypeVar("T")
BUSY_POLL_S = 0.02  # how often an action on a busy slot looks again


class _Busy(Exception):
    """The slot runs a request; the action waits (llama-server defers the task)."""


@router.post("/slots/{id_slot}")
async def slot_action(id_slot: str, request: Request, action: str = "") -> Response:
    """Save, restore or erase a slot's context."""
    svc = request.app.state.service
    try:
        return CompactJSONResponse(await _act(svc, request, id_slot, action))
    except ApiError as exc:
        return error_response(exc, request)


async def _act(svc: Any, request: Request, id_slot: str, action: str) -> dict[str, Any]:
    directory = svc.settings.slot_save_path
    if directory is None:
        # llama-server's text; a 400, not its 501: no request the client can send makes the
        # daemon answer a 5xx, and the fix is in the client's setup (a save directory)
        raise InvalidRequest(
            "This server does not support slots action. Start it with `--slot-save-path` "
            "(server.slot_save_path)"
        )
    try:
        slot = int(id_slot)
    except ValueError:
        raise InvalidRequest("Invalid slot ID") from None
    if action not in ("save", "restore", "erase"):
        raise InvalidRequest("Invalid action")
    engine = svc.engine
    if not hasattr(engine, "save_slot"):
        raise NotSupported("This engine cannot save its slots")
    if not 0 <= slot < engine.n_slots:
        raise InvalidRequest("Invalid slot ID")
    timeout = svc.settings.request_timeout_s
    if action == "erase":

        def erase(e: Any) -> int:
            n = len(e.slots[slot].cached())
            e.clear_slot(slot)
            return n

        n_erased = await _when_free(svc, slot, erase, timeout)
        return {"id_slot": slot, "n_erased": n_erased}
    filename = _filename(await request.body())
    path = Path(directory).expanduser() / filename
    t0 = time.perf_counter()
    if action == "save":
        snap: SlotSnapshot = await _when_free(svc, slot, lambda e: e.save_slot(slot), timeout)
        try:
            n_written = await run_in_threadpool(_write, path, snap, engine.identity)
        except OSError as exc:
            log.error("saving slot %d to %s failed: %s", slot, path, exc)
            raise ApiError(f"Unable to save slot: {exc.strerror or exc}") from None
        return {
            "id_slot": slot,
            "filename": filename,
            "n_saved": len(snap.tokens),
            "n_written": n_written,
            "timings": {"save_ms": (time.perf_counter() - t0) * 1e3},
        }
    try:
        snap, n_read = await run_in_threadpool(slotstate_io.read, path, engine.identity)
    except FileNotFoundError:
        raise InvalidRequest(f"Unable to restore slot: no file {filename!r}") from None
    except (slotstate_io.StateFileError, OSError) as exc:
        log.warning("refused to restore slot %d from %s: %s", slot, path, exc)
        raise InvalidRequest(f"Unable to restore slot: {exc}") from None
    try:
        await _when_free(svc, slot, lambda e: e.restore_slot(slot, snap), timeout)
    except StateError as exc:
        log.warning("refused to restore slot %d from %s: %s", slot, path, exc)
        raise InvalidRequest(f"Unable to restore slot: {exc}") from None
    seconds = time.perf_counter() - t0
    svc.restores.add("slot_file", len(snap.tokens), seconds)
    return {
        "id_slot": slot,
        "filename": filename,
        "n_restored": len(snap.tokens),
        "n_read": n_read,
        "timings": {"restore_ms": seconds * 1e3},
    }


def _filename(raw: bytes) -> str:
    try:
        body = json.loads(raw or b"{}")
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidRequest(f"Invalid JSON body: {exc}") from None
    name = body.get("filename") if isinstance(body, dict) else None
    if not isinstance(name, str):
        raise InvalidRequest("'filename' is required: a file name in the slot save directory")
    if not slotstate_io.valid_filename(name):
        raise InvalidRequest("Invalid filename")
    return name


def _write(path: Path, snap: SlotSnapshot, identity: dict[str, Any]) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    return slotstate_io.write(path, snap, identity)


async def _when_free(svc: Any, slot: int, fn: Callable[[Any], T], timeout: float) -> T:
    """``fn(engine)`` on the engine's thread once no request runs or waits on ``slot``."""

    def guarded(engine: Any) -> T:
        if engine.slots[slot].is_processing:
            raise _Busy
        return fn(engine)

    deadline = time.monotonic() + timeout
    while True:
        try:
            return await asyncio.wrap_future(svc.worker.call(guarded))
        except _Busy:
            if time.monotonic() > deadline:
                raise Unavailable(f"slot {slot} stayed busy for {timeout:g} s") from None
            await asyncio.sleep(BUSY_POLL_S)
