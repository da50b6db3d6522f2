"""Datacenter sizing: as many slots as memory and the per-token latency bound allow, and the
developer sessions those slots hold at p95."""

from __future__ import annotations

from dataclasses import replace

from localspec.planning.layout import SearchContext, fit_rows
from localspec.planning.memory import fits
from localspec.planning.result import Capacity
from localspec.planning.speed import (
    BANDWIDTH_EFFICIENCY,
    poisson_quantile,
    prompt_seconds,
    sessions_held,
    target_seconds,
)
from localspec.planning.types import Candidate, DeviceMemory, Layout

MAX_SLOTS = 256  # the server's limit


def size_slots(
    c: SearchContext, cand: Candidate, layout: Layout
) -> tuple[Layout, list[DeviceMemory], Capacity | None]:
    """The layout with its slot count, its memory table, and the arithmetic; no Capacity
    when not even one slot fits or meets the latency bound."""
    s = c.settings
    kv_tokens = layout.n_ctx // 2  # a slot's context is half full on average
    measured = s.step_costs.get((cand.target.model_id, cand.target.quant))

    def step_s(batch: int, lay: Layout) -> float:
        if measured is not None:
            return measured.step_ms(batch) / 1000
        return target_seconds(
            cand.target,
            lay,
            c.devices,
            kv_tokens=kv_tokens,
            batch=batch,
            efficiency=BANDWIDTH_EFFICIENCY,
        )

    def fits_slots(n: int) -> bool:
        return fits(fit_rows(c, cand, replace(layout, n_slots=n))[1])

    if not fits_slots(1):
        return layout, [], None
    lo, hi = 1, s.n_slots or MAX_SLOTS
    if fits_slots(hi):
        lo = hi
    while lo < hi - 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits_slots(mid) else (lo, mid)
    by_memory = lo
    limit = s.max_token_ms / 1000
    by_latency = 0
    for b in range(1, by_memory + 1):
        if step_s(b, layout) > limit:
            break
        by_latency = b
    if by_latency == 0:
        return layout, [], None
    n_slots = min(by_memory, by_latency)
    layout, rows = fit_rows(c, cand, replace(layout, n_slots=n_slots))
    step = step_s(n_slots, layout)
    prompt = prompt_seconds(
        cand.target, c.devices, layout.target_ngl, layout.split, s.new_prompt_tokens_per_request
    )
    busy = prompt + s.tokens_per_request * step
    duty = s.requests_per_session_per_min / 60 * busy
    held = sessions_held(n_slots, duty)
    p95 = poisson_quantile(held * duty, 0.95)
    explanation = "\n".join(
        [
            f"slots: {n_slots} = min({by_memory} by memory at {layout.n_ctx} tokens/slot "
            f"{layout.type_kv} KV, {by_latency} by the {s.max_token_ms:g} ms/token bound)",
            f"one decode step with all {n_slots} slots busy: {step * 1000:.1f} ms "
            + (
                f"(measured: {measured.source}, {measured.kv_tokens} tokens of context each)"
                if measured is not None
                else f"(assumed: weights + KV of {kv_tokens} tokens/slot at "
                f"{BANDWIDTH_EFFICIENCY:.0%} of bandwidth, GPUs in sequence; "
                "`localspec bench steps` measures it)"
            ),
            f"a request holds a slot {busy:.2f} s = {prompt * 1000:.0f} ms prompt "
            f"({s.new_prompt_tokens_per_request} new tokens) + {s.tokens_per_request} tokens "
            f"x {step * 1000:.1f} ms",
            f"a session sends {s.requests_per_session_per_min:g} requests/min: busy "
            f"{duty:.1%} of the time",
            f"{held} sessions: {held * duty:.1f} busy slots on average, {p95} at p95 "
            f"(Poisson) <= {n_slots} slots, so p95 time per token <= {step * 1000:.1f} ms",
        ]
    )
    capacity = Capacity(
        sessions_held=held,
        sessions_requested=s.concurrent_sessions,
        slots_by_memory=by_memory,
        slots_by_latency=by_latency,
        step_ms_at_full_batch=step * 1000,
        request_busy_s=busy,
        duty_cycle=duty,
        busy_slots_p95=p95,
        explanation=explanation,
        step_measured=measured is not None,
    )
    return layout, rows, capacity
