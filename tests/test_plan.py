"""The fit planner: table-driven over the built-in profiles and odd machines, every plan checked
by an independent recomputation of its memory, and the estimate checked against what
llama.cpp itself allocates for the fixture models."""

from __future__ import annotations

import ctypes
import json
import re
from dataclasses import replace
from pathlib import Path

import gguf
import llama_cpp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from llama_cpp import _logger

from localspec.catalog import Catalog, load_catalog
from localspec.engine.llama import model_params
from localspec.engine.types import ModelSettings
from localspec.hardware import (
    HARDWARE_PROFILES,
    BuildFacts,
    CpuFacts,
    GiB,
    GpuDevice,
    HardwareFacts,
    MiB,
    load_hardware_profile,
    lookup_device,
    with_gpu_free,
)
from localspec.plan import (
    GGML_TYPE_SIZES,
    Candidate,
    Device,
    Layout,
    ModelFacts,
    Plan,
    PlanError,
    PlanSettings,
    facts_from_catalog_entry,
    make_plan,
    measured_models,
    memory_table,
    model_facts_from_gguf,
    poisson_quantile,
    read_gguf_header,
    render_plan,
    smaller,
    speculative_speedup,
)
from localspec.planning.types import StepCosts, aux_sequences, context_cells
from localspec.settings import Settings
from localspec.settings_to import plan_engine_settings, plan_inputs

