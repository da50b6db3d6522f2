"""What is on disk for every catalog quant, for ``localspec models`` (records only: no hash,
no network)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from localspec.catalog import Catalog
from localspec.fetch.files import LocalFile, _models_dir, find_local, specs_for


@dataclass(frozen=True)
class QuantStatus:
    model_id: str
    quant: str
    repo: str | None
    n_files: int
    size_bytes: int | None
    size_exact: bool  # every file's size is pinned in the catalog
    present: bool  # every file is on disk
    verified: bool  # every file has a matching verification record
    path: Path | None  # the file llama.cpp loads, when present


def model_status(
    catalog: Catalog, *, models_dir: Path | None = None, readonly_dirs: Sequence[Path] = ()
) -> list[QuantStatus]:
    """Every catalog quant with its size and presence; reads records only (no hash, no net)."""
    models_dir = _models_dir(models_dir)
    rows = []
    for model in catalog.models.values():
        for quant_name in model.quant_ladder():
            quant = model.quants[quant_name]
            found = []
            for spec in specs_for(quant):
                if spec.repo is None:
                    local = Path(spec.path or spec.filename).expanduser()
                    found.append(LocalFile(local, False, None) if local.is_file() else None)
                else:
                    found.append(
                        find_local(spec, models_dir=models_dir, readonly_dirs=readonly_dirs)
                    )
            present = all(f is not None for f in found)
            rows.append(
                QuantStatus(
                    model_id=model.id,
                    quant=quant_name,
                    repo=quant.repo,
                    n_files=len(quant.files),
                    size_bytes=quant.total_size,
                    size_exact=all(f.size is not None for f in quant.files),
                    present=present,
                    verified=present and all(f is not None and f.verified for f in found),
                    path=found[0].path if present and found[0] is not None else None,
                )
            )
    return rows
