"""Locate the data shipped with localspec (the model catalog, launcher templates).

An installed wheel carries them under ``localspec/_data``; an editable install or a source
checkout finds them at the repository root. One lookup serves both.
"""

from __future__ import annotations

from pathlib import Path

_PACKAGE_DIR = Path(__file__).resolve().parent


def data_dir(name: str) -> Path:
    """Return the shipped directory ``name`` (``models`` or ``launcher``)."""
    for candidate in (_PACKAGE_DIR / "_data" / name, _PACKAGE_DIR.parent / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(
        f"localspec's {name}/ directory is missing from the installation ({_PACKAGE_DIR}); "
        "reinstall localspec"
    )
