"""The chat side of a plan: who answers ``/v1/chat/completions`` on this machine.

In order of preference:

1. ``shared``: the completion pair's target is an instruct model that also does FIM
   (Qwen3-Coder-30B-A3B): one pair serves completion and chat.
2. ``separate``: a second, instruct pair fits in the memory the completion pair leaves (on
   the accelerator, else in RAM when it still decodes within ``max_token_ms``): both load.
3. ``shared``, switched: no instruct pair fits beside the completion pair, but one model that
   does both fits the machine by itself: it replaces the completion pair.
4. ``off``: nothing fits; chat answers a 501 whose text (``ChatPlan.reason``) says what to
   change.

Pure, like the rest of the planner: the second search is the same ``make_plan`` on the
machine's memory minus what the completion pair takes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from localspec.hardware import GiB, HardwareFacts
from localspec.planning.result import ChatPlan, Plan
from localspec.planning.types import PlanError

PlanFn = Callable[[Any, HardwareFacts, Any], Plan]


def remaining(facts: HardwareFacts, plan: Plan) -> HardwareFacts:
    """The machine as the completion pair leaves it: each device's memory less what the pair
    uses there (the plan's memory rows list the usable GPUs in order, then the host)."""
    rows = list(plan.memory)
    gpus = list(facts.usable_gpus)
    if len(rows) != len(gpus) + 1:
        raise PlanError("the plan's memory rows do not match the machine's devices")
    host_used = rows[-1].used
    new_gpus = []
    for gpu, row in zip(gpus, rows, strict=False):
        new_gpus.append(replace(gpu, free_bytes=max(0, gpu.free_bytes - row.used)))
        if gpu.unified:  # one pool: what the GPU rows take comes out of RAM too
            host_used += row.used
    cpu = replace(facts.cpu, ram_available_bytes=max(0, facts.cpu.ram_available_bytes - host_used))
    return replace(facts, gpus=tuple(new_gpus), cpu=cpu)


def _without_gpus(facts: HardwareFacts) -> HardwareFacts:
    return replace(facts, gpus=())


def _fits(plan_fn: PlanFn, catalog: Any, facts: HardwareFacts, settings: Any) -> Plan | None:
    """The plan for ``facts`` if its target fits wholly (a spilled chat model is too slow
    beside the completion pair to be worth its memory), else None."""
    try:
        plan = plan_fn(catalog, facts, replace(settings, spill=False))
    except PlanError:
        return None
    return plan if plan.fits_wholly else None


def _left(facts: HardwareFacts) -> str:
    gpus = ", ".join(f"{g.free_bytes / GiB:.1f} GiB on {g.name}" for g in facts.usable_gpus)
    ram = f"{facts.cpu.ram_available_bytes / GiB:.1f} GiB of RAM"
    return f"{gpus + ', ' if gpus else ''}{ram}"


def with_chat(
    catalog: Any, facts: HardwareFacts, settings: Any, plan: Plan, plan_fn: PlanFn
) -> Plan:
    """``plan`` with its chat side decided (``plan.chat``); possibly a different completion
    pair when one instruct model serves both (rule 3). ``plan_fn`` is ``make_plan``."""
    if not hasattr(catalog, "pair_can"):  # a list of candidates: no capabilities known
        return plan
    if settings.chat is None:  # a search for the chat side itself
        return plan
    if settings.chat == "off":
        return replace(plan, chat=ChatPlan("off", "Chat is off on this daemon (models.chat = off)"))
    target = catalog.models.get(plan.target[0])
    pinned = settings.chat_pair
    if (pinned is None or pinned == plan.pair_id) and target is not None and target.can("chat"):
        why = f"{plan.target[0]} is an instruct model that also does FIM: one pair serves both"
        return replace(plan, chat=ChatPlan("shared", why))
    chat_settings = replace(
        settings,
        needs=("chat",),
        chat=None,
        pair=pinned,
        allowed=(pinned,) if pinned else settings.chat_allowed,
        concurrent_sessions=None,
    )
    left = remaining(facts, plan)
    for where in (left, _without_gpus(left)) if left.usable_gpus else (left,):
        second = _fits(plan_fn, catalog, where, chat_settings)
        if second is not None:
            place = "in RAM" if where.usable_gpus == () and facts.usable_gpus else "beside it"
            why = (
                f"{plan.target[0]} is a completion (FIM) model; the instruct pair "
                f"{second.pair_id} fits {place} and answers chat"
            )
            return replace(plan, chat=ChatPlan("separate", why, second))
    if pinned is None and settings.pair is None:
        both = _fits(plan_fn, catalog, facts, replace(settings, needs=("fim", "chat"), chat=None))
        if both is not None:
            why = (
                f"no instruct pair fits beside {plan.target[0]} {plan.target[1]}; "
                f"{both.target[0]} {both.target[1]} does FIM and chat, so one pair serves both"
            )
            note = f"{both.pair_id} replaces {plan.pair_id}: it serves completion and chat"
            return replace(both, chat=ChatPlan("shared", why), notes=(*both.notes, note))
    what = f"the pair {pinned}" if pinned else "no instruct pair"
    why = (
        f"Chat is not served on this machine: {what} fits beside the completion model "
        f"{plan.target[0]} {plan.target[1]} ({_left(left)} left). Set models.chat_pair to a "
        "smaller instruct pair (`localspec models` lists them), models.pair to one that does "
        "both (qwen3-coder-30b-a3b+ngram), or free memory"
    )
    return replace(plan, chat=ChatPlan("off", why))
