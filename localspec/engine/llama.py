"""The thin layer over llama-cpp-python's ctypes API: models, contexts, batches, KV memory.

Every llama.cpp call the engine makes goes through here, timed into ``Clock.inside_ms`` so
the engine can report the share of wall time spent outside llama.cpp.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import llama_cpp.llama_cpp as C
import numpy as np

from localspec.engine import alloc
from localspec.engine.errors import DecodeError, ModelLoadError, OutOfMemoryError
from localspec.engine.threads import ThreadGovernor, physical_cores
from localspec.engine.types import ModelSettings
from localspec.planning.types import default_flash_attn

_KV_TYPES = {
    "f32": C.GGML_TYPE_F32,
    "f16": C.GGML_TYPE_F16,
    "q8_0": C.GGML_TYPE_Q8_0,
    "q4_0": C.GGML_TYPE_Q4_0,
    "q4_1": C.GGML_TYPE_Q4_1,
    "q5_0": C.GGML_TYPE_Q5_0,
    "q5_1": C.GGML_TYPE_Q5_1,
}

_log = logging.getLogger("localspec.llama")


@C.llama_log_callback
def _log_line(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    """Every line feeds the allocation recorder (engine/alloc.py); llama.cpp's errors go to our
    logger and its chatter (load lines, warnings) is dropped. LOCALSPEC_LLAMA_LOG=1 shows it
    all on stderr."""
    line = text.decode("utf-8", errors="replace")
    alloc.feed(line)
    if _show_all:
        sys.stderr.write(line)
    elif level == 4:  # GGML_LOG_LEVEL_ERROR
        _log.error("%s", line.rstrip())


_show_all = bool(os.environ.get("LOCALSPEC_LLAMA_LOG"))
_backend_lock = threading.Lock()
_backend_ready = False


def _own_log() -> None:
    """Route llama.cpp's log through ``_log_line`` (again: a test or llama-cpp-python may have
    set its own callback since)."""
    C.llama_log_set(_log_line, ctypes.c_void_p(0))


def init_backend() -> None:
    """llama.cpp's backends initialised, its log routed through localspec's (once)."""
    _init_backend()


def _init_backend() -> None:
    """Once per process."""
    global _backend_ready
    with _backend_lock:
        if _backend_ready:
            return
        _own_log()
        C.llama_backend_init()
        _backend_ready = True


class Clock:
    """Accumulates the time spent inside llama.cpp calls."""

    __slots__ = ("inside_ms",)

    def __init__(self) -> None:
        self.inside_ms = 0.0


# the largest llama.cpp state ``Context.compact`` copies through host memory (a 135M model's
# 4096 cells are ~94 MiB; a 7B model's 8192 are ~460 MiB)
COMPACT_MAX_BYTES = 512 * 2**20


def _available_memory() -> int:
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except Exception:  # psutil missing or unable to tell: trust the fixed cap alone
        return 1 << 62


def check_gguf_file(path: str) -> None:
    """Fail early with a message naming the file (llama.cpp would only say 'failed to load')."""
    p = Path(path)
    if not p.exists():
        raise ModelLoadError(f"model file not found: {path}")
    if not p.is_file():
        raise ModelLoadError(f"model path is not a file: {path}")
    size = p.stat().st_size
    with p.open("rb") as fh:
        magic = fh.read(4)
    if magic != b"GGUF":
        raise ModelLoadError(
            f"not a GGUF file: {path} (starts with {magic!r}, {size} bytes); "
            "download it again or pick the .gguf file"
        )


def gpu_split(shares: tuple[float, ...] | None, n_max: int) -> ctypes.Array[ctypes.c_float] | None:
    """llama.cpp's tensor_split: one float per possible device (it reads llama_max_devices()
    of them); None when the plan leaves the split to llama.cpp."""
    if not shares:
        return None
    if len(shares) > n_max:
        raise ValueError(f"tensor_split names {len(shares)} GPUs; this build supports {n_max}")
    if any(s < 0 for s in shares) or sum(shares) <= 0:
        raise ValueError(f"tensor_split must be non-negative shares, not {shares}")
    return (ctypes.c_float * n_max)(*shares)


def cpu_runs_amx() -> bool:
    """Whether llama.cpp's CPU backend was built with AMX kernels (and so runs them on this
    CPU: a native build has them only where the CPU does)."""
    _init_backend()
    return b"AMX_INT8 = 1" in C.llama_print_system_info()


def default_repack_weights() -> bool:
    """llama.cpp's extra weight buffers (repacked layouts, AMX tiles) are on, except where its
    AMX kernels run: they crash on some Sapphire Rapids machines at the first batch of two or
    more tokens on any quantized weight (llama.cpp #20824, seen on the build machines), and
    the AMX buffer keeps a second copy of the weights the memory plan does not count."""
    return not cpu_runs_amx()


def resolved_flash_attn(settings: ModelSettings, n_slots: int) -> bool:
    """The model's ``flash_attn`` setting, or the one rule's choice where it is None."""
    if settings.flash_attn is not None:
        return settings.flash_attn
    on_gpu = settings.n_gpu_layers != 0 and bool(C.llama_supports_gpu_offload())
    return default_flash_attn(on_gpu, settings.type_k, settings.type_v, n_slots)


def model_params(settings: ModelSettings) -> C.llama_model_params:
    """llama.cpp's load parameters for ``settings`` (the memory test loads with these too)."""
    _init_backend()
    params = C.llama_model_default_params()
    params.n_gpu_layers = settings.n_gpu_layers
    params.main_gpu = settings.main_gpu
    repack = settings.repack_weights
    params.use_extra_bufts = default_repack_weights() if repack is None else repack
    return params


class Model:
    """A loaded GGUF model (weights only; contexts hold the KV cache)."""

    def __init__(self, settings: ModelSettings) -> None:
        _init_backend()
        check_gguf_file(settings.path)
        params = model_params(settings)
        split = gpu_split(settings.tensor_split, int(C.llama_max_devices()))
        if split is not None and settings.n_gpu_layers > 0:
            params.tensor_split = ctypes.cast(split, ctypes.POINTER(ctypes.c_float))
        _own_log()
        with alloc.recording() as allocated:
            handle = C.llama_model_load_from_file(str(settings.path).encode(), params)
        if not handle:
            size = Path(settings.path).stat().st_size
            if allocated.failures:
                raise OutOfMemoryError(
                    f"llama.cpp ran out of memory loading {settings.path} ({size} bytes, "
                    f"{settings.n_gpu_layers} GPU layers): {allocated.failures[-1]}"
                )
            raise ModelLoadError(
                f"llama.cpp could not load {settings.path} ({size} bytes): the file is "
                "truncated, corrupt or of an unsupported architecture; download it again"
            )
        self.handle = handle
        self.allocated = allocated  # its weights' buffers, as llama.cpp logged them
        self.path = str(settings.path)
        self.vocab_handle = C.llama_model_get_vocab(handle)
        self.n_ctx_train = int(C.llama_model_n_ctx_train(handle))

    def close(self) -> None:
        if self.handle:
            C.llama_model_free(self.handle)
            self.handle = None


class Context:
    """One llama context: ``n_seq`` sequences sharing one unified KV buffer.

    Unified KV lets a sequence's cells be re-tagged to another sequence without a copy, which
    the cache-reuse code uses to park KV runs while it evaluates the tokens before them.
    """

    def __init__(
        self,
        model: Model,
        settings: ModelSettings,
        *,
        n_seq: int,
        n_ctx_total: int,
        clock: Clock,
        governor: ThreadGovernor | None = None,
        n_slots: int = 1,
    ) -> None:
        """``n_slots``: the slots that share this context's KV buffer (flash attention's
        default depends on it)."""
        params = C.llama_context_default_params()
        params.n_ctx = n_ctx_total
        params.n_batch = settings.n_batch
        params.n_ubatch = min(settings.n_ubatch, settings.n_batch)
        params.n_seq_max = n_seq
        params.kv_unified = True
        threads = settings.n_threads or physical_cores()
        params.n_threads = threads
        params.n_threads_batch = settings.n_threads_batch or threads
        # the most threads each kind of evaluation may use (single tokens, batches); with a
        # governor each decode runs on at most the cores other processes leave free
        self.n_threads = threads
        self.n_threads_batch = params.n_threads_batch
        self.governor = governor
        self.threads_now = (self.n_threads, self.n_threads_batch)  # as last applied
        params.no_perf = True
        flash_attn = resolved_flash_attn(settings, n_slots)
        self.flash_attn = flash_attn
        params.flash_attn_type = (
            C.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn else C.LLAMA_FLASH_ATTN_TYPE_DISABLED
        )
        for name in ("type_k", "type_v"):
            value = getattr(settings, name)
            if value not in _KV_TYPES:
                raise ModelLoadError(
                    f"unknown KV cache type {name}={value!r}: use one of {', '.join(_KV_TYPES)}"
                )
            setattr(params, name, _KV_TYPES[value])
        _own_log()
        with alloc.recording() as allocated:
            handle = C.llama_init_from_model(model.handle, params)
        if not handle:
            if allocated.failures:
                raise OutOfMemoryError(
                    f"llama.cpp ran out of memory creating a context for {model.path} "
                    f"(n_ctx={n_ctx_total}): {allocated.failures[-1]}"
                )
            raise ModelLoadError(
                f"llama.cpp could not create a context for {model.path} "
                f"(n_ctx={n_ctx_total}, n_batch={settings.n_batch}): out of memory?"
            )
        self.handle = handle
        self.allocated = allocated  # its KV, compute and output buffers
        self.model = model
        self.n_seq = n_seq
        self.clock = clock
        self.n_batch = int(C.llama_n_batch(handle))
        self.n_ctx_total = int(C.llama_n_ctx(handle))
        self.n_vocab = int(C.llama_vocab_n_tokens(model.vocab_handle))
        self.mem = C.llama_get_memory(handle)
        self.can_shift = bool(C.llama_memory_can_shift(self.mem))
        self._batch = _Batch(self.n_batch)
        # a KV shift (seq_add) is applied to K at the next decode; until then a state save
        # would store unrotated K under the new positions
        self.shift_pending = False

    # --- decoding ---------------------------------------------------------------------
    def decode(
        self, tokens: Sequence[int], pos0: int, seq: int, *, logits: str | Sequence[int] = "last"
    ) -> None:
        """Decode ``tokens`` at positions pos0.. in ``seq``; logits "last", "all", "none" or
        the listed batch indices. The caller keeps ``len(tokens) <= n_batch``."""
        self.decode_many([Segment(tokens, pos0, seq, logits)])

    def decode_many(self, segments: Sequence[Segment]) -> list[int]:
        """Decode several sequences' tokens in one llama.cpp batch (one pass over the weights
        for all of them); returns each segment's first batch index, the base for reading its
        logits (``logits(base + i)``). The caller keeps the total within ``n_batch``."""
        b = self._batch
        bases: list[int] = []
        n = 0
        for seg in segments:
            bases.append(n)
            n = b.put(n, seg)
        if n == 0:
            return bases
        b.struct.n_tokens = n
        if self.governor is not None:
            self._follow_load(self.governor.threads())
        t0 = time.perf_counter()
        rc = C.llama_decode(self.handle, b.struct)
        self.clock.inside_ms += (time.perf_counter() - t0) * 1000.0
        if rc != 0:
            where = ", ".join(f"{len(g.tokens)} at {g.pos0} of sequence {g.seq}" for g in segments)
            raise DecodeError(
                f"llama_decode failed (code {rc}) for {n} tokens ({where})"
                + (": no free KV cells" if rc == 1 else "")
            )
        self.shift_pending = False
        return bases

    def set_threads(self, n_threads: int, n_threads_batch: int | None = None) -> None:
        """Change the thread caps of a live context (the benchmark compares thread counts
        on one loaded engine)."""
        self.n_threads = n_threads
        self.n_threads_batch = n_threads_batch or n_threads
        self._apply((self.n_threads, self.n_threads_batch))

    def _follow_load(self, free: int) -> None:
        self._apply((min(self.n_threads, free), min(self.n_threads_batch, free)))

    def _apply(self, threads: tuple[int, int]) -> None:
        if threads != self.threads_now:
            C.llama_set_n_threads(self.handle, *threads)
            self.threads_now = threads

    def logits(self, i: int) -> np.ndarray:
        """The logits row of batch index ``i`` of the last decode (a view, valid until the
        next decode)."""
        ptr = C.llama_get_logits_ith(self.handle, i)
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))

    # --- KV memory ---------------------------------------------------------------------
    def seq_rm(self, seq: int, p0: int, p1: int = -1) -> None:
        t0 = time.perf_counter()
        ok = C.llama_memory_seq_rm(self.mem, seq, p0, p1)
        self.clock.inside_ms += (time.perf_counter() - t0) * 1000.0
        if not ok:
            raise DecodeError(f"llama_memory_seq_rm({seq}, {p0}, {p1}) refused")

    def seq_add(self, seq: int, p0: int, p1: int, delta: int) -> None:
        t0 = time.perf_counter()
        C.llama_memory_seq_add(self.mem, seq, p0, p1, delta)
        self.shift_pending = True
        self.clock.inside_ms += (time.perf_counter() - t0) * 1000.0

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        t0 = time.perf_counter()
        C.llama_memory_seq_cp(self.mem, src, dst, p0, p1)
        self.clock.inside_ms += (time.perf_counter() - t0) * 1000.0

    def seq_pos_max(self, seq: int) -> int:
        return int(C.llama_memory_seq_pos_max(self.mem, seq))

    def compact(self, max_bytes: int = COMPACT_MAX_BYTES) -> bool:
        """Move every used KV cell to the front of the buffer, by a state save and restore.

        llama.cpp attends over cells 0..(highest used cell), padded to 256, whichever sequence
        holds them; without flash attention each of those cells costs every new token a dot
        product, masked or not. A reuse plan keeps moved runs in their old cells, and the holes
        left around them are paid for until new tokens fill them (docs/engine.md). Refused
        (False) while a shift waits for the next decode, or when the state is larger than
        ``max_bytes`` or a quarter of the free memory (the copy is transient host memory). A
        failed restore leaves the KV empty and raises, so callers drop what they thought it
        held."""
        if self.shift_pending:
            return False
        t0 = time.perf_counter()
        try:
            size = int(C.llama_state_get_size(self.handle))
            if size <= 0 or size > min(max_bytes, _available_memory() // 4):
                return False
            # np.empty, not a ctypes array: zero-filling ~100 MB first would double the copy
            host = np.empty(size, dtype=np.uint8)
            buf = host.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
            n = int(C.llama_state_get_data(self.handle, buf, size))
            if n <= 0:
                return False
            if int(C.llama_state_set_data(self.handle, buf, n)) != n:
                self.clear()
                raise DecodeError("restoring the KV cache after compacting it failed")
            return True
        finally:
            self.clock.inside_ms += (time.perf_counter() - t0) * 1000.0

    def clear(self) -> None:
        C.llama_memory_clear(self.mem, True)

    def close(self) -> None:
        if self.handle:
            C.llama_free(self.handle)
            self.handle = None


@dataclass(frozen=True)
class Segment:
    """One sequence's tokens in a batch: at positions pos0.., logits "last", "all", "none" or
    the listed indices within the segment."""

    tokens: Sequence[int]
    pos0: int
    seq: int
    logits: str | Sequence[int] = "last"


class _Batch:
    """A llama_batch whose arrays numpy owns, one sequence id per token: a batch is filled with
    slice writes (the per-token ``seq_id`` pointers point into one int32 array, set once)."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.tok = np.zeros(cap, dtype=np.int32)
        self.pos = np.zeros(cap, dtype=np.int32)
        self.n_seq = np.ones(cap, dtype=np.int32)
        self.seq = np.zeros(cap, dtype=np.int32)
        self.out = np.zeros(cap, dtype=np.int8)
        seq_ptr = ctypes.POINTER(C.llama_seq_id)
        base = self.seq.ctypes.data
        step = self.seq.itemsize
        self._seq_ptrs = (seq_ptr * cap)(
            *(ctypes.cast(base + i * step, seq_ptr) for i in range(cap))
        )
        self.struct = C.llama_batch(
            n_tokens=0,
            token=self.tok.ctypes.data_as(ctypes.POINTER(C.llama_token)),
            embd=None,
            pos=self.pos.ctypes.data_as(ctypes.POINTER(C.llama_pos)),
            n_seq_id=self.n_seq.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)),
            seq_id=self._seq_ptrs,
            logits=self.out.ctypes.data_as(ctypes.POINTER(ctypes.c_int8)),
        )

    def put(self, at: int, seg: Segment) -> int:
        """Write ``seg`` from batch index ``at``; returns the index after it."""
        n = len(seg.tokens)
        end = at + n
        if end > self.cap:
            raise DecodeError(f"batch of {end} tokens exceeds n_batch={self.cap}")
        self.tok[at:end] = seg.tokens
        self.pos[at:end] = np.arange(seg.pos0, seg.pos0 + n, dtype=np.int32)
        self.seq[at:end] = seg.seq
        out = self.out
        logits = seg.logits
        if isinstance(logits, str):
            out[at:end] = 1 if logits == "all" else 0
            if logits == "last" and n:
                out[end - 1] = 1
        else:
            out[at:end] = 0
            out[[at + i for i in logits]] = 1
        return end
