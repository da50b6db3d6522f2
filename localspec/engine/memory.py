"""The plan's memory arithmetic held against what llama.cpp allocated, per device.

``planned`` runs the planner's own model (planning/memory.py) on the GGUFs' tensor tables and
the settings the engine loaded with; ``allocated`` is llama.cpp's log of its buffers
(engine/alloc.py). Both are split by kind: weights ("model"), KV cache, and compute (the graph
allocator's peak plus the host logits buffer). ``localspec status`` shows them side by side.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from localspec.engine import devices as ggml_devices
from localspec.engine.alloc import HOST, KINDS, Allocations
from localspec.engine.types import EngineSettings, ModelSettings
from localspec.planning.facts import model_facts_from_gguf
from localspec.planning.memory import draft_offload, model_usage
from localspec.planning.types import Device, Layout, ModelFacts

if TYPE_CHECKING:
    from localspec.engine.engine import Engine

# the planner's rule holds within this share of llama.cpp's figure, per device (tests check it)
TOLERANCE = 0.10


def _ngl(m: ModelSettings, facts: ModelFacts, n_gpus: int) -> int:
    """Layers llama.cpp offloads: -1 (or more than there are) means all n_layer + 1."""
    if n_gpus == 0:
        return 0
    full = facts.n_layer + 1
    return full if m.n_gpu_layers < 0 else min(m.n_gpu_layers, full)


def _split(m: ModelSettings, gpus: Sequence[ggml_devices.GgmlDevice]) -> tuple[float, ...]:
    """The layer split: the settings', else llama.cpp's default (by free memory)."""
    if not gpus:
        return ()
    if m.tensor_split:
        return tuple(m.tensor_split[: len(gpus)])
    return tuple(float(d.free_bytes or 1) for d in gpus)


def layout_for(
    settings: EngineSettings,
    target: ModelFacts,
    draft: ModelFacts | None,
    gpus: Sequence[ggml_devices.GgmlDevice],
    flash_attn: bool,
) -> Layout:
    """The planner's Layout for what the engine loaded: the same context, slots, KV type,
    ubatch, offload and draft placement."""
    t = settings.target
    n_gpus = len(gpus)
    draft_device: int | None = None
    if draft is not None and settings.draft is not None:
        on_gpu = _ngl(settings.draft, draft, n_gpus) > 0
        draft_device = min(settings.draft.main_gpu, n_gpus - 1) if on_gpu else n_gpus
    return Layout(
        n_ctx=t.n_ctx,
        n_slots=settings.n_slots,
        type_kv=t.type_k,
        n_ubatch=min(t.n_ubatch, t.n_batch),
        target_ngl=_ngl(t, target, n_gpus),
        split=_split(t, gpus),
        draft_device=draft_device,
        spec_n_max=settings.spec.n_max,
        flash_attn=flash_attn,
    )


def planned_by_device(
    target: ModelFacts, draft: ModelFacts | None, layout: Layout, names: Sequence[str]
) -> dict[str, dict[str, int]]:
    """Bytes per device name and kind under ``layout`` (``names``: the GPUs, then the host)."""
    n = len(names)
    devices = [Device(name, "gpu", 0, 0, 0, 0) for name in names]
    usages = [model_usage(target, layout, layout.target_ngl, layout.split, n)]
    if draft is not None and layout.draft_device is not None:
        ngl, split = draft_offload(draft, layout.draft_device, n - 1)
        usages.append(model_usage(draft, layout, ngl, split, n))
    out = {d.name: dict.fromkeys(KINDS, 0) for d in devices}
    for usage in usages:
        for d, u in zip(devices, usage, strict=True):
            out[d.name]["model"] += u.weights
            out[d.name]["kv"] += u.kv
            out[d.name]["compute"] += u.compute
    return out


def compare(
    planned: dict[str, dict[str, int]],
    allocated: dict[str, dict[str, int]],
    descriptions: dict[str, str],
) -> list[dict[str, Any]]:
    """One row per device that either side uses: planned and allocated bytes by kind, totals,
    and allocated / planned."""
    rows = []
    for name in [*planned, *(a for a in allocated if a not in planned)]:
        plan = planned.get(name, dict.fromkeys(KINDS, 0))
        real = allocated.get(name, dict.fromkeys(KINDS, 0))
        p_total, a_total = sum(plan.values()), sum(real.values())
        if not p_total and not a_total:
            continue
        rows.append(
            {
                "device": name,
                "description": descriptions.get(name, name),
                "planned": {**plan, "total": p_total},
                "allocated": {**real, "total": a_total},
                "ratio": round(a_total / p_total, 4) if p_total else None,
            }
        )
    return rows


_reports: weakref.WeakKeyDictionary[Engine, list[dict[str, Any]]] = weakref.WeakKeyDictionary()


def report(engine: Engine) -> list[dict[str, Any]]:
    """Planned beside allocated, per device, for a loaded engine (computed once per engine:
    the GGUF headers are read again)."""
    if engine in _reports:
        return _reports[engine]
    settings = engine.settings
    gpus = ggml_devices.offload_devices()
    target = model_facts_from_gguf(settings.target.path)
    draft = model_facts_from_gguf(settings.draft.path) if settings.draft is not None else None
    layout = layout_for(settings, target, draft, gpus, engine.flash_attn)
    names = [d.name for d in gpus] + [HOST]
    planned = planned_by_device(target, draft, layout, names)
    t_alloc, d_alloc = engine.allocated()
    by_buffer = {d.buffer_type: d.name for d in gpus}
    allocated = t_alloc.merged(d_alloc).by_device(by_buffer)
    descriptions = {d.name: d.description for d in gpus} | {HOST: "host memory (CPU)"}
    rows = compare(planned, allocated, descriptions)
    _reports[engine] = rows
    return rows


def within(rows: Sequence[dict[str, Any]], tolerance: float = TOLERANCE) -> bool:
    """Whether every device's allocation is within ``tolerance`` of the plan."""
    return all(r["ratio"] is not None and abs(r["ratio"] - 1.0) <= tolerance for r in rows)


__all__ = ["Allocations", "compare", "layout_for", "planned_by_device", "report", "within"]
