"""Layout moves the search makes for one candidate: where the draft goes, how the layers split
over GPUs, which (KV type, context) steps to try, and how far the context can grow."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from localspec.hardware import HardwareFacts
from localspec.planning.inputs import PlanSettings
from localspec.planning.memory import (
    CTX_STEP,
    compute_bytes,
    draft_bytes,
    fits,
    kv_cells,
    memory_table,
    padded_ctx,
)
from localspec.planning.types import (
    Candidate,
    Device,
    DeviceMemory,
    Layout,
    ModelFacts,
    default_flash_attn,
)


@dataclass(frozen=True)
class SearchContext:
    """Planner state shared by the search helpers."""

    facts: HardwareFacts
    settings: PlanSettings
    devices: tuple[Device, ...]
    datacenter: bool
    ctx_max_setting: int
    n_ubatch_full: int

    @property
    def n_gpus(self) -> int:
        return len(self.devices) - 1

    @property
    def host(self) -> int:
        return len(self.devices) - 1

    @property
    def min_tps(self) -> float:
        return 1000 / self.settings.max_token_ms

    def full_ngl(self, m: ModelFacts) -> int:
        return m.n_layer + 1 if self.n_gpus else 0

    def attention(self, type_kv: str, n_slots: int = 1) -> tuple[bool, ...]:
        """Flash attention settings to try, best first: the engine's default, then on when
        its score matrix is what keeps the layout from fitting."""
        preferred = default_flash_attn(self.n_gpus > 0, type_kv, type_kv, n_slots)
        return (True,) if preferred else (False, True)

    def ctx_max(self, m: ModelFacts) -> int:
        return min(self.ctx_max_setting, m.n_ctx_train)

    def layout(
        self,
        n_ctx: int,
        type_kv: str,
        n_ubatch: int,
        target_ngl: int,
        draft_device: int | None,
        flash_attn: bool = True,
    ) -> Layout:
        """A layout to try, with the asked slots and draft length (its GPU split comes later,
        from what fits)."""
        n_slots = self.settings.n_slots or 1
        spec_n_max = self.settings.spec_n_max
        return Layout(
            n_ctx, n_slots, type_kv, n_ubatch, target_ngl, (), draft_device, spec_n_max, flash_attn
        )


def draft_placements(c: SearchContext, cand: Candidate) -> list[int | None]:
    """The draft goes on the fastest GPU first, then the next, then the host."""
    if cand.draft is None:
        return [None]
    gpus = sorted(
        range(c.n_gpus),
        key=lambda i: (-c.devices[i].bandwidth_gbps, -c.devices[i].budget, i),
    )
    return [*gpus, c.host]


def _split_for(c: SearchContext, cand: Candidate, layout: Layout) -> tuple[float, ...]:
    """GPU proportions: each GPU's budget left after the draft and a compute buffer; a GPU
    that cannot hold one layer gets none (it would only carry a compute buffer)."""
    if c.n_gpus == 0:
        return ()
    if c.n_gpus == 1:
        return (1.0,)
    m = cand.target
    cells = kv_cells(layout)
    one_layer = max(m.layer_bytes) + cells * m.kv_bytes_per_token_layer(
        layout.type_kv, layout.type_kv
    )
    free = []
    for i in range(c.n_gpus):
        room = c.devices[i].budget - compute_bytes(
            m, layout.n_ubatch, layers=True, output=i == c.n_gpus - 1
        )
        if cand.draft is not None and layout.draft_device == i:
            room -= draft_bytes(cand.draft, layout, c.devices)[i]
        free.append(room if room >= one_layer else 0)
    total = sum(free)
    if total <= 0:
        return tuple(1.0 / c.n_gpus for _ in range(c.n_gpus))
    return tuple(f / total for f in free)


def _rebalance(
    split: tuple[float, ...], rows: Sequence[DeviceMemory], n_gpus: int
) -> tuple[float, ...] | None:
    """Move share away from overflowing GPUs (layers are whole, so proportions round);
    None when no GPU has room to take it."""
    over = [i for i in range(n_gpus) if not rows[i].fits]
    spare = [i for i in range(n_gpus) if rows[i].fits and split[i] > 0]
    if not over or not spare:
        return None
    new = list(split)
    for i in over:
        r = rows[i]
        layer_part = max(r.weights + r.kv, 1)
        excess = r.used - r.budget
        new[i] = split[i] * max(0.0, 1 - 1.1 * excess / layer_part)
    total = sum(new)
    return tuple(s / total for s in new) if total > 0 else None


def fit_rows(
    c: SearchContext, cand: Candidate, layout: Layout
) -> tuple[Layout, list[DeviceMemory]]:
    """The layout with its tensor split chosen, and its memory table."""
    split: tuple[float, ...] | None = _split_for(c, cand, layout)
    for _ in range(6):
        assert split is not None
        layout = replace(layout, split=tuple(round(s, 4) for s in split))
        rows = memory_table(cand.target, cand.draft, layout, c.devices)
        if c.n_gpus < 2 or fits(rows):
            break
        split = _rebalance(layout.split, rows, c.n_gpus)
        if split is None:
            break
    return layout, rows


def fit_first_attention(
    c: SearchContext, cand: Candidate, layout: Layout
) -> tuple[Layout, list[DeviceMemory]] | None:
    """``layout`` with the first attention setting (``c.attention``) under which it fits."""
    for flash_attn in c.attention(layout.type_kv, layout.n_slots):
        fitted, rows = fit_rows(c, cand, replace(layout, flash_attn=flash_attn))
        if fits(rows):
            return fitted, rows
    return None


def ladder(c: SearchContext, m: ModelFacts) -> list[tuple[str, int]]:
    """(KV type, context) steps tried before spilling layers: full context at f16, then
    quantized KV, then the context halved toward the floor."""
    ctx_max = c.ctx_max(m)
    floor = min(padded_ctx(c.settings.min_context), ctx_max)
    kv_types = ["q8_0"] if c.datacenter else ["f16", "q8_0"]
    if c.settings.allow_q4_kv:
        kv_types.append("q4_0")
    if m.head_dim % 32:  # quantized KV blocks hold 32 values of one head
        kv_types = ["f16"]
    steps = [(kv, ctx_max) for kv in kv_types]
    ctx = ctx_max
    while ctx > floor:
        ctx = max(floor, padded_ctx(ctx // 2))
        steps.append((kv_types[-1], ctx))
    return steps


def largest_ctx(c: SearchContext, cand: Candidate, layout: Layout, hi: int) -> int:
    """Grow the context of a fitting layout up to ``hi`` (binary search on 256-token steps)."""
    lo_steps, hi_steps = layout.n_ctx // CTX_STEP, hi // CTX_STEP
    while lo_steps < hi_steps:
        mid = (lo_steps + hi_steps + 1) // 2
        if fits(fit_rows(c, cand, replace(layout, n_ctx=mid * CTX_STEP))[1]):
            lo_steps = mid
        else:
            hi_steps = mid - 1
    return lo_steps * CTX_STEP