KV_BYTES = {"f16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}


@pytest.fixture(scope="module")
def catalog() -> Catalog:
    return load_catalog()


def _cpu(ram_gib: float, avail_gib: float, cores: int = 8, bw: float = 51) -> CpuFacts:
    return CpuFacts("test CPU", cores, cores * 2, int(ram_gib * GiB), int(avail_gib * GiB), (), bw)


def _odd_machines() -> dict[str, HardwareFacts]:
    rtx = load_hardware_profile("rtx4090-24gb")
    mixed = load_hardware_profile("rtx3060-12gb")
    mixed = replace(
        mixed,
        name="rtx3060+rtx4090",
        gpus=(mixed.gpus[0], replace(rtx.gpus[0], index=1)),
    )
    return {
        "no-gpu-4gb": HardwareFacts(
            "no-gpu-4gb", "no GPU, 4 GB RAM", "personal", _cpu(4, 3.2, cores=2),
            build=BuildFacts(installed=True, gpu_offload=False),
        ),
        "gpu-2gb-free-of-24": with_gpu_free(rtx, 0, 2 * GiB),
        "two-unequal-gpus": mixed,
        "cuda-card-cpu-build": replace(
            rtx, build=BuildFacts(installed=True, gpu_offload=False, backends=("CPU",))
        ),
    }  # fmt: skip


MACHINES: dict[str, HardwareFacts] = {
    **{name: load_hardware_profile(name) for name in HARDWARE_PROFILES},
    **_odd_machines(),
}


@pytest.fixture(scope="module")
def plans(catalog: Catalog) -> dict[str, Plan]:
    return {name: make_plan(catalog, facts) for name, facts in MACHINES.items()}


# ----------------------------------------------------------------- the independent recomputation


def _facts_for(catalog: Catalog, model_id: str, quant: str) -> ModelFacts:
    return facts_from_catalog_entry(catalog.models[model_id], quant)


def _placement(n_layer: int, ngl: int, split: tuple[float, ...]) -> list[int]:
    """Device of each block and the output layer (-1 = host), written from llama.cpp's rule."""
    first = n_layer + 1 - ngl  # the last ngl of the n_layer + 1 layers go to the GPUs
    act = n_layer + 1 - max(first, 0)
    bounds, acc = [], 0.0
    for s in split:
        acc += s / sum(split)
        bounds.append(acc)
    out = []
    for il in range(n_layer + 1):
        if not split or il < first:
            out.append(-1)
            continue
        frac = (il - max(first, 0)) / act
        out.append(next((i for i, b in enumerate(bounds) if frac < b), len(split) - 1))
    return out


def _model_bytes(
    m: ModelFacts, ngl: int, split: tuple[float, ...], plan: Plan, n_gpus: int
) -> dict[int, int]:
    """Bytes per device (-1 = host) that one model adds: weights, KV, compute buffers."""
    used: dict[int, int] = dict.fromkeys([*range(n_gpus), -1], 0)
    where = _placement(m.n_layer, ngl, split)
    # each slot's context, padded to 256, and 256 cells for each of two extra completions per
    # slot (within llama.cpp's 256 sequence ids, three of them each slot's)
    n_aux = min(2 * plan.n_slots, 256 - 3 * plan.n_slots)
    cells = -(-plan.n_ctx // 256) * 256 * plan.n_slots + n_aux * 256
    kv_layer = int(cells * m.n_head_kv * m.head_dim * 2 * KV_BYTES[plan.type_k])
    for il in range(m.n_layer):
        used[where[il]] += m.layer_bytes[il] + kv_layer
    out = where[m.n_layer]
    if out != -1 or not m.tied_embeddings:
        used[out] += m.output_bytes
    used[-1] += m.embd_bytes
    ub = plan.n_ubatch
    for dev in used:
        layers = dev in where[: m.n_layer]
        if layers or dev == out:
            logits = 4 * ub * (m.n_vocab + 2 * m.n_embd) if dev == out else 0
            # without flash attention: f32 KQ scores, one n_kv x ubatch block per head and one more
            scores = 0 if plan.flash_attn else 4 * ub * cells * (m.n_head + 1)
            ffn = 4 * ub * (3 * m.n_embd + 2 * m.n_ff) + scores if layers else 0
            used[dev] += max(logits, ffn, 8 * ub * m.n_embd)
    used[-1] += 4 * m.n_vocab * plan.n_slots * 17  # logits rows for a 16-token verify
    if -1 not in where:
        used[-1] += 8 * ub * m.n_embd
    return used


def recompute(catalog: Catalog, plan: Plan, facts: HardwareFacts) -> dict[str, tuple[int, int]]:
    """(used, budget) per device name, from the plan's own settings and the model sizes."""
    gpus = facts.usable_gpus
    target = _facts_for(catalog, *plan.target)
    split = plan.tensor_split or ((1.0,) if gpus else ())
    used = _model_bytes(target, plan.target_ngl, split, plan, len(gpus))
    if plan.draft is not None:
        draft = _facts_for(catalog, *plan.draft)
        names = [f"{g.backend}:{g.index} {g.name}" for g in gpus]
        dev = names.index(plan.draft_device) if plan.draft_device in names else -1
        one_hot = tuple(1.0 if i == dev else 0.0 for i in range(len(gpus))) if dev >= 0 else ()
        for d, b in _model_bytes(draft, plan.draft_ngl, one_hot, plan, len(gpus)).items():
            used[d] += b
    out: dict[str, tuple[int, int]] = {}
    unified_used = 0
    for i, g in enumerate(gpus):
        if g.unified:
            budget = max(0, min(g.free_bytes, facts.cpu.ram_available_bytes) - 2 * GiB)
            unified_used += used[i]
        else:
            budget = max(0, g.free_bytes - 1 * GiB)
        out[f"{g.backend}:{g.index} {g.name}"] = (used[i], budget)
    host_budget = max(0, facts.cpu.ram_available_bytes - 2 * GiB - unified_used)
    out[f"cpu ({facts.cpu.model})"] = (used[-1], host_budget)
    return out


# ----------------------------------------------------------------- table-driven properties


@pytest.mark.parametrize("name", list(MACHINES))
def test_every_plan_fits_its_budget_by_recomputation(
    name: str, plans: dict[str, Plan], catalog: Catalog
) -> None:
    plan, facts = plans[name], MACHINES[name]
    again = recompute(catalog, plan, facts)
    rows = {r.device: r for r in plan.memory}
    assert set(again) == set(rows)
    for device, (used, budget) in again.items():
        assert used <= budget, f"{device}: {used / GiB:.2f} GiB > {budget / GiB:.2f} GiB"
        assert abs(rows[device].used - used) <= 1024, device  # the plan reports what it uses
        assert rows[device].budget == budget


@pytest.mark.parametrize("name", list(MACHINES))
def test_context_never_below_4096_and_draft_always_counted(
    name: str, plans: dict[str, Plan]
) -> None:
    plan = plans[name]
    assert plan.n_ctx >= 4096 and plan.n_ctx % 256 == 0
    if plan.draft is not None:
        row = next(r for r in plan.memory if r.device == plan.draft_device)
        assert row.draft > 0
        assert plan.expected_spec_speedup is not None and plan.expected_spec_speedup > 1.0
    else:
        assert all(r.draft == 0 for r in plan.memory)


def _scaled(facts: HardwareFacts, k: float) -> HardwareFacts:
    gpus = tuple(
        replace(g, total_bytes=int(g.total_bytes * k), free_bytes=int(g.free_bytes * k))
        for g in facts.gpus
    )
    cpu = replace(
        facts.cpu,
        ram_total_bytes=int(facts.cpu.ram_total_bytes * k),
        ram_available_bytes=int(facts.cpu.ram_available_bytes * k),
    )
    return replace(facts, gpus=gpus, cpu=cpu)


def _target_size(catalog: Catalog, facts: HardwareFacts) -> float:
    try:
        plan = make_plan(catalog, facts)
    except PlanError:
        return 0.0
    return catalog.models[plan.target[0]].params_b


@pytest.mark.parametrize("name", list(MACHINES))
def test_more_memory_never_gives_a_smaller_target(name: str, catalog: Catalog) -> None:
    sizes = [_target_size(catalog, _scaled(MACHINES[name], k)) for k in (0.5, 1, 1.5, 2, 4)]
    assert sizes == sorted(sizes), sizes


def _fits_wholly_at_its_most_frugal(catalog: Catalog, model_id: str, facts: HardwareFacts) -> bool:
    """Smallest quant, no draft, one slot, 4096 tokens, quantized KV, ubatch 512."""
    entry = catalog.models[model_id]
    quant = entry.quant_ladder()[0]
    m = _facts_for(catalog, model_id, quant)
    kv = "q8_0" if m.head_dim % 32 == 0 else "f16"
    gpus = facts.usable_gpus
    devices = [
        Device(g.name, "unified" if g.unified else "gpu", g.free_bytes,
               2 * GiB if g.unified else GiB, g.bandwidth_gbps, g.tflops)
        for g in gpus
    ] + [Device("host", "host", facts.cpu.ram_available_bytes, 2 * GiB, 50, 1)]  # fmt: skip
    shares = [max(d.budget, 1) for d in devices[:-1]]
    split = tuple(s / sum(shares) for s in shares)
    layout = Layout(4096, 1, kv, 512, m.n_layer + 1 if gpus else 0, split, None)
    return all(r.fits for r in memory_table(m, None, layout, devices))


@pytest.mark.parametrize("name", list(MACHINES))
def test_chosen_target_is_the_largest_within_the_speed_bound(
    name: str, plans: dict[str, Plan], catalog: Catalog
) -> None:
    plan, facts = plans[name], MACHINES[name]
    chosen = catalog.models[plan.target[0]].params_b
    # the completion pair is chosen among FIM models (instruct-only ones serve chat)
    bigger = {m.id for m in catalog.targets() if m.params_b > chosen and m.can("fim")}
    for model_id in bigger:
        reasons = [r.reason for r in plan.rejected if r.candidate.startswith(model_id + " ")]
        assert reasons, f"{model_id} is bigger than the choice but was never considered"
        if _fits_wholly_at_its_most_frugal(catalog, model_id, facts):
            # It fits (alone); then the plan must have refused it for speed, sessions or
            # latency, not for memory.
            assert any(re.search(r"tok/s|sessions|ms/token|would not pay", r) for r in reasons)
    if not plan.fits_wholly:
        # spilled: within the speed bound, and bigger than any target that fits wholly;
        # or no target is fast enough at all, and it is the smallest
        smallest = min(m.params_b for m in catalog.targets() if m.can("fim"))
        if plan.expected_tps >= 1000 / PlanSettings().max_token_ms:
            assert all(m.params_b <= chosen or not _fits_wholly_at_its_most_frugal(
                catalog, m.id, facts) for m in catalog.targets() if m.can("fim"))  # fmt: skip
        else:
            assert chosen == smallest and any("no target is fast enough" in n for n in plan.notes)


# ----------------------------------------------------------------- specific rules


def test_unequal_gpus_split_by_room_and_draft_on_the_fastest(plans: dict[str, Plan]) -> None:
    plan = plans["two-unequal-gpus"]
    assert plan.tensor_split is not None and len(plan.tensor_split) == 2
    assert plan.tensor_split[1] > plan.tensor_split[0]  # the 4090 has twice the room
    assert plan.draft is not None and plan.draft_device is not None
    assert "4090" in plan.draft_device and plan.draft_gpu == 1
    assert plan.fits_wholly


def test_cuda_card_with_cpu_build_plans_for_the_cpu_and_says_how_to_rebuild(
    plans: dict[str, Plan],
) -> None:
    plan = plans["cuda-card-cpu-build"]
    assert [r.device.split()[0] for r in plan.memory] == ["cpu"]
    assert plan.target_ngl == 0
    assert any('CMAKE_ARGS="-DGGML_CUDA=on"' in w for w in plan.warnings)
    assert "-DGGML_CUDA=on" in render_plan(plan)


def _without_gpus(facts: HardwareFacts) -> HardwareFacts:
    return replace(facts, gpus=(), build=BuildFacts(installed=True, gpu_offload=False))


def test_a_busy_gpu_never_gives_a_smaller_target_than_none(
    plans: dict[str, Plan], catalog: Catalog
) -> None:
    """2 GiB free on the card: the target the machine would run from RAM alone, with the
    layers that fit on the GPU (a small model wholly on the card was the old rule: more
    hardware gave a worse model)."""
    facts = MACHINES["gpu-2gb-free-of-24"]
    plan, cpu_only = plans["gpu-2gb-free-of-24"], make_plan(catalog, _without_gpus(facts))
    size = catalog.models[plan.target[0]].params_b
    assert size >= catalog.models[cpu_only.target[0]].params_b > 3
    assert not plan.fits_wholly and 0 < plan.target_ngl < plan.target_layers
    assert plan.expected_tps >= cpu_only.expected_tps
    gpu = plan.memory[0]
    assert gpu.budget == 1 * GiB and gpu.used <= gpu.budget
    assert any("does not fit wholly on the accelerator" in n for n in plan.notes)
    assert "layers on the GPU, the rest in RAM" in render_plan(plan)


@pytest.mark.parametrize(
    "name", [n for n, f in MACHINES.items() if f.usable_gpus and f.kind == "personal"]
)
def test_a_gpu_never_gives_a_smaller_target_than_the_same_machine_without_it(
    name: str, plans: dict[str, Plan], catalog: Catalog
) -> None:
    cpu_only = _target_size(catalog, _without_gpus(MACHINES[name]))
    assert catalog.models[plans[name].target[0]].params_b >= cpu_only


@pytest.mark.parametrize("cap_gib", [0.5, 1.0])
def test_a_gpu_cap_at_or_below_the_margin_plans_as_the_cpu_would(
    cap_gib: float, catalog: Catalog
) -> None:
    """A cap that leaves the GPU no room (its 1 GiB margin) leaves the layers in RAM: the
    CPU plan's target, not the smallest model."""
    facts = load_hardware_profile("rtx4090-24gb")
    capped = make_plan(catalog, facts, PlanSettings(gpu_memory_cap_bytes=int(cap_gib * GiB)))
    cpu_only = make_plan(catalog, _without_gpus(facts))
    assert capped.target == cpu_only.target and capped.target_ngl == 0
    assert capped.memory[0].used <= capped.memory[0].budget == 0


def test_tiny_cpu_machine_still_gets_a_plan_or_a_clear_error(catalog: Catalog) -> None:
    facts = MACHINES["no-gpu-4gb"]
    plan = make_plan(catalog, facts)
    assert plan.target[0] == "qwen2.5-coder-0.5b"
    tiny = replace(facts, cpu=_cpu(2, 2.1))
    with pytest.raises(PlanError, match=r"no catalog model fits.*GiB of RAM usable"):
        make_plan(catalog, tiny)


def test_apple_unified_memory_shares_one_pool(plans: dict[str, Plan]) -> None:
    plan = plans["apple-m2-16gb"]
    metal, host = plan.memory
    assert metal.device.startswith("metal")
    assert host.shared_with == metal.used
    assert host.budget == 11 * GiB - 2 * GiB - metal.used
    assert metal.budget == 16 * GiB * 2 // 3 - 2 * GiB


def test_kv_quantized_and_context_shrunk_before_spilling(catalog: Catalog) -> None:
    plan = make_plan(
        catalog, MACHINES["rtx3060-12gb"], PlanSettings(allowed=("qwen2.5-coder-14b*",))
    )
    assert plan.fits_wholly
    assert plan.type_k == "q8_0" and plan.flash_attn
    assert any("q8_0" in n for n in plan.notes)


def test_cpu_plans_turn_flash_attention_off_and_count_the_score_matrix(
    catalog: Catalog,
) -> None:
    """On the CPU llama.cpp's KQ matmul verifies drafts faster than its flash attention; the
    score matrix it needs must be in the memory table, or a tight machine over-commits."""
    for name in ("cpu-32gb", "cuda-card-cpu-build"):
        plan = make_plan(catalog, MACHINES[name])
        assert plan.type_k == "f16" and not plan.flash_attn, name
        assert "flash attention off" in render_plan(plan)
        assert plan_engine_settings(plan, "t.gguf", "d.gguf").target.flash_attn is False
        host = plan.memory[-1]
        target = _facts_for(catalog, *plan.target)
        layout = Layout(plan.n_ctx, plan.n_slots, "f16", plan.n_ubatch, 0, (), None)
        cpu = [Device("cpu", "host", 64 * GiB, 0, 50, 1)]
        (fa_on,) = memory_table(target, None, layout, cpu)
        (fa_off,) = memory_table(target, None, replace(layout, flash_attn=False), cpu)
        assert fa_off.compute > fa_on.compute
        assert host.compute >= fa_off.compute
    for name in ("rtx4090-24gb", "rtx3060-12gb"):
        assert make_plan(catalog, MACHINES[name]).flash_attn
    # 8 GB: the score matrix does not fit beside 1.5B Q6_K and its draft at 16k f16; the
    # plan keeps the quant and the context and turns flash attention back on
    tight = make_plan(catalog, MACHINES["cpu-8gb"])
    assert tight.target == ("qwen2.5-coder-1.5b", "Q6_K") and tight.type_k == "f16"
    assert tight.flash_attn and tight.n_ctx == 16384


def _fake(
    model_id: str, quant: str, params: float, layer_mib: int, n_layer: int = 28
) -> ModelFacts:
    return ModelFacts(
        model_id, quant, params, n_layer, 3584, 28, 4, 128, 152064, 32768, 18944,
        (layer_mib * MiB,) * n_layer, 300 * MiB, 300 * MiB, False,
    )  # fmt: skip


def test_a_smaller_quant_that_fits_beats_a_bigger_one_that_spills() -> None:
    facts = with_gpu_free(load_hardware_profile("rtx4090-24gb"), 0, 8 * GiB)
    big = Candidate("m+ngram", _fake("m", "Q8_0", 7.6, 270), None)  # ~8 GiB: spills
    small = Candidate("m+ngram", _fake("m", "Q4_K_M", 7.6, 150), None)  # ~4.4 GiB: fits
    plan = make_plan([big, small], facts)
    assert plan.target == ("m", "Q4_K_M") and plan.fits_wholly


def test_spilling_when_nothing_fits_wholly() -> None:
    facts = with_gpu_free(load_hardware_profile("rtx4090-24gb"), 0, 4 * GiB)
    model = _fake("m", "Q8_0", 7.6, 270)
    plan = make_plan([Candidate("m+ngram", model, None)], facts)
    assert not plan.fits_wholly and "layers on the GPU" in render_plan(plan)
    assert 0 < plan.target_ngl < plan.target_layers
    assert plan.type_k == "q8_0"  # KV quantized before layers spill
    gpu = plan.memory[0]
    assert gpu.used <= gpu.budget
    devices = [
        Device("gpu", "gpu", 4 * GiB, GiB, 1008, 165),
        Device("host", "host", facts.cpu.ram_available_bytes, 2 * GiB, 90, 1),
    ]
    for ngl, ctx, fits in ((plan.target_ngl + 1, 4096, False), (plan.target_ngl, 4096, True)):
        layout = Layout(ctx, 1, "q8_0", plan.n_ubatch, ngl, (1.0,), None)
        assert memory_table(model, None, layout, devices)[0].fits is fits


def test_gpu_memory_cap(catalog: Catalog) -> None:
    facts = load_hardware_profile("rtx4090-24gb")
    plan = make_plan(catalog, facts, PlanSettings(gpu_memory_cap_bytes=8 * GiB))
    assert plan.memory[0].budget == 7 * GiB and plan.memory[0].used <= 7 * GiB
    uncapped = make_plan(catalog, facts)
    assert plan.memory[0].used < uncapped.memory[0].used


def test_preferred_pair_and_allowed_patterns(catalog: Catalog) -> None:
    facts = load_hardware_profile("rtx4090-24gb")
    plan = make_plan(catalog, facts, PlanSettings(pair="qwen2.5-coder-7b+0.5b"))
    assert plan.pair_id == "qwen2.5-coder-7b+0.5b" and plan.draft is not None
    plan = make_plan(catalog, facts, PlanSettings(allowed=("qwen2.5-coder-3b*",)))
    assert plan.target[0] == "qwen2.5-coder-3b"
    with pytest.raises(PlanError, match="allow at least one pair"):
        make_plan(catalog, facts, PlanSettings(allowed=("llama-*",)))
    with pytest.raises(PlanError, match="not in the catalog"):
        make_plan(catalog, facts, PlanSettings(pair="nope+0.5b"))
    # `--pair` narrows models.allowed to the pair (settings_to.plan_inputs): a typo is named
    typo = "qwen2.5-coder-7b+0.5"
    with pytest.raises(PlanError, match=r"did you mean 'qwen2.5-coder-7b\+0.5b'\?"):
        make_plan(catalog, facts, PlanSettings(pair=typo, allowed=(typo,)))


def test_context_below_4096_only_when_asked(catalog: Catalog) -> None:
    plan = make_plan(catalog, load_hardware_profile("cpu-8gb"), PlanSettings(context=2048))
    assert plan.n_ctx == 2048


def test_seed_scenario_500_sessions_on_2xh100(catalog: Catalog) -> None:
    facts = load_hardware_profile("2xh100-80gb")
    plan = make_plan(catalog, facts, PlanSettings(concurrent_sessions=500))
    cap = plan.capacity
    assert cap is not None
    assert plan.concurrent_sessions == cap.sessions_held >= 500
    assert cap.step_ms_at_full_batch <= 50
    assert plan.n_slots == min(cap.slots_by_memory, cap.slots_by_latency)
    assert cap.busy_slots_p95 <= plan.n_slots
    assert poisson_quantile(cap.sessions_held * cap.duty_cycle, 0.95) <= plan.n_slots
    text = render_plan(plan)
    assert "concurrent sessions" in text and "at p95 (Poisson)" in text
    assert plan.tensor_split is not None


def test_datacenter_asks_for_more_sessions_than_any_plan_holds(catalog: Catalog) -> None:
    facts = load_hardware_profile("a100-40gb")
    plan = make_plan(catalog, facts, PlanSettings(concurrent_sessions=100_000))
    assert plan.capacity is not None and plan.capacity.sessions_held < 100_000
    assert any("100000" in w for w in plan.warnings)


def test_speedup_formula() -> None:
    alpha, c = 0.7, 0.12
    s4 = (1 - alpha**5) / ((1 - alpha) * (4 * c + 1))
    best, _ = speculative_speedup(alpha, c, 16)
    assert best >= s4 > 1.8
    assert speculative_speedup(0.7, 2.0, 16) == (1.0, 0)  # a draft slower than the target


def test_poisson_quantile() -> None:
    assert poisson_quantile(0, 0.95) == 0
    assert 93 <= poisson_quantile(80, 0.95) <= 96  # 80 + 1.645 * sqrt(80) ≈ 94.7


# ----------------------------------------------------------------- output


def test_json_engine_settings_and_table(plans: dict[str, Plan], tmp_path: Path) -> None:
    plan = plans["rtx4090-24gb"]
    data = json.loads(json.dumps(plan.to_json()))
    assert data["target"] == list(plan.target) and data["memory"][0]["used"] > 0
    assert data["concurrent_sessions"] == plan.n_slots
    assert plan.draft is not None
    settings = plan_engine_settings(plan, tmp_path / "t.gguf", tmp_path / "d.gguf")
    assert settings.target.n_gpu_layers == plan.target_ngl
    assert settings.target.n_ctx == plan.n_ctx and settings.n_slots == plan.n_slots
    assert settings.target.type_k == plan.type_k and settings.target.flash_attn is True
    assert settings.draft is not None and settings.draft.n_gpu_layers == plan.draft_ngl
    with pytest.raises(PlanError, match="draft"):
        plan_engine_settings(plan, tmp_path / "t.gguf")
    text = render_plan(plan)
    for heading in ("pair:", "memory (GiB)", "weights", "KV", "compute", "draft", "margin",
                    "decode ceiling", "speculative"):  # fmt: skip
        assert heading in text
    assert "rejected" in render_plan(plans["rtx3060-12gb"])


# ----------------------------------------------------------------- against llama.cpp itself

_BUFFER = re.compile(r"(\w+)\s+(model|KV|compute|output) buffer size =\s+([\d.]+) MiB")


def _llama_cpp_buffers(
    path: Path, n_ctx: int, n_slots: int, type_kv: str, n_ubatch: int, flash_attn: bool
) -> dict[str, float]:
    """Load with llama.cpp on the CPU and read the buffer sizes it logs (bytes)."""
    lines: list[str] = []

    @llama_cpp.llama_log_callback
    def capture(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        lines.append(text.decode("utf-8", "replace"))

    # the engine's own load parameters (before the capture: they may set up the backend's log)
    mparams = model_params(ModelSettings(str(path)))
    llama_cpp.llama_log_set(capture, ctypes.c_void_p(0))
    try:
        model = llama_cpp.llama_model_load_from_file(str(path).encode(), mparams)
        assert model, f"llama.cpp could not load {path}"
        cparams = llama_cpp.llama_context_default_params()
        n_aux = aux_sequences(n_slots)  # the engine's context: the slots', extra completions'
        cparams.n_ctx = context_cells(n_ctx, n_slots, n_aux)
        cparams.n_seq_max = 3 * n_slots + n_aux
        cparams.n_batch = cparams.n_ubatch = n_ubatch
        cparams.n_threads = cparams.n_threads_batch = 1
        cparams.kv_unified = True  # as the engine creates its contexts
        cparams.flash_attn_type = (
            llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
            if flash_attn
            else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        )
        cparams.type_k = cparams.type_v = {"f16": 1, "q8_0": 8}[type_kv]
        ctx = llama_cpp.llama_init_from_model(model, cparams)
        assert ctx, "llama.cpp could not create the context"
        llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(model)
    finally:
        llama_cpp.llama_log_set(_logger.llama_log_callback, ctypes.c_void_p(0))
    sizes: dict[str, float] = {}
    for line in lines:
        match = _BUFFER.search(line)
        if match:
            kind = "compute" if match.group(2) == "output" else match.group(2)
            sizes[kind] = sizes.get(kind, 0.0) + float(match.group(3)) * MiB
    return sizes


@pytest.mark.parametrize(
    ("fixture", "n_ctx", "n_slots", "type_kv", "n_ubatch", "flash_attn"),
    [
        ("qwen_target", 4096, 1, "f16", 512, True),
        ("qwen_target_152064", 2048, 2, "f16", 1024, True),
        ("smollm_q4", 4096, 1, "f16", 512, True),
        ("smollm_q4", 2048, 3, "q8_0", 256, True),
        ("smollm_f16", 8192, 1, "q8_0", 1024, True),
        # without flash attention the KQ scores outgrow the logits as the context grows
        ("smollm_q4", 8192, 1, "f16", 1024, False),
        ("smollm_q4", 4096, 2, "f16", 1024, False),
        ("smollm_q4", 16384, 1, "f16", 512, False),
        ("smollm_q4", 2048, 3, "f16", 256, False),
        ("qwen_target", 8192, 1, "f16", 1024, False),
    ],
)
def test_estimate_within_10_percent_of_llama_cpp(
    fixture: str, n_ctx: int, n_slots: int, type_kv: str, n_ubatch: int, flash_attn: bool,
    request: pytest.FixtureRequest,
) -> None:  # fmt: skip
    path: Path = request.getfixturevalue(fixture)
    facts = model_facts_from_gguf(path)
    real = _llama_cpp_buffers(path, n_ctx, n_slots, type_kv, n_ubatch, flash_attn)
    layout = Layout(
        n_ctx, n_slots, type_kv, n_ubatch, 0, (), None, spec_n_max=0, flash_attn=flash_attn
    )
    host = Device("cpu", "host", 64 * GiB, 0, 50, 1)
    (row,) = memory_table(facts, None, layout, [host])
    for kind, estimate in (("model", row.weights), ("KV", row.kv), ("compute", row.compute)):
        assert real[kind] > 0
        assert abs(estimate - real[kind]) <= 0.10 * real[kind], (
            f"{kind}: estimated {estimate / MiB:.2f} MiB, llama.cpp {real[kind] / MiB:.2f} MiB"
        )


def test_gguf_header_reader_agrees_with_the_gguf_package(tmp_path: Path) -> None:
    """Our header reader skips arrays instead of decoding them; check it against GGUFReader."""
    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_uint32("llama.embedding_length", 64)
    writer.add_token_list([f"tok{i}" for i in range(1000)])
    writer.add_array("test.nested", [[1, 2], [3, 4, 5]])
    writer.add_array("test.floats", [0.5, 1.5])
    rng = np.random.default_rng(0)
    data = rng.standard_normal((64, 96)).astype(np.float32)
    writer.add_tensor("blk.0.ffn_up.weight", data)
    writer.add_tensor("blk.0.attn_norm.weight", data[0].astype(np.float16))
    q8 = gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("output.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ours = read_gguf_header(path)
    theirs = gguf.GGUFReader(str(path))
    assert ours.metadata["tokenizer.ggml.tokens"] == 1000
    assert ours.metadata["test.nested"] == 2 and ours.metadata["llama.embedding_length"] == 64
    assert ours.metadata["general.architecture"] == "llama"
    assert [(n, t, e) for n, t, e in ours.tensors] == [
        (t.name, int(t.tensor_type), int(t.n_elements)) for t in theirs.tensors
    ]
    for (name, ggml_type, n), t in zip(ours.tensors, theirs.tensors, strict=True):
        assert ours.tensor_bytes(name, ggml_type, n) == int(t.n_bytes)
    for type_id, sizes in GGML_TYPE_SIZES.items():
        assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(type_id)] == sizes
    with pytest.raises(PlanError, match="not a GGUF"):
        read_gguf_header(Path(__file__))


def test_gguf_tensor_table(qwen_target: Path, qwen_target_152064: Path) -> None:
    tied = model_facts_from_gguf(qwen_target, model_id="t", quant="F32")
    assert tied.tied_embeddings and tied.n_vocab == 151936
    assert len(tied.layer_bytes) == tied.n_layer and all(b > 0 for b in tied.layer_bytes)
    assert tied.output_bytes >= tied.embd_bytes  # the output layer is token_embd's copy
    assert tied.source.startswith("GGUF tensor table")
    untied = model_facts_from_gguf(qwen_target_152064)
    assert not untied.tied_embeddings and untied.n_vocab == 152064
    assert untied.file_bytes <= Path(qwen_target_152064).stat().st_size
    assert untied.file_bytes > Path(qwen_target_152064).stat().st_size - 8 * MiB  # the header


def test_measured_facts_replace_catalog_estimates(catalog: Catalog, smollm_q4: Path) -> None:
    measured = model_facts_from_gguf(smollm_q4, model_id="qwen2.5-coder-0.5b", quant="Q8_0")
    settings = PlanSettings(allowed=("qwen2.5-coder-0.5b+ngram",),
                            measured={("qwen2.5-coder-0.5b", "Q8_0"): measured})  # fmt: skip
    plan = make_plan(catalog, load_hardware_profile("cpu-8gb"), settings)
    assert plan.target_source.startswith("GGUF tensor table")
    assert plan.memory[0].weights == measured.file_bytes


# ----------------------------------------------------------------- wiring for `up` and the CLI


def _settings(**sections: dict[str, object]) -> Settings:
    return Settings.model_validate(sections)


def _asked(**sections: dict[str, object]) -> PlanSettings:
    return plan_inputs(_settings(**sections))


def test_plan_from_localspec_settings(catalog: Catalog) -> None:
    settings = _asked(
        models={"pair": "qwen2.5-coder-7b+0.5b"},
        limits={"context": 8192, "gpu_memory_gb": 20},
        server={"slots": 2},
        speculative={"n_max": 8},
        cache={"reuse_chunk": 128, "exact_ms": 40},
    )
    facts = load_hardware_profile("rtx4090-24gb")
    plan = make_plan(catalog, facts, settings)
    assert plan.pair_id == "qwen2.5-coder-7b+0.5b"  # a pinned pair is the only one tried
    assert plan.n_ctx == 8192 and plan.n_slots == 2
    assert plan.memory[0].budget == int(20e9) - GiB
    engine = plan_engine_settings(plan, "t.gguf", "d.gguf")
    assert engine.spec.n_max == 8 and engine.cache_reuse == 128 and engine.n_slots == 2
    assert engine.exact_ms == 40
    plan = make_plan(catalog, facts, _asked(speculative={"mode": "ngram"}))
    assert plan.draft is None and plan_engine_settings(plan, "t.gguf").spec.mode == "ngram"
    pinned_elsewhere = _settings(
        models={"allowed": ["qwen2.5-coder-3b*"], "pair": "qwen2.5-coder-7b+0.5b"}
    )
    with pytest.raises(PlanError, match=r"models.pair .* is not in models.allowed"):
        plan_inputs(pinned_elsewhere)
    asked = plan_inputs(_settings(), concurrent_sessions=500)
    plan = make_plan(catalog, load_hardware_profile("a100-40gb"), asked)
    assert plan.capacity is not None and plan.capacity.sessions_requested == 500
    assert plan.concurrent_sessions >= 500


def test_smaller_plans_for_a_failed_load(plans: dict[str, Plan]) -> None:
    plan = plans["rtx4090-24gb"]
    steps = []
    current: Plan | None = plan
    while current is not None:
        steps.append(current)
        current = smaller(current)
    contexts = [p.n_ctx for p in steps]
    layers = [p.target_ngl for p in steps]
    assert contexts[0] == plan.n_ctx and min(contexts) == 4096
    assert contexts == sorted(contexts, reverse=True) and layers == sorted(layers, reverse=True)
    assert layers[-1] == 0 and "ran out of memory" in steps[-1].notes[-1]


def test_measured_models_reads_local_files(catalog: Catalog, qwen_target: Path) -> None:
    def locate(model_id: str, quant: str) -> Path | None:
        return qwen_target if (model_id, quant) == ("qwen2.5-coder-0.5b", "Q8_0") else None

    measured = measured_models(catalog, locate)
    assert list(measured) == [("qwen2.5-coder-0.5b", "Q8_0")]
    facts = measured[("qwen2.5-coder-0.5b", "Q8_0")]
    assert facts.params_b == catalog.models["qwen2.5-coder-0.5b"].params_b
    assert facts.n_layer == 2 and facts.source.startswith("GGUF")


# ----------------------------------------------------------------- random machines

_GPU_NAMES = ("NVIDIA GeForce RTX 3060", "NVIDIA GeForce RTX 4090", "NVIDIA H100 80GB HBM3",
              "NVIDIA A100-SXM4-40GB", "Tesla T4")  # fmt: skip


@st.composite
def _machines(draw: st.DrawFn) -> HardwareFacts:
    ram = draw(st.floats(2, 512))
    cpu = _cpu(ram, draw(st.floats(0.3, 0.95)) * ram, cores=draw(st.integers(1, 64)),
               bw=draw(st.sampled_from([25.0, 51.0, 90.0, 300.0])))  # fmt: skip
    gpus = []
    for i in range(draw(st.integers(0, 3))):
        name = draw(st.sampled_from(_GPU_NAMES))
        spec = lookup_device(name)
        assert spec is not None
        total = int(draw(st.floats(2, 96)) * GiB)
        free = int(total * draw(st.floats(0.05, 1.0)))
        gpus.append(GpuDevice(i, name, "cuda", total, free, spec.bandwidth_gbps, spec.tflops))
    kind = draw(st.sampled_from(["personal", "datacenter"]))
    return HardwareFacts("random", "random machine", kind, cpu, tuple(gpus),  # type: ignore[arg-type]
                         BuildFacts(installed=True, gpu_offload=bool(gpus)))  # fmt: skip


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(facts=_machines())
def test_random_machines_get_a_plan_that_fits_or_a_clear_error(facts: HardwareFacts) -> None:
    catalog = load_catalog()
    try:
        plan = make_plan(catalog, facts)
    except PlanError as exc:
        assert "no catalog model fits" in str(exc)
        return
    for device, (used, budget) in recompute(catalog, plan, facts).items():
        assert used <= budget, device
    assert plan.n_ctx >= 4096


def test_measured_step_times_replace_the_bandwidth_model(catalog: Catalog) -> None:
    """A step cost measured on the machine decides the slots the latency bound allows, and the
    plan says so; without one it says its figures are assumed."""
    facts = load_hardware_profile("h100-80gb")
    assumed = make_plan(catalog, facts, PlanSettings(concurrent_sessions=100))
    cap = assumed.capacity
    assert cap is not None and not cap.step_measured and "assumed" in cap.explanation
    model = assumed.target[0]
    # measured: 10 ms a step for one slot, 30 ms more per slot: 2 slots fit 50 ms, 3 do not
    slow = StepCosts({1: 10.0, 2: 40.0, 4: 100.0}, 4096, "a test, 2026-12-01")
    every_quant = {(model, q): slow for q in catalog.model(model).quants}
    measured = make_plan(
        catalog, facts, PlanSettings(concurrent_sessions=100, allowed=(assumed.pair_id,)),
        step_costs=every_quant,
    )  # fmt: skip
    cap = measured.capacity
    assert cap is not None and cap.step_measured and cap.slots_by_latency == 2
    assert "measured: a test" in cap.explanation and cap.step_ms_at_full_batch == 40.0


def test_step_costs_interpolate_and_keep_per_machine(tmp_path: Path) -> None:
    from localspec import step_costs

    costs = StepCosts({1: 10.0, 4: 16.0, 8: 30.0}, 1024, "here")
    assert costs.step_ms(1) == 10.0 and costs.step_ms(2) == 12.0 and costs.step_ms(16) == 58.0
    assert StepCosts({2: 10.0}, 1, "one").step_ms(4) == 20.0
    path = tmp_path / "costs.json"
    step_costs.save("m", "Q8_0", costs, machine="box A", path=path)
    step_costs.save("m", "Q8_0", StepCosts({1: 99.0}, 1, "other"), machine="box B", path=path)
    assert step_costs.load("box A", path) == {("m", "Q8_0"): costs}
    assert step_costs.load("box C", path) == {}
    path.write_text("not json")
    assert step_costs.load("box A", path) == {}
