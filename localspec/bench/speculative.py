"""Speculative decoding benchmark (and the stdlib code prompts it and the tests use)."""

from __future__ import annotations

import sysconfig
from pathlib import Path

# well-known, stable modules: plain Python code of the kind an editor completes
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
