"""The plan's memory arithmetic held against what llama.cpp allocated, per device.

``planned`` runs the planner's own model (planning/memory.py) on the GGUFs' tensor tables and
the settings the engine loaded with; ``allocated`` is llama.cpp's log of its buffers
(engine/alloc.py). Both are split by kind: weights ("model"), KV cache, and compute (the graph
allocator's peak plus the host logits buffer). ``localspec status`` shows them side by side.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Sequence
from typing import Any, Protocol

from localspec.engine import devices as ggml_devices
from localspec.engine.alloc import HOST, KINDS, Allocations, MiB
from localspec.engine.errors import OutOfMemoryError
from localspec.engine.types import EngineSettings, ModelSettings
from localspec.planning.facts import model_facts_from_gguf
from localspec.planning.memory import draft_offload, model_usage
from localspec.planning.types import Device, Layout, ModelFacts

_log = logging.getLogger("localspec.memory")

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
    target: ModelFacts,
    draft: ModelFacts | None,
    layout: Layout,
    names: Sequence[str],
    max_tensor: Sequence[int | None] = (),
) -> dict[str, dict[str, int]]:
    """Bytes per device name and kind under ``layout`` (``names``: the GPUs, then the host;
    ``max_tensor``: each GPU's largest tensor per op)."""
    n = len(names)
    devices = [Device(name, "gpu", 0, 0, 0, 0) for name in names]
    usages = [model_usage(target, layout, layout.target_ngl, layout.split, n, max_tensor)]
    if draft is not None and layout.draft_device is not None:
        ngl, split = draft_offload(draft, layout.draft_device, n - 1)
        usages.append(model_usage(draft, layout, ngl, split, n, max_tensor))
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


class LoadedPair(Protocol):
    """What the memory check reads of a loaded pair (engine/pair.py's ModelPair)."""

    settings: EngineSettings
    flash_attn: bool

    def allocated(self) -> tuple[Allocations, Allocations]: ...


_reports: weakref.WeakKeyDictionary[LoadedPair, list[dict[str, Any]]] = weakref.WeakKeyDictionary()


def report(engine: LoadedPair) -> list[dict[str, Any]]:
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
    limits = [d.max_tensor_bytes for d in gpus]
    planned = planned_by_device(target, draft, layout, names, limits)
    t_alloc, d_alloc = engine.allocated()
    by_buffer = {d.buffer_type: d.name for d in gpus}
    allocated = t_alloc.merged(d_alloc).by_device(by_buffer)
    descriptions = {d.name: d.description for d in gpus} | {HOST: "RAM"}
    rows = compare(planned, allocated, descriptions)
    _reports[engine] = rows
    return rows


def enforce_cap(engine: LoadedPair, cap: int) -> None:
    """Raise OutOfMemoryError when llama.cpp allocated more than ``cap`` bytes on an offload
    device: the load a card of that size would have refused (to play one on a bigger or
    software device, and so that the cap the plan sized for holds)."""
    gpus = ggml_devices.offload_devices()
    t_alloc, d_alloc = engine.allocated()
    used = t_alloc.merged(d_alloc).by_device({d.buffer_type: d.name for d in gpus})
    for d in gpus:
        total = sum(used.get(d.name, {}).values())
        if total > cap:
            raise OutOfMemoryError(
                f"{d.name} ({d.description}): llama.cpp allocated {total / MiB:.1f} MiB, over "
                f"the {cap / MiB:.1f} MiB cap (limits.gpu_memory_gb)"
            )


def props(engine: LoadedPair) -> dict[str, Any]:
    """What /props says of the build and its memory (``localspec status`` shows it): the
    backends, and planned beside allocated per device. Never raises: /props must answer."""
    try:
        from localspec.hardware import launcher_choice

        choice = launcher_choice()
        return {
            "backends": list(ggml_devices.backends()),
            "launcher": {k: choice[k] for k in ("backend", "fallback") if choice.get(k)},
            "memory": report(engine),
        }
    except Exception as exc:  # a GGUF header that moved under us, an odd build
        _log.warning("could not compare the plan's memory with llama.cpp's: %s", exc)
        return {}


def within(rows: Sequence[dict[str, Any]], tolerance: float = TOLERANCE) -> bool:
    """Whether every device's allocation is within ``tolerance`` of the plan."""
    return all(r["ratio"] is not None and abs(r["ratio"] - 1.0) <= tolerance for r in rows)


__all__ = ["Allocations", "compare", "layout_for", "planned_by_device", "props", "report", "within"]


def _available_ram() -> int:
    import psutil

    return int(psutil.virtual_memory().available)


def _fits(planned: dict[str, dict[str, int]], budgets: dict[str, int]) -> bool:
    return all(sum(planned[name].values()) <= budget for name, budget in budgets.items())


def refit(
    settings: EngineSettings, *, host_bytes: int | None = None
) -> tuple[EngineSettings, str] | None:
    """A layout that fits after llama.cpp ran out of memory loading ``settings``: the planner's
    arithmetic against each device's free memory (within ``gpu_memory_cap``, else less
    llama.cpp's 1 GiB margin) and the host's available RAM (less 2 GiB). A context past the
    model's training length goes first, then GPU layers (the draft leaves the GPU last), then
    the context halves (not below 1024). Returns the settings and what changed, or None when
    nothing is left to give up."""
    from dataclasses import replace

    from localspec.engine.llama import resolved_flash_attn
    from localspec.planning.memory import GPU_MARGIN, HOST_MARGIN

    gpus = ggml_devices.offload_devices()
    target = model_facts_from_gguf(settings.target.path)
    draft = model_facts_from_gguf(settings.draft.path) if settings.draft is not None else None
    cap = settings.gpu_memory_cap
    budgets = {
        d.name: min(d.free_bytes, cap) if cap is not None else d.free_bytes - GPU_MARGIN
        for d in gpus
    }
    host = _available_ram() if host_bytes is None else host_bytes
    budgets[HOST] = host - HOST_MARGIN
    names = [d.name for d in gpus] + [HOST]
    limits = [d.max_tensor_bytes for d in gpus]
    flash_attn = resolved_flash_attn(settings.target, settings.n_slots)
    old = layout_for(settings, target, draft, gpus, flash_attn)
    full = target.n_layer + 1 if gpus else 0
    ctx = old.n_ctx
    if ctx > max(target.n_ctx_train, 4096):
        ctx = max(target.n_ctx_train, 4096)
    draft_places = [old.draft_device]
    if old.draft_device is not None and old.draft_device < len(gpus):
        draft_places.append(len(gpus))  # the draft to the host, once nothing else fits
    chosen: Layout | None = None
    while chosen is None and ctx >= min(old.n_ctx, 1024):
        for place in draft_places:
            for ngl in range(min(old.target_ngl, full), -1, -1):
                layout = replace(old, n_ctx=ctx, target_ngl=ngl, draft_device=place)
                if layout == old:
                    continue  # what just failed
                if _fits(planned_by_device(target, draft, layout, names, limits), budgets):
                    chosen = layout
                    break
            if chosen is not None:
                break
        ctx //= 2
    if chosen is None:
        # the arithmetic says the failed layout fits (a driver or another process took more
        # than the device reports): give up a quarter of the GPU layers, as `smaller` does
        if old.target_ngl == 0:
            return None
        chosen = replace(old, target_ngl=max(0, old.target_ngl - max(1, full // 4)))
    changes = []
    if chosen.target_ngl != old.target_ngl:
        changes.append(f"GPU layers {old.target_ngl} -> {chosen.target_ngl} of {full}")
    if chosen.draft_device != old.draft_device:
        changes.append("the draft model to the CPU")
    if chosen.n_ctx != old.n_ctx:
        changes.append(f"context {old.n_ctx} -> {chosen.n_ctx} tokens")
    t = replace(settings.target, n_gpu_layers=chosen.target_ngl, n_ctx=chosen.n_ctx)
    d = settings.draft
    if d is not None:
        d = replace(d, n_ctx=chosen.n_ctx)
        if chosen.draft_device == len(gpus):
            d = replace(d, n_gpu_layers=0)
    return replace(settings, target=t, draft=d), ", ".join(changes)
