"""Resumable, verified downloads through huggingface_hub, offline first.

Where files land: ``<models_dir>/<owner>/<repo>/<revision or "main">/<filename>``
(``localspec.paths.models_dir()``, overridable). Not the HF cache: its symlinked blobs make
copying a models directory to an air-gapped machine awkward, and huggingface_hub 2.x
deletes a local-dir file before re-downloading it, which would lose the last good copy.

- Downloads go to ``<file>.partial`` next to the destination (one filesystem, atomic
  rename), resumed with an HTTP Range request on the next run when the hub's ETag is
  unchanged; a bad download is discarded and the previous good file stays in place.
- HTTP is huggingface_hub's own (``get_hf_file_metadata``, ``http_get``): it honours
  ``HF_ENDPOINT``, ``HF_TOKEN``, ``HTTPS_PROXY``/``NO_PROXY``, ``SSL_CERT_FILE`` and
  draws per-file progress bars with size, speed and ETA.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from types import TracebackType
from typing import IO, TYPE_CHECKING, Any

from localspec.catalog import QuantEntry
from localspec.fetch.errors import FetchError, OfflineError, VerifyError
from localspec.fetch.files import (
    _DISK_FULL,
    _HASH_BLOCK,
    _PARTIAL_SUFFIX,
    DEFAULT_REVISION,
    FileSpec,
    LocalFile,
    _as_specs,
    _models_dir,
    _read_record,
    _verify_existing,
    _write_record,
    find_local,
    layout_path,
    recorded_sha256,
    sha256_file,
)
from localspec.retry_after import retry_after
from localspec.settings import redact_url
from localspec.units import human_bytes

if TYPE_CHECKING:  # huggingface_hub is imported where it is used: the CLI starts without it
    from huggingface_hub import HfFileMetadata
    from huggingface_hub.utils import tqdm

Say = Callable[[str], None]  # a progress line for the user (or nothing, without progress)
DOWNLOAD_CHUNK = 1 << 20  # bytes written (and kept for a resume) at a time
GGUF_MAGIC = b"GGUF"
# a mirror or proxy answering these is often back within seconds: the file's request is made
# again after each delay (or the hub's Retry-After, up to MAX_RETRY_AFTER_S), resuming what
# came; one that stays down longer is reported
RETRY_STATUS = frozenset({429, 500, 502, 503, 504})
RETRY_DELAYS_S = (2.0, 5.0, 15.0)
MAX_RETRY_AFTER_S = 60.0
_RESUME_HINT = "run the same command again to resume it"


def offline_requested(offline: bool = False) -> bool:
    """``offline=True``, or HF_HUB_OFFLINE (read now, not at import as huggingface_hub does)."""
    value = os.environ.get("HF_HUB_OFFLINE", "").strip().upper()
    return offline or value in ("1", "ON", "YES", "TRUE")


def pull(
    files: Sequence[QuantEntry | FileSpec],
    *,
    models_dir: Path | None = None,
    readonly_dirs: Sequence[Path] = (),
    offline: bool = False,
    endpoint: str | None = None,
    token: str | None = None,
    force: bool = False,
    progress: bool = True,
    out: IO[str] | None = None,
) -> list[Path]:
    """Make every file present and verified; return their paths in order.

    Files already verified on disk cost no network request at all. ``offline`` (or
    HF_HUB_OFFLINE=1) forbids the network: a missing file raises OfflineError naming it.
    ``force`` downloads again even when a good copy exists (replacing it only once the new
    one verifies). Raises FetchError, OfflineError or VerifyError.
    """
    stream = out if out is not None else sys.stderr
    say = (lambda msg: print(msg, file=stream, flush=True)) if progress else (lambda msg: None)
    models_dir = _models_dir(models_dir)
    offline = offline_requested(offline)
    specs = _as_specs(files)
    results: dict[int, Path] = {}
    todo: list[tuple[int, FileSpec, LocalFile | None]] = []
    damaged: list[Path] = []
    for index, spec in enumerate(specs):
        if spec.repo is None:
            results[index] = _local_file(spec, models_dir, progress)
            continue
        found = find_local(spec, models_dir=models_dir, readonly_dirs=readonly_dirs)
        if found is not None and not force:
            if found.verified:
                results[index] = found.path
                continue
            if spec.sha256 is not None:
                if _verify_existing(found.path, spec, models_dir, progress):
                    results[index] = found.path
                    continue
                damaged.append(found.path)
                found = None  # damaged copy: download again, the bad file is replaced
            elif offline:
                if _usable_offline(found.path, spec, models_dir, progress, say):
                    results[index] = found.path
                    continue
                damaged.append(found.path)
                found = None
        todo.append((index, spec, found))
    if todo and offline:
        missing = [spec for _, spec, _ in todo]
        raise OfflineError(_offline_message(missing, damaged, models_dir, readonly_dirs))
    if todo:
        client = _Hub(endpoint=endpoint, token=token)
        total = sum(spec.size or 0 for _, spec, _ in todo)
        have = len(specs) - len(todo)
        size_note = f", {human_bytes(total)}" if total else ""
        say(f"localspec: {have} of {len(specs)} files present; fetching {len(todo)}{size_note}")
        started = time.monotonic()
        fetched = 0
        for n, (index, spec, found) in enumerate(todo, 1):
            try:
                path, nbytes = _fetch_retrying(
                    spec,
                    found,
                    client,
                    models_dir,
                    progress=progress,
                    say=say,
                    force=force,
                    prefix=f"[{n}/{len(todo)}] ",
                )
            except OSError as exc:  # the network's are FetchErrors by now: this is the disk's
                raise FetchError(
                    f"{spec.label}: {exc.strerror or exc} ({exc.filename or models_dir}); free "
                    "space there, make it writable, or set LOCALSPEC_MODELS_DIR to another "
                    "directory. Any previous copy is untouched"
                ) from exc
            results[index] = path
            fetched += nbytes
        elapsed = max(time.monotonic() - started, 1e-6)
        say(
            f"localspec: fetched {human_bytes(fetched)} in {elapsed:.1f} s "
            f"({human_bytes(fetched / elapsed)}/s); all {len(specs)} files verified"
        )
    return [results[i] for i in range(len(specs))]


def _usable_offline(path: Path, spec: FileSpec, models_dir: Path, progress: bool, say: Say) -> bool:
    """An unverified copy with nothing pinned, and no hub to ask: a file changed since its
    check (its record's size or mtime differ) must still hash to what was checked."""
    known = recorded_sha256(path, models_dir)
    if known is not None:
        return _verify_existing(path, replace(spec, sha256=known), models_dir, progress)
    say(f"warning: {path} has no recorded check and no pinned sha256; using it")
    return True


def _local_file(spec: FileSpec, models_dir: Path, progress: bool) -> Path:
    path = Path(spec.path or spec.filename).expanduser()
    if not path.is_file():
        raise FetchError(f"local model file {path} does not exist (named by the catalog)")
    if spec.sha256 is not None:
        record = _read_record(path, models_dir)
        if record is None or record.get("sha256") != spec.sha256:
            actual = sha256_file(path, progress=progress)
            if actual != spec.sha256:
                raise VerifyError(
                    f"{path}: sha256 is {actual}, the catalog expects {spec.sha256}; "
                    "the file was changed or the catalog entry is wrong"
                )
            _write_record(path, models_dir, actual, filename=spec.filename)
    return path


def _offline_message(
    missing: list[FileSpec], damaged: list[Path], models_dir: Path, readonly_dirs: Sequence[Path]
) -> str:
    where = ", ".join(str(d) for d in [*readonly_dirs, models_dir])
    lines = [
        f"  {spec.filename} (repo {spec.repo}, revision {spec.revision or DEFAULT_REVISION})"
        for spec in missing
    ]
    bad = "".join(f"\n  {p} is there but fails its sha256 check" for p in damaged)
    return (
        f"{len(missing)} model file(s) needed and not on this machine (looked in {where}):\n"
        + "\n".join(lines)
        + bad
        + "\nThe network is off (--offline, HF_HUB_OFFLINE=1 or hub.offline). To get them: "
        "run `localspec pull` on a connected machine and copy its models directory to "
        f"{models_dir}; or give an IT-provisioned directory in models.dirs; or allow the "
        "network with a reachable mirror in hub.endpoint / HF_ENDPOINT."
    )


class _Hub:
    """huggingface_hub calls for one pull: HEAD metadata and LFS sha256 per repo."""

    def __init__(self, *, endpoint: str | None, token: str | None) -> None:
        from huggingface_hub import constants

        self.endpoint = (endpoint or os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip(
            "/"
        )
        self.token = token
        self._lfs: dict[tuple[str, str], dict[str, tuple[int, str | None]]] = {}

    def metadata(self, spec: FileSpec) -> HfFileMetadata:
        from huggingface_hub import get_hf_file_metadata, hf_hub_url

        url = hf_hub_url(
            spec.repo or "",
            spec.filename,
            revision=spec.revision or DEFAULT_REVISION,
            endpoint=self.endpoint,
        )
        with _hub_errors(spec, self.endpoint):
            meta = get_hf_file_metadata(
                url, token=self.token, endpoint=self.endpoint, retry_on_errors=False
            )
        if meta.commit_hash is None or meta.etag is None:
            raise FetchError(
                f"{redact_url(self.endpoint)} answered for {spec.label} without "
                "X-Repo-Commit/ETag headers: it does not look like a Hugging Face hub "
                "(check HF_ENDPOINT, the proxy, the CA)"
            )
        return meta

    def lfs_info(self, spec: FileSpec, commit: str) -> tuple[int, str | None]:
        """(size, sha256) the hub records for ``spec`` at ``commit`` (paths-info API)."""
        from huggingface_hub import HfApi
        from huggingface_hub.hf_api import RepoFile

        known = self._lfs.setdefault((spec.repo or "", commit), {})
        if spec.filename not in known:
            api = HfApi(endpoint=self.endpoint, token=self.token)
            with _hub_errors(spec, self.endpoint):
                infos = api.get_paths_info(spec.repo or "", [spec.filename], revision=commit)
            for i in infos:
                if isinstance(i, RepoFile):
                    known[i.path] = (i.size, i.lfs.sha256 if i.lfs else None)
        info = known.get(spec.filename)
        if info is None:
            raise FetchError(f"the hub lists no file {spec.filename} in {spec.repo} at {commit}")
        return info


class _hub_errors:
    """Turn huggingface_hub/httpx exceptions into FetchErrors that say what to do."""

    def __init__(self, spec: FileSpec, endpoint: str) -> None:
        self.spec, self.endpoint = spec, redact_url(endpoint)  # a mirror's credentials stay out

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        if exc is None or isinstance(exc, FetchError | KeyboardInterrupt):
            return False
        if isinstance(exc, OSError) and exc.errno in _DISK_FULL:
            return False  # the caller discards the partial file
        from huggingface_hub import errors

        spec = self.spec
        rev = spec.revision or DEFAULT_REVISION
        if isinstance(exc, errors.GatedRepoError):
            msg = f"{spec.repo} is gated: accept its terms on the hub and set HF_TOKEN"
        elif isinstance(exc, errors.RepositoryNotFoundError):
            msg = (
                f"repo {spec.repo} not found on {self.endpoint} (or private: set HF_TOKEN "
                "or hub.token_file)"
            )
        elif isinstance(exc, errors.RevisionNotFoundError):
            msg = f"revision {rev} of {spec.repo} not found on {self.endpoint}"
        elif isinstance(exc, errors.RemoteEntryNotFoundError):
            msg = f"{spec.filename} not found in {spec.repo} at {rev} on {self.endpoint}"
        elif isinstance(exc, errors.HfHubHTTPError) and _status(exc) == 429:
            after = retry_after(exc.response.headers.get("retry-after"))
            wait = f"; it asks to wait {after:.0f} s" if after is not None else ""
            msg = (
                f"the hub at {self.endpoint} is rate-limiting downloads of {spec.label} (HTTP "
                f"429{wait}). Run the same command again later (the download resumes), or set "
                "HF_TOKEN: a logged-in user's limit is higher"
            )
        elif isinstance(exc, errors.HfHubHTTPError):
            msg = f"the hub at {self.endpoint} refused {spec.label}: {exc}"
        elif "httpx" in type(exc).__module__ or isinstance(exc, ConnectionError):
            msg = (
                f"cannot reach {self.endpoint} for {spec.label} ({type(exc).__name__}: {exc}). "
                "Check the network, HTTPS_PROXY/NO_PROXY, SSL_CERT_FILE or hub.ca_bundle, "
                "set HF_ENDPOINT/hub.endpoint for a mirror, or work offline with the files "
                "present (`up --offline`, hub.offline)"
            )
        elif isinstance(exc, OSError):
            msg = f"download of {spec.label} from {self.endpoint} incomplete: {exc}"
        else:
            return False
        raise FetchError(msg) from exc


def _status(exc: BaseException) -> int | None:
    return getattr(getattr(exc, "response", None), "status_code", None)


def _fetch_retrying(
    spec: FileSpec,
    previous: LocalFile | None,
    hub: _Hub,
    models_dir: Path,
    *,
    say: Say,
    **kwargs: Any,
) -> tuple[Path, int]:
    """``_fetch_one``, made again after a hub's passing 5xx or 429 (a partial download
    resumes); other failures, and the last try's, are raised as they are."""
    for attempt in range(len(RETRY_DELAYS_S) + 1):
        try:
            return _fetch_one(spec, previous, hub, models_dir, say=say, **kwargs)
        except VerifyError:
            raise
        except FetchError as exc:
            wait = _retry_wait(exc, attempt)
            if wait is None:  # a later try's error: say that the earlier ones' bytes are kept
                hinted = _with_resume_hint(exc, layout_path(spec, models_dir)) if attempt else exc
                raise hinted from exc.__cause__
            say(
                f"  {redact_url(hub.endpoint)} answered HTTP {_status(exc.__cause__)} for "
                f"{spec.label}; trying again in {wait:.0f} s "
                f"({attempt + 1} of {len(RETRY_DELAYS_S)})"
            )
            time.sleep(wait)
    raise AssertionError("unreachable: the last attempt raises or returns")


def _with_resume_hint(exc: FetchError, final: Path) -> FetchError:
    """``exc``, saying so when a partial download of ``final`` is kept for the next run."""
    partial = final.with_name(final.name + _PARTIAL_SUFFIX)
    have = partial.stat().st_size if partial.exists() else 0
    if not have or _RESUME_HINT in str(exc):
        return exc
    return FetchError(f"{exc}\nThe download stopped at {human_bytes(have)}; {_RESUME_HINT}.")


def _retry_wait(exc: FetchError, attempt: int) -> float | None:
    """Seconds to wait before trying ``exc``'s file again; None when another try cannot
    help (not a passing status, no tries left, or a Retry-After too long to sit through)."""
    response = getattr(exc.__cause__, "response", None)
    status = getattr(response, "status_code", None)
    if status not in RETRY_STATUS or attempt >= len(RETRY_DELAYS_S):
        return None
    after = retry_after(response.headers.get("retry-after"))
    if after is None:
        return RETRY_DELAYS_S[attempt]
    return after if after <= MAX_RETRY_AFTER_S else None


def _fetch_one(
    spec: FileSpec,
    previous: LocalFile | None,
    hub: _Hub,
    models_dir: Path,
    *,
    progress: bool,
    say: Say,
    force: bool = False,
    prefix: str = "",
) -> tuple[Path, int]:
    """Download one file to ``.partial``, verify, then move it into place. Returns bytes got."""
    meta = hub.metadata(spec)
    hub_size, hub_sha = hub.lfs_info(spec, meta.commit_hash)
    if hub_sha is None and meta.etag and len(meta.etag) == 64:
        hub_sha = meta.etag  # X-Linked-Etag of an LFS file is its sha256
    expected_sha = spec.sha256 or hub_sha
    expected_size = spec.size or hub_size or meta.size
    size = human_bytes(expected_size) if expected_size else "size unknown"
    say(f"{prefix}{spec.label} ({size})")
    if spec.sha256 and hub_sha and spec.sha256 != hub_sha:
        raise VerifyError(
            f"{spec.label}: the hub's file (commit {meta.commit_hash[:12]}) has sha256 {hub_sha}, "
            f"the catalog pins {spec.sha256}. Pin the catalog's revision or run "
            "`localspec catalog refresh`; nothing was downloaded and no file was removed"
        )
    if spec.size and hub_size and spec.size != hub_size:
        raise VerifyError(
            f"{spec.label}: the hub's file is {hub_size} bytes, the catalog says {spec.size}; "
            "nothing was downloaded and no file was removed"
        )
    if (
        previous is not None
        and previous.sha256 is None
        and expected_sha is not None
        and previous.path.stat().st_size == expected_size
        # an unrecorded copy (an IT directory, an interrupted run): check it, keep it
        and sha256_file(previous.path, progress=progress) == expected_sha
    ):
        _write_record(
            previous.path,
            models_dir,
            expected_sha,
            repo=spec.repo,
            filename=spec.filename,
            commit=meta.commit_hash,
        )
        return previous.path, 0
    final = layout_path(spec, models_dir)
    final.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(final, models_dir, say):
        record = _read_record(final, models_dir)
        if record and expected_sha and record.get("sha256") == expected_sha and not force:
            return final, 0  # another localspec process fetched it while we waited
        return _download_verified(
            spec,
            meta,
            final,
            expected_size,
            expected_sha,
            previous,
            hub,
            models_dir,
            progress=progress,
            say=say,
        )


@contextmanager
def _exclusive(final: Path, models_dir: Path, say: Say) -> Iterator[None]:
    """One download per file at a time across processes (`up` and `pull` may overlap)."""
    from filelock import Timeout
    from huggingface_hub.utils import WeakFileLock

    key = hashlib.sha256(str(final.resolve()).encode()).hexdigest()[:32]
    lock_path = models_dir / ".locks" / f"{key}.lock"
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    lock = WeakFileLock(lock_path, timeout=0.2)
    try:
        lock.__enter__()
    except Timeout:
        say(f"  waiting for another localspec download of {final.name}")
        lock = WeakFileLock(lock_path)
        lock.__enter__()
    try:
        yield
    finally:
        lock.__exit__(None, None, None)


def _download_verified(
    spec: FileSpec,
    meta: HfFileMetadata,
    final: Path,
    expected_size: int | None,
    expected_sha: str | None,
    previous: LocalFile | None,
    hub: _Hub,
    models_dir: Path,
    *,
    progress: bool,
    say: Say,
) -> tuple[Path, int]:
    partial = final.with_name(final.name + _PARTIAL_SUFFIX)
    partial_meta = final.with_name(final.name + _PARTIAL_SUFFIX + ".json")
    resume = _resumable(partial, partial_meta, meta.etag, expected_size)
    if resume:
        say(f"  resuming at {human_bytes(resume)} of {human_bytes(expected_size or 0)}")
    if expected_size:
        free = shutil.disk_usage(final.parent).free
        if free < expected_size - resume:
            raise FetchError(
                f"not enough disk space for {spec.label}: "
                f"needs {human_bytes(expected_size - resume)}, "
                f"{human_bytes(free)} free in {final.parent}"
            )
    partial_meta.write_text(json.dumps({"etag": meta.etag, "commit": meta.commit_hash}))
    got, actual_sha = _download(spec, meta, partial, resume, expected_size, hub, progress)
    actual_size = partial.stat().st_size
    if (expected_size and actual_size != expected_size) or (
        expected_sha and actual_sha != expected_sha
    ):
        partial.unlink(missing_ok=True)
        partial_meta.unlink(missing_ok=True)
        kept = f"; the previous copy {previous.path} is kept" if previous else ""
        raise VerifyError(
            f"{spec.label}: downloaded file failed verification: expected {expected_size} "
            f"bytes sha256 {expected_sha}, got {actual_size} bytes sha256 {actual_sha}. "
            f"The bad download was discarded{kept}; try again or check the mirror"
        )
    if expected_sha is None:
        say(f"  warning: the hub gives no sha256 for {spec.label}; recorded {actual_sha[:16]}")
    os.replace(partial, final)
    partial_meta.unlink(missing_ok=True)
    _write_record(
        final,
        models_dir,
        actual_sha,
        repo=spec.repo,
        filename=spec.filename,
        revision=spec.revision or DEFAULT_REVISION,
        commit=meta.commit_hash,
    )
    return final, got


def _resumable(partial: Path, partial_meta: Path, etag: str, expected_size: int | None) -> int:
    """Bytes already on disk for this very version of the file; else start over."""
    try:
        size = partial.stat().st_size
        same = json.loads(partial_meta.read_text()).get("etag") == etag
    except (OSError, ValueError):
        size, same = 0, False
    too_big = expected_size is not None and size > expected_size
    if not same or too_big or _foreign_start(partial) is not None:
        partial.unlink(missing_ok=True)
        return 0
    return size


def _foreign_start(partial: Path) -> bytes | None:
    """The first bytes of a ``.gguf`` download that does not begin as every GGUF file (and
    shard) does: a proxy's or portal's page saved in its place, never worth resuming."""
    if not partial.name.endswith(".gguf" + _PARTIAL_SUFFIX):
        return None
    try:
        with partial.open("rb") as f:
            head = f.read(64)
    except OSError:
        return None
    if len(head) < len(GGUF_MAGIC) or head.startswith(GGUF_MAGIC):
        return None
    return head


def _download(
    spec: FileSpec,
    meta: HfFileMetadata,
    partial: Path,
    resume: int,
    expected_size: int | None,
    hub: _Hub,
    progress: bool,
) -> tuple[int, str]:
    """Stream the rest of the file into ``partial``; return (bytes got, sha256 of it all).

    The sha256 is computed as the bytes are written, so an 8 GB file is not read back."""
    from huggingface_hub import constants
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import build_hf_headers

    headers = build_hf_headers(token=hub.token)
    url = meta.location
    if not _same_host(url, hub.endpoint):
        headers.pop("authorization", None)  # a CDN's signed URL must not see the token
    tqdm_class = None if progress else _silent_tqdm()
    # http_get keeps (and shows) whole chunks only: at its 10 MiB a link cut every few MiB
    # would never get on, and a slow one would show no progress for minutes
    constants.DOWNLOAD_CHUNK_SIZE = DOWNLOAD_CHUNK
    try:
        with partial.open("r+b" if resume else "w+b") as f:
            sink = _HashingFile(f, resume)
            with _hub_errors(spec, hub.endpoint):
                http_get(
                    url,
                    sink,  # type: ignore[arg-type]
                    resume_size=resume,
                    headers=headers,
                    expected_size=expected_size,
                    displayed_filename=spec.filename,
                    tqdm_class=tqdm_class,
                )
    except FetchError as exc:
        head = _foreign_start(partial)
        if head is not None:
            partial.unlink(missing_ok=True)
            raise FetchError(
                f"{exc}\nWhat came back is not a GGUF file (it begins {head[:40]!r}: a proxy's "
                "or a login page?); it was discarded. Check the mirror, HTTPS_PROXY and the "
                "token, then run the same command again."
            ) from exc.__cause__
        have = partial.stat().st_size if partial.exists() else 0
        raise FetchError(
            f"{exc}\nThe download stopped at {human_bytes(have)}; {_RESUME_HINT}."
        ) from exc.__cause__
    except OSError as exc:
        if exc.errno in _DISK_FULL:
            partial.unlink(missing_ok=True)
            raise FetchError(
                f"disk full while downloading {spec.label} into {partial.parent} ({exc}); "
                "the partial file was removed and any previous copy is untouched"
            ) from exc
        raise
    return partial.stat().st_size - resume, sink.hexdigest()


class _HashingFile:
    """A file that hashes what is written to it; ``http_get`` needs write/seek/tell/truncate.

    Invariant: the digest covers exactly the bytes before the file position. A seek
    elsewhere (``http_get`` rewinds when a server ignores Range) re-hashes up to there.
    """

    def __init__(self, f: IO[bytes], start: int) -> None:
        self._f = f
        self.seek(start)

    def _rehash(self, upto: int) -> None:
        self._digest = hashlib.sha256()
        self._f.seek(0)
        left = upto
        while left > 0 and (block := self._f.read(min(_HASH_BLOCK, left))):
            self._digest.update(block)
            left -= len(block)
        self._pos = upto - left
        self._f.seek(self._pos)

    def write(self, data: bytes) -> int:
        written = self._f.write(data)
        self._digest.update(memoryview(data)[:written])
        self._pos += written
        return written

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        target = self._f.seek(offset, whence)
        if getattr(self, "_pos", None) != target:
            self._rehash(target)
        return target

    def tell(self) -> int:
        return self._f.tell()

    def truncate(self, size: int | None = None) -> int:
        return self._f.truncate(size)

    def flush(self) -> None:
        self._f.flush()

    def hexdigest(self) -> str:
        return self._digest.hexdigest()


def _same_host(url: str, endpoint: str) -> bool:
    from urllib.parse import urlsplit

    return urlsplit(url).netloc == urlsplit(endpoint).netloc


def _silent_tqdm() -> type[tqdm]:
    from huggingface_hub.utils import tqdm

    class Silent(tqdm):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

    return Silent
