"""Rejected drafts, recorded on this machine only (``speculative.record_rejections``, off by
default): each a draft the target cut short, with the code before it and the target's own
tokens, the material to fine-tune a draft model on. The file lives under the data directory,
is never sent anywhere, and is capped: past half the cap it becomes ``<name>.1`` (replacing the
older one), so the two hold at most the cap. ``localspec spec export`` writes them as JSONL.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO

from localspec import paths
from localspec.engine.types import Rejection

FILE_NAME = "rejections.jsonl"
DEFAULT_MAX_BYTES = 64 * 1024 * 1024


def default_path() -> Path:
    return paths.user_data_dir() / FILE_NAME


def record(rejection: Rejection, language: str, t: float | None = None) -> dict[str, Any]:
    """One line of the file: the texts and the token ids (ids are the pair's vocabulary)."""
    accepted = 0
    for d, g in zip(rejection.draft, rejection.target, strict=False):
        if d != g:
            break
        accepted += 1
    return {
        "t": round(time.time() if t is None else t, 3),
        "language": language,
        "source": rejection.source,
        "context_tail": rejection.context_text,
        "draft": rejection.draft_text,
        "target": rejection.target_text,
        "accepted": accepted,
        "context_tokens": rejection.context,
        "draft_tokens": rejection.draft,
        "target_tokens": rejection.target,
    }


class RejectionFile:
    """Appends records to ``path``; thread-safe, size-capped."""

    def __init__(self, path: Path, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self._lock = threading.Lock()

    @property
    def older(self) -> Path:
        return self.path.with_name(self.path.name + ".1")

    def append(self, records: Sequence[dict[str, Any]]) -> None:
        if not records:
            return
        data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode()
        with self._lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            try:
                size = self.path.stat().st_size
            except FileNotFoundError:
                size = 0
            if size and size + len(data) > self.max_bytes // 2:
                os.replace(self.path, self.older)
            if len(data) > self.max_bytes // 2:
                return  # one batch larger than the cap allows: not kept
            # owner-only: the lines hold the user's code
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            with os.fdopen(fd, "ab") as f:
                f.write(data)


def read(path: Path) -> Iterator[dict[str, Any]]:
    """The records, oldest first (the rotated file, then the current one); a line cut short
    by a crash is skipped."""
    for p in (path.with_name(path.name + ".1"), path):
        try:
            f = p.open(encoding="utf-8")
        except FileNotFoundError:
            continue
        with f:
            for line in f:
                try:
                    yield json.loads(line)
                except json.JSONDecodeError:
                    continue


def export(path: Path, out: TextIO, *, language: str | None = None) -> int:
    """Write the records as JSONL for fine-tuning (context tail, draft and target tokens and
    texts, language); ``language``: only that one. Returns how many were written."""
    n = 0
    for r in read(path):
        if language is not None and r.get("language") != language:
            continue
        out.write(json.dumps(r, ensure_ascii=False) + "\n")
        n += 1
    return n
