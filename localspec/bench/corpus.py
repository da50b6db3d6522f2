"""The benchmarks' one corpus of real code: the Python standard library on this machine.

Prompts (``code_prompts``), a ring buffer of other files' chunks as the editor sends it in
``input_extra`` (``ring_chunks``), and whole modules (``source_lines``) all come from here, so
every benchmark reads the same code and none needs a download.
"""

from __future__ import annotations

import sysconfig
from collections.abc import Sequence
from pathlib import Path
from typing import Any

MODULES = (
    "json/encoder.py", "textwrap.py", "argparse.py", "csv.py", "dataclasses.py",
    "difflib.py", "fractions.py", "heapq.py", "inspect.py", "ipaddress.py",
    "logging/__init__.py", "pathlib.py", "pprint.py", "shutil.py", "statistics.py",
    "string.py", "tempfile.py", "threading.py", "typing.py", "urllib/parse.py",
    "zipfile.py", "tarfile.py", "configparser.py", "functools.py", "gettext.py",
    "calendar.py", "base64.py", "bisect.py", "contextlib.py", "enum.py",
    "queue.py", "selectors.py", "socket.py", "subprocess.py", "uuid.py", "weakref.py",
)  # fmt: skip


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [root / m for m in MODULES if (root / m).is_file()]
    if not files:
        files = sorted(root.glob("*.py"))
    return files


def code_prompts(n: int, *, lines: int = 40, skip: int = 60) -> list[str]:
    """``n`` snippets of ``lines`` lines: one per module, from line ``skip`` on, past the
    docstring and imports; wraps around to later snippets of the same files if needed."""
    files = stdlib_files()
    out: list[str] = []
    round_ = 0
    while len(out) < n and round_ < 50:
        for path in files:
            text = path.read_text(encoding="utf-8", errors="replace").splitlines()
            start = skip + round_ * (lines + 37)
            chunk = text[start : start + lines]
            if len(chunk) == lines and any(s.strip() for s in chunk):
                out.append("\n".join(chunk) + "\n")
                if len(out) == n:
                    break
        round_ += 1
    return out


def stdlib_path(name: str) -> Path:
    """A standard library module's file (``json/decoder.py``)."""
    return Path(sysconfig.get_paths()["stdlib"]) / name


def source_lines(name: str) -> list[str]:
    """A standard library module's lines, each with its newline."""
    return stdlib_path(name).read_text(encoding="utf-8", errors="replace").splitlines(True)


def ring_chunks(
    n: int = 16,
    lines: int = 32,
    *,
    names: Sequence[str] = ("json/decoder.py", "argparse.py", "textwrap.py", "shlex.py"),
    stride: int | None = None,
    filename: str | None = None,
) -> list[dict[str, Any]]:
    """``n`` chunks of ``lines`` lines of other files, as llama-vscode's ring buffer holds
    them (``input_extra`` entries); one every ``stride`` lines (default five chunks' worth).
    ``filename``: a pattern with ``{i}`` to name chunk i instead of its module."""
    chunks: list[dict[str, Any]] = []
    step = stride or lines * 5
    for name in names:
        text = source_lines(name)
        for start in range(0, len(text) - lines, step):
            i = len(chunks)
            chunks.append({
                "text": "".join(text[start : start + lines]),
                "filename": filename.format(i=i) if filename else name,
                "time": 1724000000 + (i if filename else 0),
            })  # fmt: skip
            if len(chunks) == n:
                return chunks
    return chunks
