"""A GGUF header reader: metadata and tensor table only, arrays skipped, in milliseconds."""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from os import PathLike
from typing import Any

from localspec.planning.types import PlanError

GGML_TYPE_SIZES: dict[int, tuple[int, int]] = {
    0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34),
    9: (32, 40), 10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176),
    14: (256, 210), 15: (256, 292), 16: (256, 66), 17: (256, 74), 18: (256, 98),
    19: (256, 50), 20: (32, 18), 21: (256, 110), 22: (256, 82), 23: (256, 136), 24: (1, 1),
    25: (1, 2), 26: (1, 4), 27: (1, 8), 28: (1, 8), 29: (256, 56), 30: (1, 2), 34: (256, 54),
    35: (256, 66), 39: (32, 17), 40: (64, 36), 41: (128, 18),
}  # fmt: skip
"""ggml type id -> (values per block, bytes per block), as in ggml.c's type traits."""

FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1",
              10: "Q2_K", 12: "Q3_K_M", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M",
              18: "Q6_K", 30: "IQ4_XS", 32: "BF16"}  # fmt: skip
"""general.file_type -> the quant name the catalog uses."""

_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}  # fmt: skip


@dataclass(frozen=True)
class GgufHeader:
    """A GGUF's metadata (arrays as their lengths) and tensor table: (name, type, elements)."""

    metadata: dict[str, Any]
    tensors: tuple[tuple[str, int, int], ...]

    def tensor_bytes(self, name: str, ggml_type: int, n_elements: int) -> int:
        block, size = GGML_TYPE_SIZES.get(ggml_type, (1, 0))
        if size == 0:
            raise PlanError(f"tensor {name}: unknown ggml type {ggml_type}")
        return n_elements // block * size


def read_gguf_header(path: str | PathLike[str]) -> GgufHeader:
    """Read only what planning needs from a GGUF: arrays (the 150k-token vocabulary) are
    skipped, not decoded, so this takes milliseconds where gguf.GGUFReader takes seconds."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != b"GGUF":
            raise PlanError(f"{path}: not a GGUF file")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version < 2:
            raise PlanError(f"{path}: GGUF version {version} is too old")
        pos = 24

        def string(at: int) -> tuple[str, int]:
            (n,) = struct.unpack_from("<Q", buf, at)
            return bytes(buf[at + 8 : at + 8 + n]).decode("utf-8", "replace"), at + 8 + n

        def value(vtype: int, at: int) -> tuple[Any, int]:
            if vtype == 8:
                return string(at)
            if vtype == 9:
                etype, count = struct.unpack_from("<IQ", buf, at)
                at += 12
                if etype == 8:
                    for _ in range(count):
                        (n,) = struct.unpack_from("<Q", buf, at)
                        at += 8 + n
                elif etype in _SCALARS:
                    at += count * struct.calcsize(_SCALARS[etype])
                else:
                    for _ in range(count):
                        _, at = value(etype, at)
                return count, at
            fmt = "<" + _SCALARS[vtype]
            return struct.unpack_from(fmt, buf, at)[0], at + struct.calcsize(fmt)

        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key, pos = string(pos)
            (vtype,) = struct.unpack_from("<I", buf, pos)
            metadata[key], pos = value(vtype, pos + 4)
        tensors = []
        for _ in range(n_tensors):
            name, pos = string(pos)
            (n_dims,) = struct.unpack_from("<I", buf, pos)
            dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
            ggml_type, _offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            tensors.append((name, ggml_type, math.prod(dims)))
    return GgufHeader(metadata, tuple(tensors))
