"""The slots' contexts kept across a restart: written at a clean shutdown, read back at start.

``localspec down`` and ``up`` (an update, the login service after sleep) used to cost the
first keystrokes a full evaluation of the editor's context. At a clean shutdown the worker
writes each slot's context (both models' KV, engine/slotstate_io.py), the most recently used
first, at most ``max_bytes`` in all, under a directory named by the model files' identity;
at start the engine reads them back into their slots. A file that is corrupt, truncated or
another model's is dropped with a log line; a crash leaves the last clean shutdown's files,
still exact for the tokens they hold, so it loses nothing but speed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from localspec.engine import slotstate_io
from localspec.engine.slotstate import StateError

log = logging.getLogger("localspec.server")
MIN_TOKENS = 64  # a context shorter than this is cheaper to evaluate than to keep
OnRestore = Callable[[int, float], None]  # (tokens, seconds) of one context restored


def context_dir(root: Path, identity: dict[str, Any]) -> Path:
    """Where the contexts of these model files live (another model's never mix in)."""
    key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    return root / key


def save_contexts(engine: Any, root: Path, max_bytes: int) -> int:
    """Write the slots' contexts (on the engine's thread, no request running); returns how
    many were written. A write that fails (a full disk) is logged; the daemon stops anyway."""
    if not hasattr(engine, "save_slot"):
        return 0
    directory = context_dir(root, engine.identity)
    written, total = 0, 0
    try:
        directory.mkdir(parents=True, exist_ok=True)
        for old in directory.glob("slot*.bin"):
            old.unlink()
        for slot in sorted(engine.slots, key=lambda s: s.last_used, reverse=True):
            # a request cut short by the shutdown may have left its prompt's KV half moved
            if slot.is_processing or len(slot.cached()) < MIN_TOKENS:
                continue
            snap = engine.save_slot(slot.id)
            if total + snap.n_bytes > max_bytes:
                continue
            total += slotstate_io.write(directory / f"slot{slot.id}.bin", snap, engine.identity)
            written += 1
    except OSError as exc:
        log.warning("could not keep the slots' contexts in %s: %s", directory, exc)
    if written:
        log.info("kept %d slot contexts (%.1f MiB) in %s", written, total / (1 << 20), directory)
    return written


def resume_contexts(engine: Any, root: Path, on_restore: OnRestore | None = None) -> int:
    """Read the contexts a clean shutdown kept back into their slots; returns the tokens
    restored. A file that cannot be restored is logged and removed. ``on_restore(tokens,
    seconds)`` for each context restored (the /metrics counters)."""
    if not hasattr(engine, "restore_slot"):
        return 0
    directory = context_dir(root, engine.identity)
    restored = 0
    t0 = time.perf_counter()
    for path in sorted(directory.glob("slot*.bin")):
        t_file = time.perf_counter()
        try:
            slot = int(path.stem.removeprefix("slot"))
            if not 0 <= slot < engine.n_slots:
                raise StateError(f"no slot {slot} here (the daemon has {engine.n_slots})")
            snap, _ = slotstate_io.read(path, engine.identity)
            engine.restore_slot(slot, snap)
        except (ValueError, OSError, StateError) as exc:  # StateFileError is a ValueError
            log.warning("dropped the kept context %s: %s", path, exc)
            path.unlink(missing_ok=True)
            continue
        restored += len(snap.tokens)
        if on_restore is not None:
            on_restore(len(snap.tokens), time.perf_counter() - t_file)
    if restored:
        ms = (time.perf_counter() - t0) * 1e3
        log.info("restored %d tokens of kept slot contexts in %.0f ms", restored, ms)
    return restored


def keeping(
    load: Callable[[], Any], root: Path, on_restore: OnRestore | None = None
) -> Callable[[], Any]:
    """``load``, then the kept contexts read back (on the engine's thread)."""

    def load_and_resume() -> Any:
        engine = load()
        try:
            resume_contexts(engine, root, on_restore)
        except Exception:  # a bug here costs speed, never the start
            log.exception("reading the kept slot contexts failed")
        return engine

    return load_and_resume
