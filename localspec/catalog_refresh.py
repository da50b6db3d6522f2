"""``localspec catalog refresh``: pin revisions, sizes and sha256 from the hub's own metadata.

A maintainer runs it on a connected machine; it asks ``HfApi.model_info(files_metadata=True)``
for every repo a catalog file names and rewrites the TOML with tomli_w (the leading comment
block is kept; other comments are not, so put explanations in ``note`` fields). Unpinned
quants get pinned to the repo's current commit; pinned ones keep their revision unless
``update_revisions`` moves them to the current main.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import tomli_w

from localspec.catalog import Catalog, CatalogError, load_catalog_file

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib


@dataclass(frozen=True)
class Change:
    file: str
    entry: str  # models.<id>.quants.<quant>
    key: str  # revision | size_bytes | files.<filename>.size | files.<filename>.sha256
    old: Any
    new: Any
    kind: str = "updated"  # updated | missing (the repo lacks the file: fix by hand)

    def __str__(self) -> str:
        if self.kind == "missing":
            return f"{self.file}: {self.entry}: {self.key}: not in the repo ({self.new})"
        return f"{self.file}: {self.entry}: {self.key}: {self.old!r} -> {self.new!r}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _files_of(target: Path | Catalog | Sequence[Path]) -> list[Path]:
    if isinstance(target, Catalog):
        sources = {m.source for m in target.models.values() if m.source}
        return sorted(Path(s) for s in sources)
    paths = [target] if isinstance(target, Path | str) else list(target)
    out: list[Path] = []
    for p in map(Path, paths):
        out.extend(sorted(p.glob("*.toml")) if p.is_dir() else [p])
    return out


def refresh_catalog(
    target: Path | Catalog | Sequence[Path],
    *,
    endpoint: str | None = None,
    token: str | None = None,
    update_revisions: bool = False,
    dry_run: bool = False,
) -> list[Change]:
    """Refresh catalog files (a file, a directory, or the files a Catalog came from).

    Returns every change (and every file the hub does not have); writes the files unless
    ``dry_run``. Raises CatalogError when a rewritten file would not validate.
    """
    from huggingface_hub import HfApi

    api = HfApi(endpoint=endpoint, token=token)
    infos: dict[tuple[str, str | None], Any] = {}
    changes: list[Change] = []
    for path in _files_of(target):
        text = path.read_text(encoding="utf-8")
        raw = tomllib.loads(text)
        file_changes: list[Change] = []
        for model_id, model in raw.get("models", {}).items():
            for quant_name, quant in model.get("quants", {}).items():
                if "repo" not in quant:
                    continue  # local files: nothing to ask the hub
                where = f"models.{model_id}.quants.{quant_name}"
                revision = None if update_revisions else quant.get("revision")
                key = (quant["repo"], revision)
                if key not in infos:
                    infos[key] = api.model_info(
                        quant["repo"], revision=revision, files_metadata=True
                    )
                file_changes += _refresh_quant(str(path), where, quant, infos[key])
        changes += file_changes
        if dry_run or not any(c.kind == "updated" for c in file_changes):
            continue
        header = "".join(line for line in text.splitlines(keepends=True) if line.startswith("#"))
        header = header if text.startswith("#") else ""
        _write_validated(path, header + tomli_w.dumps(raw))
    return changes


def _refresh_quant(file: str, where: str, quant: dict[str, Any], info: Any) -> list[Change]:
    changes: list[Change] = []

    def update(container: dict[str, Any], key: str, label: str, new: Any) -> None:
        old = container.get(key)
        if old != new:
            changes.append(Change(file, where, label, old, new))
            container[key] = new

    siblings = {s.rfilename: s for s in info.siblings or []}
    sizes: list[int] = []
    for f in quant.get("files", []):
        sibling = siblings.get(f["filename"])
        if sibling is None:
            changes.append(
                Change(
                    file,
                    where,
                    f"files.{f['filename']}",
                    None,
                    f"{quant['repo']}@{info.sha}",
                    kind="missing",
                )
            )
            continue
        size = sibling.lfs.size if sibling.lfs else sibling.size
        if size is not None:
            update(f, "size", f"files.{f['filename']}.size", size)
            sizes.append(size)
        if sibling.lfs is not None:
            update(f, "sha256", f"files.{f['filename']}.sha256", sibling.lfs.sha256)
    update(quant, "revision", "revision", info.sha)
    if sizes and len(sizes) == len(quant.get("files", [])):
        update(quant, "size_bytes", "size_bytes", sum(sizes))
    return changes


def _write_validated(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".refresh.tmp")
    tmp.write_text(text, encoding="utf-8")
    try:
        load_catalog_file(tmp)
    except CatalogError:
        tmp.unlink()
        raise
    tmp.replace(path)
