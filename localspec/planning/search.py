"""The search and its choice rules: the largest target that decodes within the speed bound,
wholly on the accelerator if it can (shrinking context and quantizing KV before spilling
layers), else with the layers that do not fit in RAM; when no target is fast enough, the
smallest spilled. Pure: data in, Plan out."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from localspec.hardware import HardwareFacts
from localspec.planning.candidates import allowed_candidates
from localspec.planning.capacity import size_slots
from localspec.planning.chat import with_chat
from localspec.planning.inputs import PlanSettings
from localspec.planning.layout import (
    SearchContext,
    draft_placements,
    fit_first_attention,
    fit_rows,
    ladder,
    largest_ctx,
)
from localspec.planning.memory import devices_for, draft_offload, padded_ctx
from localspec.planning.result import Capacity, Plan, Rejection
from localspec.planning.speed import (
    BANDWIDTH_EFFICIENCY,
    draft_seconds,
    speculative_speedup,
    target_seconds,
)
from localspec.planning.types import Candidate, DeviceMemory, Layout, PlanError, StepCosts
from localspec.units import gib

PERSONAL_CONTEXT = 16384
DATACENTER_CONTEXT = 8192
MIN_DRAFT_SPEEDUP = 1.05  # a draft model that gains less than this is not worth its memory


@dataclass(frozen=True)
class _Fit:
    cand: Candidate
    layout: Layout
    rows: tuple[DeviceMemory, ...]
    whole: bool
    speedup: float | None
    best_gamma: int | None
    target_s: float  # expected seconds per target token
    capacity: Capacity | None = None


def _draft_speed(
    c: SearchContext, cand: Candidate, layout: Layout
) -> tuple[float | None, int | None]:
    if cand.draft is None or layout.draft_device is None:
        return None, None
    cost_ratio = draft_seconds(cand.draft, layout, c.devices) / target_seconds(
        cand.target, layout, c.devices
    )
    return speculative_speedup(c.settings.acceptance, cost_ratio, c.settings.spec_n_max)


def _finish(c: SearchContext, cand: Candidate, layout: Layout, *, whole: bool) -> _Fit | None:
    """Grow the context into spare memory (personal) or size the slots (datacenter)."""
    capacity = None
    if c.datacenter:
        layout, rows, capacity = size_slots(c, cand, layout)
        if capacity is None:
            return None
    else:
        layout = replace(layout, n_ctx=largest_ctx(c, cand, layout, c.ctx_max(cand.target)))
        layout, rows = fit_rows(c, cand, layout)
    speedup, gamma = _draft_speed(c, cand, layout)
    target_s = target_seconds(cand.target, layout, c.devices, efficiency=BANDWIDTH_EFFICIENCY)
    return _Fit(cand, layout, tuple(rows), whole, speedup, gamma, target_s, capacity)


def _draft_pays(fit: _Fit) -> bool:
    return fit.cand.draft is None or (fit.speedup or 0) >= MIN_DRAFT_SPEEDUP


def _groups(candidates: Sequence[Candidate]) -> list[list[Candidate]]:
    """Candidates of one pair (one target model, one draft), in candidate order."""
    groups: dict[str, list[Candidate]] = {}
    for cand in candidates:
        groups.setdefault(cand.pair_id, []).append(cand)
    return list(groups.values())


def _group_label(group: Sequence[Candidate]) -> str:
    quants = "/".join(c.target.quant for c in group)
    return f"{group[0].target.model_id} {quants}{group[0].draft_label}"


@dataclass
class _Search:
    """What searching one group found besides a winner: why it failed, the best shortfall."""

    too_slow: list[tuple[Candidate, float]] = field(default_factory=list)
    spill_too_slow: list[tuple[Candidate, float]] = field(default_factory=list)
    draft_loses: list[tuple[str, float]] = field(default_factory=list)
    short: _Fit | None = None  # datacenter: the fit holding most sessions, below the ask

    def keep_short(self, fit: _Fit) -> None:
        if _held(fit) > _held(self.short):
            self.short = fit


def _held(fit: _Fit | None) -> int:
    return fit.capacity.sessions_held if fit and fit.capacity else -1


def _short_of_sessions(c: SearchContext, fit: _Fit) -> bool:
    asked = c.settings.concurrent_sessions
    return bool(c.datacenter and asked and _held(fit) < asked)


def _search_whole(c: SearchContext, group: Sequence[Candidate], found: _Search) -> _Fit | None:
    """Every layer on the accelerator (in RAM on a CPU machine). Order of preference: the
    draft on the fastest device, the full context at f16 KV, then quantized KV, then a
    shorter context; within each, the biggest ubatch, then the highest quant."""
    head = group[0]
    for draft_dev in draft_placements(c, head):
        for kv, ctx in ladder(c, head.target):
            for ubatch in sorted({c.n_ubatch_full, 512}, reverse=True):
                for cand in group:
                    layout = c.layout(ctx, kv, ubatch, c.full_ngl(cand.target), draft_dev)
                    fitted = fit_first_attention(c, cand, layout)
                    if fitted is None:
                        continue
                    fit = _finish(c, cand, fitted[0], whole=True)
                    if fit is None:
                        continue
                    if not c.datacenter and 1 / fit.target_s < c.min_tps:
                        found.too_slow.append((cand, 1 / fit.target_s))
                        continue
                    if not _draft_pays(fit):
                        found.draft_loses.append((c.devices[draft_dev or 0].name, fit.speedup or 0))
                        continue
                    if _short_of_sessions(c, fit):
                        found.keep_short(fit)
                        continue
                    return fit
    return None


def _why_not(c: SearchContext, group: Sequence[Candidate], found: _Search) -> str:
    if found.short is not None and found.short.capacity is not None:
        return (
            f"holds at most {found.short.capacity.sessions_held} concurrent sessions, "
            f"fewer than the {c.settings.concurrent_sessions} asked"
        )
    if found.too_slow:
        # the fastest quant; on a tie (compute-bound) the smallest, which comes last
        cand, tps = max(reversed(found.too_slow), key=lambda x: x[1])
        return (
            f"fits, but decodes at ~{tps:.0f} tok/s at best ({cand.target.quant}), under the "
            f"{c.min_tps:.0f} tok/s that {c.settings.max_token_ms:g} ms/token needs"
        )
    if found.draft_loses:
        where, speedup = max(found.draft_loses, key=lambda x: x[1])
        return f"fits only with the draft on {where}, where it would not pay ({speedup:.2f}x)"
    smallest = group[-1]
    kv, ctx = ladder(c, smallest.target)[-1]
    draft_dev = draft_placements(c, smallest)[0]
    layout = c.layout(ctx, kv, 512, c.full_ngl(smallest.target), draft_dev, c.attention(kv)[-1])
    _, rows = fit_rows(c, smallest, layout)
    over = [r for r in rows if not r.fits]
    if not over:
        return f"no slot meets the {c.settings.max_token_ms:g} ms/token bound"
    r = over[0]
    where, need, usable = r.device, r.used, r.budget
    if r.shared_with:  # unified memory: the GPU's share and the CPU's come from one pool
        where, need = "unified memory", r.used + r.shared_with
        usable = max(0, r.available - r.margin)
    spilled = ""
    if found.spill_too_slow:
        cand, tps = max(reversed(found.spill_too_slow), key=lambda x: x[1])
        spilled = (
            f"; with the rest of its layers in RAM it decodes at ~{tps:.0f} tok/s at best "
            f"({cand.target.quant}), under {c.min_tps:.0f}"
        )
    return (
        f"even {smallest.target.quant} needs {gib(need)} GiB on {where} but "
        f"{gib(usable)} GiB is usable (at {ctx} tokens, {kv} KV){spilled}"
    )


def _spilled_layouts(c: SearchContext, cand: Candidate, draft_dev: int | None) -> _Fit | None:
    """``cand`` with as many layers on the GPU as fit, at the floor context and the most
    compact KV: the fastest spill of it (fewer layers on the GPU only decode slower)."""
    kv, ctx = ladder(c, cand.target)[-1]
    for ngl in range(c.full_ngl(cand.target) - 1, -1, -1):
        fitted = fit_first_attention(c, cand, c.layout(ctx, kv, 512, ngl, draft_dev))
        if fitted is not None:
            return _finish(c, cand, fitted[0], whole=False)
    return None


def _search_spilled(c: SearchContext, group: Sequence[Candidate], found: _Search) -> _Fit | None:
    """Nothing of ``group`` fits wholly on the GPU: its highest quant that, spilled, still
    decodes within the speed bound. A bigger model spilled beats a smaller one wholly on the
    GPU when both are fast enough, as on a CPU machine the biggest fast enough wins; and
    more GPU memory only puts more layers there, so the choice stays monotone."""
    for draft_dev in draft_placements(c, group[0]):
        for cand in group:
            fit = _spilled_layouts(c, cand, draft_dev)
            if fit is None:
                continue
            if 1 / fit.target_s < c.min_tps:
                found.spill_too_slow.append((cand, 1 / fit.target_s))
                continue
            if _draft_pays(fit):
                return fit
            found.draft_loses.append((c.devices[draft_dev or 0].name, fit.speedup or 0))
    return None


def _search_spill(c: SearchContext, candidates: Sequence[Candidate]) -> _Fit | None:
    """No target is fast enough: the smallest, with as many layers on the GPU as fit, at the
    floor context and quantized KV (smaller runs faster when spilled)."""
    smallest = min(cand.target.params_b for cand in candidates)
    for group in _groups([cand for cand in candidates if cand.target.params_b == smallest]):
        for draft_dev in draft_placements(c, group[0]):
            for cand in reversed(group):  # the smallest quant spills the fewest layers
                fit = _spilled_layouts(c, cand, draft_dev)
                if fit is not None and _draft_pays(fit):
                    return fit
    return None


def _threads(c: SearchContext, fit: _Fit) -> tuple[int, int]:
    cores = c.facts.cpu.physical_cores
    if c.settings.threads:
        return c.settings.threads, c.settings.threads
    cpu_work = c.n_gpus == 0 or fit.layout.target_ngl < fit.cand.target.n_layer + 1
    cpu_work = cpu_work or fit.layout.draft_device == c.host
    # Leave a core to the editor and the server on personal machines with cores to spare.
    decode = max(1, cores - 1) if cores > 4 and not c.datacenter else cores
    return (decode if cpu_work else min(cores, 4)), cores


def make_plan(
    catalog: Any,
    facts: HardwareFacts,
    settings: PlanSettings | None = None,
    *,
    step_costs: Mapping[tuple[str, str], StepCosts] | None = None,
) -> Plan:
    """Choose and justify the serving configuration for ``facts`` (pure: nothing here touches
    the GPU, the network or the disk).

    ``catalog`` is a localspec.catalog.Catalog, or already a list of ``Candidate``;
    ``settings``: what is asked of the plan (``localspec.settings_to.plan_inputs`` builds it
    from localspec's Settings); None: the defaults;
    ``step_costs``: step times measured on the machine ``facts`` describes, by (model, quant).
    """
    if settings is None:
        settings = PlanSettings()
    if step_costs:
        settings = replace(settings, step_costs=dict(step_costs))
    candidates = allowed_candidates(catalog, settings)
    datacenter = facts.kind == "datacenter"
    context = settings.context or (DATACENTER_CONTEXT if datacenter else PERSONAL_CONTEXT)
    if context < settings.min_context:
        settings = replace(settings, min_context=context)
    devices = tuple(devices_for(facts, settings.gpu_memory_cap_bytes))
    has_gpu = len(devices) > 1
    c = SearchContext(
        facts, settings, devices, datacenter, padded_ctx(context), 1024 if has_gpu else 512
    )

    rejected: list[Rejection] = []
    chosen: _Fit | None = None
    best_short: _Fit | None = None
    for group in _groups(candidates):
        found = _Search()
        chosen = _search_whole(c, group, found)
        if chosen is None and c.n_gpus and not c.datacenter and settings.spill:
            chosen = _search_spilled(c, group, found)
        if chosen is not None:
            break
        rejected.append(Rejection(_group_label(group), _why_not(c, group, found)))
        if _held(found.short) > _held(best_short):
            best_short = found.short

    warnings = list(facts.warnings)
    notes: list[str] = []
    if chosen is None and best_short is not None and best_short.capacity is not None:
        chosen = best_short
        warnings.append(
            f"no candidate holds {settings.concurrent_sessions} concurrent sessions within "
            f"{settings.max_token_ms:g} ms/token; this plan holds "
            f"{best_short.capacity.sessions_held}"
        )
    layers_on_gpu = "{} of {} layers on the GPU, the rest in RAM"
    if chosen is None:
        chosen = _search_spill(c, candidates)
        if chosen is None:
            raise PlanError(_nothing_fits(c, rejected))
        notes.append(
            "no target is fast enough wholly on the accelerator or spilled: the smallest runs "
            "with " + layers_on_gpu.format(chosen.layout.target_ngl, chosen.cand.target.n_layer + 1)
        )
    elif not chosen.whole:
        notes.append(
            f"{chosen.cand.target.model_id} does not fit wholly on the accelerator and still "
            f"decodes within {settings.max_token_ms:g} ms/token spilled: "
            + layers_on_gpu.format(chosen.layout.target_ngl, chosen.cand.target.n_layer + 1)
        )
    if settings.pair and chosen.cand.pair_id != settings.pair:
        notes.append(
            f"the preferred pair {settings.pair} does not fit; chose {chosen.cand.pair_id}"
        )
    if chosen.layout.type_kv != "f16":
        notes.append(f"KV cache quantized to {chosen.layout.type_kv} to fit (flash attention on)")
    if chosen.layout.n_ctx < c.ctx_max(chosen.cand.target):
        notes.append(f"context shrunk to {chosen.layout.n_ctx} tokens to fit")
    plan = _to_plan(c, chosen, rejected, notes, warnings)
    return with_chat(catalog, facts, settings, plan, make_plan)


def _nothing_fits(c: SearchContext, rejected: Sequence[Rejection]) -> str:
    host = c.devices[-1]
    return "\n".join(
        [
            f"no catalog model fits this machine ({c.facts.description}; "
            f"{gib(host.budget)} GiB of RAM usable):",
            *(f"  {r.candidate}: {r.reason}" for r in rejected[-5:]),
            "free memory, lower limits.context, or allow a smaller model in models.allowed",
        ]
    )


def _to_plan(
    c: SearchContext, fit: _Fit, rejected: list[Rejection], notes: list[str], warnings: list[str]
) -> Plan:
    cand, layout = fit.cand, fit.layout
    n_threads, n_threads_batch = _threads(c, fit)
    draft_ngl, draft_device, draft_tps = 0, None, None
    if cand.draft is not None and layout.draft_device is not None:
        draft_ngl, _ = draft_offload(cand.draft, layout.draft_device, c.n_gpus)
        draft_device = c.devices[layout.draft_device].name
        draft_tps = 1 / draft_seconds(cand.draft, layout, c.devices)
    target_tps = 1 / target_seconds(cand.target, layout, c.devices)
    return Plan(
        hardware=f"{c.facts.name}: {c.facts.description}",
        pair_id=cand.pair_id,
        target=(cand.target.model_id, cand.target.quant),
        draft=(cand.draft.model_id, cand.draft.quant) if cand.draft else None,
        target_ngl=layout.target_ngl,
        draft_ngl=draft_ngl,
        target_layers=cand.target.n_layer + 1,
        n_ctx=layout.n_ctx,
        n_slots=layout.n_slots,
        type_k=layout.type_kv,
        type_v=layout.type_kv,
        n_batch=max(layout.n_ubatch, layout.n_slots),
        n_ubatch=layout.n_ubatch,
        flash_attn=layout.flash_attn,
        n_threads=n_threads,
        n_threads_batch=n_threads_batch,
        tensor_split=layout.split if c.n_gpus > 1 else None,
        draft_device=draft_device,
        draft_gpu=layout.draft_device if draft_ngl else None,
        memory=fit.rows,
        rejected=tuple(rejected),
        decode_ceiling_tps=(target_tps, draft_tps),
        expected_tps=1 / fit.target_s,
        expected_spec_speedup=fit.speedup,
        best_draft_len=fit.best_gamma,
        fits_wholly=fit.whole,
        capacity=fit.capacity,
        notes=tuple(notes),
        warnings=tuple(warnings),
        target_source=cand.target.source,
        speculative=c.settings.speculative,
        cache_reuse=c.settings.cache_reuse,
        cache_exact_ms=c.settings.cache_exact_ms,
        backends=c.facts.build.backends,
        llama_devices=c.facts.build.devices,
        build_choice=c.facts.build.chosen,
        build_fallback=c.facts.build.fallback,
    )
