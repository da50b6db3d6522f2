"""The plan's chat side (planning/chat.py), on the built-in machines and on edge cases: one
instruct pair for both, a second pair in the memory the completion pair leaves (counted
device by device), a switch to one model that does both, or no chat with a reason."""

from __future__ import annotations

import dataclasses
import json

import pytest

from localspec import settings as st
from localspec.catalog import Catalog, load_catalog
from localspec.hardware import HARDWARE_PROFILES, GiB, load_hardware_profile
from localspec.plan import (
    PlanError,
    PlanSettings,
    candidates_from_catalog,
    make_plan,
    render_plan,
)
from localspec.planning.chat import remaining
from localspec.settings_to import plan_inputs


@pytest.fixture(scope="module")
def catalog() -> Catalog:
    return load_catalog()


def test_an_instruct_model_that_does_fim_serves_both(catalog: Catalog) -> None:
    plan = make_plan(catalog, load_hardware_profile("cpu-32gb"))
    assert plan.target[0] == "qwen3-coder-30b-a3b"
    assert plan.chat is not None and plan.chat.mode == "shared" and plan.chat.plan is None
    assert "one pair serves both" in plan.chat.reason


@pytest.mark.parametrize("name", list(HARDWARE_PROFILES))
def test_a_second_pair_fits_in_what_the_first_leaves(name: str, catalog: Catalog) -> None:
    facts = load_hardware_profile(name)
    plan = make_plan(catalog, facts)
    assert plan.chat is not None
    if plan.chat.mode != "separate":
        return
    chat = plan.chat.plan
    assert chat is not None
    assert catalog.model(chat.target[0]).can("chat")
    assert chat.fits_wholly
    # device by device, both pairs together stay within what the machine offers (a chat pair
    # planned in RAM beside a GPU-resident completion pair has the host row only)
    first_rows = {r.device: r for r in plan.memory}
    for second in chat.memory:
        first = first_rows[second.device]
        assert first.used + second.used <= first.budget, (name, second.device)
        assert second.fits


def test_remaining_takes_each_devices_use_away(catalog: Catalog) -> None:
    facts = load_hardware_profile("rtx4090-24gb")
    plan = make_plan(catalog, facts)
    left = remaining(facts, plan)
    (gpu,) = left.gpus
    assert gpu.free_bytes == facts.gpus[0].free_bytes - plan.memory[0].used
    assert left.cpu.ram_available_bytes == (facts.cpu.ram_available_bytes - plan.memory[-1].used)
    unified = load_hardware_profile("apple-m2-16gb")
    plan = make_plan(catalog, unified)
    left = remaining(unified, plan)
    used = sum(r.used for r in plan.memory)  # one pool: both rows come out of RAM
    assert left.cpu.ram_available_bytes == unified.cpu.ram_available_bytes - used


# the Qwen2.5 family only: a FIM-only completion model fills the card (left free, the 3060
# takes Qwen3-Coder-30B-A3B spilled, which serves both)
QWEN25 = PlanSettings(allowed=("qwen2.5-coder-*",))


def test_the_chat_pair_goes_to_ram_when_the_gpu_is_full(catalog: Catalog) -> None:
    plan = make_plan(catalog, load_hardware_profile("rtx3060-12gb"), QWEN25)
    assert plan.chat is not None and plan.chat.mode == "separate"
    chat = plan.chat.plan
    assert chat is not None and chat.target_ngl == 0 and chat.draft_gpu is None
    assert "in RAM" in plan.chat.reason
    assert chat.expected_tps >= 1000 / PlanSettings().max_token_ms  # still within the bound


def test_no_room_means_no_chat_and_the_reason_names_the_settings(catalog: Catalog) -> None:
    plan = make_plan(catalog, load_hardware_profile("cpu-8gb"))
    assert plan.chat is not None and plan.chat.mode == "off"
    reason = plan.chat.reason
    assert "models.chat_pair" in reason and "models.pair" in reason
    assert plan.target[0] in reason and "GiB of RAM left" in reason


