"""The table ``localspec plan`` prints."""

from __future__ import annotations

from typing import TYPE_CHECKING

from localspec.planning.result import Plan
from localspec.units import gib

if TYPE_CHECKING:
    from localspec.planning.team import TeamServer

MAX_REJECTIONS_SHOWN = 8


def render_plan(plan: Plan) -> str:
    """The table `localspec plan` prints: choice, memory per device, rejections, speed."""
    lines = [f"hardware: {plan.hardware}", *_build_lines(plan), *_pair_lines(plan)]
    target_tps, draft_tps = plan.decode_ceiling_tps
    lines += [
        "",
        f"decode ceiling: target {target_tps:.0f} tok/s"
        + (f", draft {draft_tps:.0f} tok/s" if draft_tps else "")
        + f" (bandwidth bound); expected ~{plan.expected_tps:.0f} tok/s",
    ]
    if plan.expected_spec_speedup is not None:
        lines.append(
            f"speculative: expected {plan.expected_spec_speedup:.2f}x at draft length "
            f"{plan.best_draft_len} (assumed acceptance; measured live by the engine)"
        )
    if plan.capacity:
        lines += [
            "",
            "concurrent sessions",
            *("  " + s for s in plan.capacity.explanation.split("\n")),
        ]
    if plan.chat is not None:
        lines += ["", f"chat:     {plan.chat.mode}: {plan.chat.reason}"]
        if plan.chat.plan is not None:
            lines += ["  " + line if line else "" for line in _pair_lines(plan.chat.plan)]
    if plan.rejected:
        lines += ["", "rejected"]
        shown = plan.rejected[-MAX_REJECTIONS_SHOWN:]  # the nearest misses come last
        if len(plan.rejected) > len(shown):
            lines.append(f"  ({len(plan.rejected) - len(shown)} bigger candidates: see --json)")
        lines += [f"  {r.candidate}: {r.reason}" for r in shown]
    for note in plan.notes:
        lines.append(f"note: {note}")
    for warning in plan.warnings:
        lines.append(f"warning: {warning}")
    return "\n".join(lines)


def render_team(team: TeamServer) -> str:
    """What `localspec plan --team N --emit ENGINE` prints: the plan with its capacity
    arithmetic, the server's launch command, and the workstations' profile."""
    lines = [
        f"team server for {team.developers} developers, served by {team.engine}",
        "",
        render_plan(team.plan),
        "",
        f"launch command ({team.engine}, port {team.port})",
        "",
        team.command(),
        "",
        *(f"note: {note}" for note in team.notes),
        "",
        "workstation profile (<site config dir>/50-team.toml, e.g. /etc/xdg/localspec/)",
        "",
        team.profile.rstrip(),
    ]
    return "\n".join(lines)


def _build_lines(plan: Plan) -> list[str]:
    """Which llama.cpp build the plan runs on: its backends and the devices it offloads to."""
    if not plan.backends:
        return []
    chosen = f" (the launcher chose {plan.build_choice})" if plan.build_choice else ""
    lines = [f"build:    llama.cpp with {', '.join(plan.backends)}{chosen}"]
    if plan.build_fallback:
        lines.append(f"          fell back to the CPU: {plan.build_fallback}")
    lines += [f"device:   {d}" for d in plan.llama_devices]
    return lines


def _pair_lines(plan: Plan) -> list[str]:
    """One pair's choice and its memory per device (the completion pair, or the chat pair)."""
    t_layers = plan.target_layers
    offload = "all" if plan.target_ngl >= t_layers else f"{plan.target_ngl}"
    lines = [
        f"pair:     {plan.pair_id}",
        f"target:   {plan.target[0]} {plan.target[1]}  "
        f"(GPU layers {offload}/{t_layers}; sizes from {plan.target_source})",
        "draft:    "
        + (
            f"{plan.draft[0]} {plan.draft[1]} on {plan.draft_device} (GPU layers {plan.draft_ngl})"
            if plan.draft
            else "none (n-gram drafting from the prompt)"
        ),
        f"context:  {plan.n_ctx} tokens x {plan.n_slots} slot(s), KV {plan.type_k}/{plan.type_v}, "
        f"batch {plan.n_batch}/{plan.n_ubatch}, flash attention "
        f"{'on' if plan.flash_attn else 'off'}, threads {plan.n_threads}/{plan.n_threads_batch}",
    ]
    if plan.tensor_split:
        lines.append("split:    " + " / ".join(f"{s:.2f}" for s in plan.tensor_split))
    lines += ["", "memory (GiB)"]
    header = f"  {'device':<36}{'weights':>9}{'KV':>8}{'compute':>9}{'draft':>8}"
    header += f"{'margin':>8}{'used':>8}{'budget':>8}"
    lines.append(header)
    for r in plan.memory:
        lines.append(
            f"  {r.device[:35]:<36}{gib(r.weights):>9}{gib(r.kv):>8}{gib(r.compute):>9}"
            f"{gib(r.draft):>8}{gib(r.margin):>8}{gib(r.used):>8}{gib(r.budget):>8}"
        )
    return lines
