"""The devices and backends the installed llama.cpp itself sees, through ggml's backend API.

llama-cpp-python binds llama.h only; ggml's device registry (``ggml_backend_dev_*``,
``ggml_backend_reg_*``) lives in the libggml / libggml-base libraries shipped beside it, bound
here with ctypes. This is what llama.cpp offloads to: a Vulkan GPU that no vendor tool
reports is listed, and a card the build cannot use is not.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

DeviceType = Literal["cpu", "gpu", "igpu", "accel", "meta"]
# enum ggml_backend_dev_type, in order
_DEVICE_TYPES: tuple[DeviceType, ...] = ("cpu", "gpu", "igpu", "accel", "meta")


@dataclass(frozen=True)
class GgmlDevice:
    """One ggml backend device: ``name`` is how llama.cpp's logs name it (``Vulkan0``,
    ``CUDA0``, ``CPU``), ``buffer_type`` how its buffers are named in the load log."""

    name: str
    description: str
    type: DeviceType
    backend: str  # the registry's name: CPU, CUDA, Vulkan, Metal, ROCm/HIP, ...
    total_bytes: int
    free_bytes: int
    buffer_type: str
    # the largest tensor one op may touch there, where the backend has such a limit (Vulkan's
    # maxStorageBufferRange): a larger op runs on the CPU
    max_tensor_bytes: int | None = None

    @property
    def offloads(self) -> bool:
        """A device layers can be offloaded to (what ``n_gpu_layers`` counts on)."""
        return self.type in ("gpu", "igpu")


_lock = threading.Lock()
_libs: tuple[ctypes.CDLL, ctypes.CDLL] | None = None


def _load() -> tuple[ctypes.CDLL, ctypes.CDLL]:
    """libggml (the registry) and libggml-base (device calls), as llama_cpp loaded them."""
    global _libs
    with _lock:
        if _libs is not None:
            return _libs
        import llama_cpp
        from llama_cpp._ctypes_extensions import load_shared_library

        from localspec.engine.llama import init_backend

        init_backend()  # libllama and the ggml libraries loaded, their log through ours

        lib_dir = Path(llama_cpp.__file__).resolve().parent / "lib"
        ggml = load_shared_library("ggml", lib_dir)
        base = load_shared_library("ggml-base", lib_dir)
        p, size = ctypes.c_void_p, ctypes.c_size_t
        for fn, args, res in (
            (ggml.ggml_backend_dev_count, [], size),
            (ggml.ggml_backend_dev_get, [size], p),
            (ggml.ggml_backend_reg_count, [], size),
            (ggml.ggml_backend_reg_get, [size], p),
            (base.ggml_backend_dev_name, [p], ctypes.c_char_p),
            (base.ggml_backend_dev_description, [p], ctypes.c_char_p),
            (base.ggml_backend_dev_memory, [p, ctypes.POINTER(size), ctypes.POINTER(size)], None),
            (base.ggml_backend_dev_type, [p], ctypes.c_int),
            (base.ggml_backend_dev_backend_reg, [p], p),
            (base.ggml_backend_dev_buffer_type, [p], p),
            (base.ggml_backend_buft_name, [p], ctypes.c_char_p),
            (base.ggml_backend_reg_name, [p], ctypes.c_char_p),
        ):
            fn.argtypes, fn.restype = args, res
        _libs = (ggml, base)
        return _libs


def _text(raw: bytes | None) -> str:
    return (raw or b"").decode("utf-8", "replace")


def backends() -> tuple[str, ...]:
    """The backends compiled into this build, in registry order (``("Vulkan", "CPU")``)."""
    ggml, base = _load()
    return tuple(
        _text(base.ggml_backend_reg_name(ggml.ggml_backend_reg_get(i)))
        for i in range(ggml.ggml_backend_reg_count())
    )


def devices() -> list[GgmlDevice]:
    """Every device llama.cpp can use, with its total and free memory as the backend reports
    them (a Vulkan device: its heap and the memory budget extension's figure)."""
    ggml, base = _load()
    out: list[GgmlDevice] = []
    for i in range(ggml.ggml_backend_dev_count()):
        dev = ggml.ggml_backend_dev_get(i)
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        base.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        kind = int(base.ggml_backend_dev_type(dev))
        reg = base.ggml_backend_dev_backend_reg(dev)
        buft = base.ggml_backend_dev_buffer_type(dev)
        out.append(
            GgmlDevice(
                name=_text(base.ggml_backend_dev_name(dev)),
                description=_text(base.ggml_backend_dev_description(dev)),
                type=_DEVICE_TYPES[kind] if 0 <= kind < len(_DEVICE_TYPES) else "accel",
                backend=_text(base.ggml_backend_reg_name(reg)) if reg else "",
                total_bytes=int(total.value),
                free_bytes=int(free.value),
                buffer_type=_text(base.ggml_backend_buft_name(buft)) if buft else "",
            )
        )
    if any(d.backend == "Vulkan" for d in out):
        from localspec.engine.vulkan_limits import storage_buffer_ranges

        ranges = storage_buffer_ranges()
        out = [replace(d, max_tensor_bytes=ranges.get(d.description)) for d in out]
    return out


def offload_devices() -> list[GgmlDevice]:
    """The devices ``n_gpu_layers`` places layers on, in llama.cpp's order (its device
    indices: ``main_gpu``, ``tensor_split``)."""
    return [d for d in devices() if d.offloads]
