"""Model files on disk: where they live, their verification records, finding a good copy.

A file is used only after its size and sha256 match (the catalog's pinned sha256, else the
hub's LFS sha256). The verdict is recorded beside the file (``<file>.verified.json``, or in
``<models_dir>/.verified/`` for a read-only directory) with the file's size and mtime, so a
later start trusts it without re-hashing and without any network request. Nothing here
touches the network.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from localspec.catalog import QuantEntry
from localspec.fetch.errors import FetchError

if TYPE_CHECKING:
    from huggingface_hub.utils import tqdm

DEFAULT_REVISION = "main"
_RECORD_SUFFIX = ".verified.json"
_PARTIAL_SUFFIX = ".partial"
_HASH_BLOCK = 8 << 20
_DISK_FULL = {errno.ENOSPC, errno.EFBIG, getattr(errno, "EDQUOT", errno.ENOSPC)}


@dataclass(frozen=True)
class FileSpec:
    """One file to obtain: from a hub repo, or an existing local path."""

    filename: str
    repo: str | None = None
    revision: str | None = None
    size: int | None = None
    sha256: str | None = None
    path: str | None = None

    @classmethod
    def parse(cls, ref: str) -> FileSpec:
        """``owner/repo[@revision]/path/file.gguf`` (``hf://`` optional), for `localspec pull`."""
        text = ref.removeprefix("hf://").strip("/")
        parts = text.split("/")
        if len(parts) < 3 or not all(parts) or not parts[-1].endswith(".gguf"):
            raise ValueError(
                f"{ref!r} is not owner/repo[@revision]/file.gguf "
                "(e.g. ggml-org/Qwen2.5-Coder-0.5B-Q8_0-GGUF/qwen2.5-coder-0.5b-q8_0.gguf)"
            )
        name, _, revision = parts[1].partition("@")
        return cls(
            filename="/".join(parts[2:]), repo=f"{parts[0]}/{name}", revision=revision or None
        )

    @property
    def label(self) -> str:
        if self.repo is None:
            return self.path or self.filename
        return f"{self.repo}/{self.filename}"


def specs_for(quant: QuantEntry) -> list[FileSpec]:
    """The files of one catalog quant (every shard of a split GGUF)."""
    return [
        FileSpec(
            filename=f.filename,
            repo=quant.repo,
            revision=quant.revision,
            size=f.size,
            sha256=f.sha256,
            path=f.path,
        )
        for f in quant.files
    ]


def _as_specs(files: Iterable[QuantEntry | FileSpec]) -> list[FileSpec]:
    out: list[FileSpec] = []
    for item in files:
        out.extend(specs_for(item) if isinstance(item, QuantEntry) else [item])
    return out


def layout_path(spec: FileSpec, root: Path) -> Path:
    """Where ``spec`` lives under a models directory: owner/repo/revision/filename."""
    if spec.repo is None:
        raise ValueError(f"{spec.label} is a local file, not a hub file")
    relative = Path(spec.filename)
    if relative.is_absolute() or ".." in relative.parts:
        raise FetchError(f"unsafe file name {spec.filename!r} in repo {spec.repo}")
    return root.joinpath(*spec.repo.split("/"), spec.revision or DEFAULT_REVISION, relative)


# -- verification records -------------------------------------------------------------------


def _record_paths(path: Path, models_dir: Path) -> list[Path]:
    """Sidecar first; the user store serves files in directories we cannot write."""
    key = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:32]
    return [path.with_name(path.name + _RECORD_SUFFIX), models_dir / ".verified" / f"{key}.json"]


def _read_record(path: Path, models_dir: Path) -> dict[str, Any] | None:
    try:
        stat = path.stat()
    except OSError:
        return None
    for candidate in _record_paths(path, models_dir):
        try:
            record = json.loads(candidate.read_text())
        except (OSError, ValueError):
            continue
        if record.get("size") == stat.st_size and record.get("mtime_ns") == stat.st_mtime_ns:
            return record
    return None


def recorded_sha256(path: Path, models_dir: Path) -> str | None:
    """The sha256 a record holds for ``path`` even when the file's size or mtime have changed
    since (then the file must be hashed again before it counts)."""
    for candidate in _record_paths(path, models_dir):
        try:
            sha = json.loads(candidate.read_text()).get("sha256")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(sha, str):
            return sha
    return None


