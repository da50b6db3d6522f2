"""What llama.cpp allocated, per device and kind, read from its own load log.

llama.cpp has no API that returns its buffer sizes, but it logs every one as it allocates it
(``Vulkan0 model buffer size = 256.60 MiB``, ``CPU KV buffer size``, ``Vulkan0 compute buffer
size``, ``CPU output buffer size``). The engine's log callback hands each line to the
recorder active on the loading thread; the buffer-type name says where the buffer lives.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

MiB = 1024**2
HOST = "host"
KINDS = ("model", "kv", "compute")

# "llama_kv_cache:    Vulkan0 KV buffer size =    22.50 MiB"; output (the host logits) is
# counted with compute, as the planner does
_BUFFER = re.compile(
    r"(?P<buft>[\w.-]+)\s+(?P<kind>model|KV|compute|output) buffer size =\s+(?P<mib>[\d.]+) MiB"
)
_KIND = {"model": "model", "KV": "kv", "compute": "compute", "output": "compute"}
# what llama.cpp and its backends log when a buffer does not fit (CPU, CUDA, Vulkan, Metal)
_NO_MEMORY = re.compile(
    r"failed to allocate|unable to allocate|out of memory|allocation of size \d+ failed"
    r"|OutOfDeviceMemory|ErrorOutOfHostMemory",
    re.IGNORECASE,
)


@dataclass
class Allocations:
    """Bytes by buffer type and kind, as llama.cpp logged them while this recorder was on."""

    by_buffer: dict[str, dict[str, int]] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)  # allocations llama.cpp said failed

    def feed(self, line: str) -> None:
        if _NO_MEMORY.search(line):
            self.failures.append(line.strip())
        for m in _BUFFER.finditer(line):
            kinds = self.by_buffer.setdefault(m.group("buft"), dict.fromkeys(KINDS, 0))
            kinds[_KIND[m.group("kind")]] += round(float(m.group("mib")) * MiB)

    def merged(self, other: Allocations) -> Allocations:
        out = Allocations({b: dict(k) for b, k in self.by_buffer.items()})
        for buft, kinds in other.by_buffer.items():
            mine = out.by_buffer.setdefault(buft, dict.fromkeys(KINDS, 0))
            for kind, n in kinds.items():
                mine[kind] += n
        return out

    def by_device(self, device_buffers: Mapping[str, str]) -> dict[str, dict[str, int]]:
        """Bytes per device and kind: ``device_buffers`` maps each offload device's buffer
        type (``Vulkan0``) to its device name; every other buffer (``CPU``, ``CPU_Mapped``,
        ``CPU_REPACK``, ``Vulkan_Host``: pinned host memory) is the host's."""
        out: dict[str, dict[str, int]] = {}
        for buft, kinds in self.by_buffer.items():
            where = device_buffers.get(buft, HOST)
            mine = out.setdefault(where, dict.fromkeys(KINDS, 0))
            for kind, n in kinds.items():
                mine[kind] += n
        return out


def combine(parts: Iterable[Allocations]) -> Allocations:
    total = Allocations()
    for part in parts:
        total = total.merged(part)
    return total


_local = threading.local()


def feed(text: str) -> None:
    """Called from the llama.cpp log callback with every line it logs."""
    recorder: Allocations | None = getattr(_local, "recorder", None)
    if recorder is not None:
        recorder.feed(text)


@contextmanager
def recording() -> Iterator[Allocations]:
    """Record the buffers llama.cpp logs on this thread inside the ``with`` block (a model
    load, a context creation)."""
    outer = getattr(_local, "recorder", None)
    mine = Allocations()
    _local.recorder = mine
    try:
        yield mine
    finally:
        _local.recorder = outer
        if outer is not None:
            outer.by_buffer = outer.merged(mine).by_buffer
            outer.failures += mine.failures