def test_one_model_for_both_replaces_the_completion_pair_when_nothing_fits_beside(
    catalog: Catalog,
) -> None:
    """A 24 GB card with little RAM: the 32B base fills the card and no instruct pair fits
    beside it, but Qwen3-Coder-30B-A3B alone fits the card and does both."""
    facts = load_hardware_profile("rtx4090-24gb")
    small_ram = dataclasses.replace(facts.cpu, ram_available_bytes=int(3 * GiB))
    facts = dataclasses.replace(facts, cpu=small_ram)
    plan = make_plan(catalog, facts)
    assert plan.target[0] == "qwen3-coder-30b-a3b"
    assert plan.chat is not None and plan.chat.mode == "shared"
    assert "no instruct pair fits beside qwen2.5-coder-32b" in plan.chat.reason
    assert any("replaces qwen2.5-coder-32b" in n for n in plan.notes)


def test_settings_turn_chat_off_or_pin_its_pair(catalog: Catalog) -> None:
    facts = load_hardware_profile("rtx3060-12gb")
    off = make_plan(catalog, facts, PlanSettings(chat="off"))
    assert (
        off.chat is not None and off.chat.mode == "off" and "models.chat = off" in off.chat.reason
    )
    pinned = make_plan(catalog, facts, PlanSettings(chat_pair="qwen2.5-coder-0.5b-instruct+ngram"))
    assert pinned.chat is not None and pinned.chat.plan is not None
    assert pinned.chat.plan.pair_id == "qwen2.5-coder-0.5b-instruct+ngram"
    too_big = make_plan(catalog, facts, PlanSettings(chat_pair="qwen2.5-coder-32b-instruct+0.5b"))
    assert too_big.chat is not None and too_big.chat.mode == "off"
    assert "the pair qwen2.5-coder-32b-instruct+0.5b" in too_big.chat.reason


def test_localspec_settings_reach_the_chat_side(catalog: Catalog) -> None:
    resolved = st.load(
        flags={"models.chat_pair": ("qwen2.5-coder-1.5b-instruct+ngram", "--chat-pair")},
        environ={},
    )
    ps = plan_inputs(resolved.settings)
    assert ps.chat == "auto" and ps.chat_pair == "qwen2.5-coder-1.5b-instruct+ngram"
    plan = make_plan(catalog, load_hardware_profile("rtx3060-12gb"), ps)
    assert plan.chat is not None and plan.chat.plan is not None
    assert plan.chat.plan.pair_id == "qwen2.5-coder-1.5b-instruct+ngram"
    # an instruct pair where the completion pair goes is refused with a pointer
    wrong = st.load(flags={"models.pair": ("qwen2.5-coder-7b-instruct+0.5b", "--pair")}, environ={})
    with pytest.raises(PlanError, match=r"models\.chat_pair"):
        make_plan(catalog, load_hardware_profile("rtx4090-24gb"), plan_inputs(wrong.settings))


def test_json_and_table_show_each_pairs_memory(catalog: Catalog) -> None:
    plan = make_plan(catalog, load_hardware_profile("rtx3060-12gb"), QWEN25)
    data = json.loads(json.dumps(plan.to_json()))
    chat = data["chat"]
    assert chat["mode"] == "separate" and chat["plan"]["pair_id"] == plan.chat.plan.pair_id
    assert {"used", "budget"} <= set(chat["plan"]["memory"][-1])
    table = render_plan(plan)
    assert "chat:     separate:" in table
    assert table.count("memory (GiB)") == 2
    assert f"  pair:     {plan.chat.plan.pair_id}" in table


def test_candidate_lists_plan_no_chat_side() -> None:
    """A plan from a ready list of candidates (no catalog: no capabilities) leaves chat
    undecided, as before."""
    catalog = load_catalog()
    candidates = candidates_from_catalog(catalog, PlanSettings())
    plan = make_plan(candidates, load_hardware_profile("cpu-32gb"))
    assert plan.chat is None
    assert all(catalog.model(c.target.model_id).can("fim") for c in candidates)
