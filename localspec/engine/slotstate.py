"""A slot's context as bytes: its KV in the target and the draft, and what the cache knew of it.

llama.cpp's per-sequence state API (``llama_state_seq_get_data``/``set_data``) copies one
sequence's KV cells with their positions; :class:`SeqState`'s bookkeeping (the tokens, how
many of them are exact, the ring-block spans) travels with it, so a restored slot reuses its
cache exactly as the slot that was saved would have: a request continuing the prompt
evaluates only its new tokens, and its answer is a cold evaluation's.

Only the engine's thread calls these (the engine is not thread-safe).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
from dataclasses import asdict, dataclass, field
from typing import Any

import llama_cpp as C
import numpy as np

from localspec.engine.cache import SeqState, SlotCaches, TailDrift
from localspec.engine.errors import EngineError
from localspec.engine.llama import Context
from localspec.engine.pair import ModelPair

IDENTITY_SAMPLE = 1 << 20  # bytes read at each end of a model file for its identity


class StateError(EngineError):
    """A state that cannot go into this engine's slot (another model, no room in the KV)."""


@dataclass
class SeqSnapshot:
    """One sequence: its cells as llama.cpp serializes them, and the cache's bookkeeping."""

    data: np.ndarray  # uint8
    meta: dict[str, Any] = field(default_factory=dict)  # SeqState's fields but seq ids

    @property
    def n_tokens(self) -> int:
        return len(self.meta.get("tokens", ()))


@dataclass
class SlotSnapshot:
    """A slot's context in both models (``draft`` None without a draft model)."""

    target: SeqSnapshot
    draft: SeqSnapshot | None

    @property
    def tokens(self) -> list[int]:
        return list(self.target.meta.get("tokens", []))

    @property
    def n_bytes(self) -> int:
        return self.target.data.nbytes + (self.draft.data.nbytes if self.draft else 0)


def file_identity(path: str) -> str:
    """A model file's identity: its size and a hash of its first and last MiB (the header,
    the tensor table and the end of the weights) — a changed or other file differs there."""
    size = os.path.getsize(path)
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(IDENTITY_SAMPLE))
        if size > IDENTITY_SAMPLE:
            f.seek(max(IDENTITY_SAMPLE, size - IDENTITY_SAMPLE))
            h.update(f.read(IDENTITY_SAMPLE))
    return h.hexdigest()


def pair_identity(pair: ModelPair) -> dict[str, Any]:
    """What a saved state is tied to: both model files and the KV's cell types."""
    s = pair.settings
    return {
        "target": file_identity(s.target.path),
        "draft": file_identity(s.draft.path) if s.draft is not None else None,
        "type_k": s.target.type_k,
        "type_v": s.target.type_v,
    }


def _get(ctx: Context, seq: int) -> np.ndarray:
    size = int(C.llama_state_seq_get_size(ctx.handle, seq))
    host = np.empty(size, dtype=np.uint8)
    if size == 0:
        return host
    n = int(
        C.llama_state_seq_get_data(
            ctx.handle, host.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), size, seq
        )
    )
    if n != size:
        raise StateError(f"llama.cpp copied {n} of sequence {seq}'s {size} state bytes")
    return host


def _meta(st: SeqState) -> dict[str, Any]:
    return {
        "tokens": list(st.tokens),
        "exact": st.exact,
        "spans": [list(s) for s in st.spans],
        "sink": st.sink,
        "tail": asdict(st.tail),
    }


def take(pair: ModelPair, slot: int) -> SlotSnapshot:
    """The slot's context as it is now (the caller makes sure no request runs on it)."""
    pair.check_slot(slot)
    pair.settle_draft()  # the draft's cache then holds verified tokens only
    assert pair.tctx is not None
    st = pair.tcache.slots[slot]
    target = SeqSnapshot(_get(pair.tctx, st.seq), _meta(st))
    draft = None
    if pair.dcache is not None and pair.dctx is not None:
        dst = pair.dcache.slots[slot]
        draft = SeqSnapshot(_get(pair.dctx, dst.seq), _meta(dst))
    return SlotSnapshot(target, draft)


def _put(cache: SlotCaches, st: SeqState, snap: SeqSnapshot) -> None:
    cache.clear(st)
    if snap.data.size == 0 or not snap.meta.get("tokens"):
        return
    data = np.ascontiguousarray(snap.data, dtype=np.uint8)
    ptr = data.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
    n = int(C.llama_state_seq_set_data(cache.ctx.handle, ptr, data.size, st.seq))
    if n == 0:
        cache.clear(st)
        raise StateError("the state does not fit this context's KV cache, or is not its own")
    meta = snap.meta
    tokens = [int(t) for t in meta["tokens"]]
    if cache.ctx.seq_pos_max(st.seq) != len(tokens) - 1:
        cache.clear(st)
        raise StateError("the state's cells do not match its tokens")
    st.tokens = tokens
    st.exact = min(int(meta.get("exact", 0)), len(tokens))
    st.spans = [(int(a), int(b)) for a, b in meta.get("spans", [])]
    st.sink = bool(meta.get("sink", False))
    st.tail = TailDrift(**meta["tail"]) if "tail" in meta else TailDrift()


def put(pair: ModelPair, slot: int, snap: SlotSnapshot) -> None:
    """Make the slot hold ``snap`` in both models. On failure the slot is empty (never half
    of a state) and StateError says why; other slots are untouched."""
    pair.check_slot(slot)
    n_ctx = pair.n_ctx
    if snap.target.n_tokens > n_ctx:
        raise StateError(f"the state holds {snap.target.n_tokens} tokens; a slot holds {n_ctx}")
    if (snap.draft is None) != (pair.dcache is None):
        raise StateError("the state was saved with another draft model setup")
    pair.settle_draft()
    try:
        _put(pair.tcache, pair.tcache.slots[slot], snap.target)
        if pair.dcache is not None and snap.draft is not None:
            _put(pair.dcache, pair.dcache.slots[slot], snap.draft)
    except BaseException:
        pair.clear_slot(slot)
        raise