def _write_record(path: Path, models_dir: Path, sha256: str, **extra: str | None) -> None:
    stat = path.stat()
    record = {
        "sha256": sha256,
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "verified_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **extra,
    }
    for candidate in _record_paths(path, models_dir):
        try:
            candidate.parent.mkdir(parents=True, exist_ok=True)
            tmp = candidate.with_name(candidate.name + ".tmp")
            tmp.write_text(json.dumps(record, indent=1))
            os.replace(tmp, candidate)
            return
        except OSError:
            continue


def sha256_file(path: Path, *, progress: bool = False, label: str = "") -> str:
    """Stream a file through sha256 (with a bar for big files: 8 GB takes a while)."""
    digest = hashlib.sha256()
    bar = _bar(f"verify {label or path.name}", path.stat().st_size, progress)
    with path.open("rb") as f:
        while block := f.read(_HASH_BLOCK):
            digest.update(block)
            bar.update(len(block))
    bar.close()
    return digest.hexdigest()


def _bar(desc: str, total: int, enabled: bool) -> tqdm:
    from huggingface_hub.utils import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, disable=not enabled)


@dataclass(frozen=True)
class LocalFile:
    path: Path
    verified: bool  # a record (or a fresh hash) matches the expected sha256
    sha256: str | None


def _candidates(
    spec: FileSpec, models_dir: Path, readonly_dirs: Sequence[Path]
) -> list[tuple[Path, bool]]:
    """(path, needs_proof) in search order. A copy pulled before the catalog pinned a
    revision sits under ``main/``: it counts only if its record proves it is that file."""
    if spec.repo is None:
        return [(Path(spec.path or spec.filename).expanduser(), False)]
    unpinned = FileSpec(spec.filename, spec.repo) if spec.revision else None
    out: list[tuple[Path, bool]] = []
    for root in [*map(Path, readonly_dirs), Path(models_dir)]:
        out.append((layout_path(spec, root), False))
        if unpinned is not None:
            out.append((layout_path(unpinned, root), True))
        if root != Path(models_dir):
            out.append((root / Path(spec.filename).name, False))  # IT may drop files flat
    return out


def find_local(
    spec: FileSpec, *, models_dir: Path, readonly_dirs: Sequence[Path] = ()
) -> LocalFile | None:
    """The first copy on disk (read-only dirs first) with its recorded verdict; no hashing."""
    for candidate, needs_proof in _candidates(spec, models_dir, readonly_dirs):
        if not candidate.is_file():
            continue
        if spec.size is not None and candidate.stat().st_size != spec.size:
            continue  # another version of the file (or a different file of that name)
        record = _read_record(candidate, models_dir)
        sha = record.get("sha256") if record else None
        if needs_proof and not (
            record
            and (sha == spec.sha256 if spec.sha256 else record.get("commit") == spec.revision)
        ):
            continue
        verified = sha is not None and (spec.sha256 is None or sha == spec.sha256)
        return LocalFile(candidate, verified, sha)
    return None


def resolve_local(
    spec: FileSpec | QuantEntry,
    *,
    models_dir: Path | None = None,
    readonly_dirs: Sequence[Path] = (),
    progress: bool = False,
) -> Path | None:
    """A verified local copy of a file (the first file of a quant), or None. Never networks.

    An unrecorded copy with a pinned sha256 is hashed once and recorded; without a pinned
    sha256 it counts only once a pull has checked it against the hub.
    """
    specs = _as_specs([spec])
    models_dir = _models_dir(models_dir)
    paths = []
    for one in specs:
        found = find_local(one, models_dir=models_dir, readonly_dirs=readonly_dirs)
        if found is None:
            return None
        if not found.verified and (
            one.sha256 is None or not _verify_existing(found.path, one, models_dir, progress)
        ):
            return None
        paths.append(found.path)
    return paths[0]


def _verify_existing(path: Path, spec: FileSpec, models_dir: Path, progress: bool) -> bool:
    actual = sha256_file(path, progress=progress)
    if actual != spec.sha256:
        return False
    _write_record(path, models_dir, actual, repo=spec.repo, filename=spec.filename)
    return True


def _models_dir(models_dir: Path | None) -> Path:
    if models_dir is not None:
        return Path(models_dir)
    from localspec.paths import models_dir as default_models_dir

    return default_models_dir()
