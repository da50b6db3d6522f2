"""A slot's context in a file: written whole or not at all, read back only into the same models.

Layout: ``MAGIC``, the header's length (8 bytes, little-endian), the header (JSON: the model
pair's identity, each sequence's bookkeeping, byte count and CRC-32), then the target's state
bytes and the draft's. Reading checks each of them before llama.cpp sees a byte, so a file
that is truncated, corrupt or another model's is refused (``StateFileError``) and the slot it
was meant for keeps what it held. Writing goes to a temporary file renamed into place, so a
full disk leaves the old file (or none), never half a state.

Also ``valid_filename``: llama-server's ``fs_validate_filename`` (no directories, no ``..``).
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
import zlib
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from localspec.engine.slotstate import SeqSnapshot, SlotSnapshot

MAGIC = b"LSPSLOT\x01"
MAX_HEADER = 64 << 20  # a header past this is not one of ours (tokens of a long context fit)
_FORBIDDEN = set(':*?"<>|/\\') | {"\ufffd", "\ufeff", "\uff0e", "\u2215", "\u2216"}


class StateFileError(ValueError):
    """The file cannot be restored: ``reason`` says why in a line fit for the log."""


class OtherModel(StateFileError):
    """The state was saved from other model files (or another KV cell type)."""


def valid_filename(name: str) -> bool:
    """llama-server's rule for a slot file's name: one path component, printable, no ``..``."""
    if not name or len(name.encode("utf-8", "surrogatepass")) > 255:
        return False
    for ch in name:
        c = ord(ch)
        if c <= 0x1F or 0x7F <= c <= 0x9F or 0xD800 <= c <= 0xDFFF or ch in _FORBIDDEN:
            return False
    return not (name[0] == " " or name[-1] in " ." or ".." in name or name == ".")


def _crc(data: np.ndarray) -> int:
    return zlib.crc32(memoryview(data)) & 0xFFFFFFFF


def _part(snap: SeqSnapshot | None) -> dict[str, Any] | None:
    if snap is None:
        return None
    return {"meta": snap.meta, "n_bytes": int(snap.data.nbytes), "crc32": _crc(snap.data)}


def write(path: Path, snap: SlotSnapshot, identity: dict[str, Any]) -> int:
    """Write ``snap`` to ``path`` atomically; returns the bytes written. OSError (a full disk,
    no permission) leaves ``path`` as it was."""
    header = json.dumps(
        {"identity": identity, "target": _part(snap.target), "draft": _part(snap.draft)},
        separators=(",", ":"),
    ).encode()
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(MAGIC)
            f.write(struct.pack("<Q", len(header)))
            f.write(header)
            for part in (snap.target, snap.draft):
                if part is not None:
                    f.write(memoryview(part.data))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return len(MAGIC) + 8 + len(header) + snap.n_bytes


def _read_exact(f: BinaryIO, n: int, what: str) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise StateFileError(f"truncated: {what} has {len(data)} of {n} bytes")
    return data


def _seq(f: BinaryIO, part: Any, name: str) -> SeqSnapshot:
    if not isinstance(part, dict) or not isinstance(part.get("meta"), dict):
        raise StateFileError(f"corrupt: the header's {name} entry is malformed")
    n = part.get("n_bytes")
    if not isinstance(n, int) or n < 0:
        raise StateFileError(f"corrupt: the {name} state's size is {n!r}")
    data = np.frombuffer(_read_exact(f, n, f"the {name} state"), dtype=np.uint8)
    if _crc(data) != part.get("crc32"):
        raise StateFileError(f"corrupt: the {name} state's checksum does not match")
    tokens = part["meta"].get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
        raise StateFileError(f"corrupt: the {name} state's tokens are malformed")
    return SeqSnapshot(data.copy(), part["meta"])


def read(path: Path, identity: dict[str, Any]) -> tuple[SlotSnapshot, int]:
    """The state in ``path`` and its size in bytes; StateFileError (OtherModel) when it is not
    a whole state of these models, FileNotFoundError when there is none."""
    with open(path, "rb") as f:
        if f.read(len(MAGIC)) != MAGIC:
            raise StateFileError("not a localspec slot state (bad magic)")
        (n_header,) = struct.unpack("<Q", _read_exact(f, 8, "the header's length"))
        if n_header > MAX_HEADER:
            raise StateFileError(f"corrupt: a header of {n_header} bytes")
        try:
            header = json.loads(_read_exact(f, n_header, "the header"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise StateFileError(f"corrupt: the header is not JSON ({exc})") from None
        if not isinstance(header, dict):
            raise StateFileError("corrupt: the header is not an object")
        if header.get("identity") != identity:
            raise OtherModel(
                f"saved from other model files ({header.get('identity')!r}; these are {identity!r})"
            )
        target = _seq(f, header.get("target"), "target")
        draft = None if header.get("draft") is None else _seq(f, header["draft"], "draft")
        if f.read(1):
            raise StateFileError("corrupt: bytes after the last state")
        size = f.tell()
    return SlotSnapshot(target, draft), size
