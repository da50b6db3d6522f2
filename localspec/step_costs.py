"""Measured decode step times, kept per machine: ``localspec bench steps`` writes them, ``plan``
reads the ones measured on the machine it plans for (the capacity arithmetic then rests on
them instead of the bandwidth model)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from localspec import paths
from localspec.planning.types import StepCosts


def store_path() -> Path:
    return paths.state_dir() / "step-costs.json"


def _read(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def save(
    model_id: str, quant: str, costs: StepCosts, *, machine: str, path: Path | None = None
) -> Path:
    """Keep ``costs`` for (model, quant) on ``machine`` (a later measurement replaces it)."""
    path = path or store_path()
    doc = _read(path)
    doc[f"{machine}|{model_id}|{quant}"] = {
        "machine": machine,
        "model": model_id,
        "quant": quant,
        "kv_tokens": costs.kv_tokens,
        "source": costs.source,
        "ms_by_tokens": {str(k): v for k, v in sorted(costs.ms_by_tokens.items())},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1), encoding="utf-8")
    tmp.replace(path)
    return path


def load(machine: str, path: Path | None = None) -> dict[tuple[str, str], StepCosts]:
    """The step costs measured on ``machine`` (its hardware description), by (model, quant);
    an unreadable or foreign entry is skipped."""
    out: dict[tuple[str, str], StepCosts] = {}
    for entry in _read(path or store_path()).values():
        try:
            if entry["machine"] != machine:
                continue
            points = {int(k): float(v) for k, v in entry["ms_by_tokens"].items()}
            if not points:
                continue
            out[(entry["model"], entry["quant"])] = StepCosts(
                points, int(entry["kv_tokens"]), str(entry["source"])
            )
        except (KeyError, TypeError, ValueError):
            continue
    return out
