"""The probe plans for the devices llama.cpp sees, adding the vendor tools' facts: captured
device lists of CUDA, Vulkan and CPU builds, and what the planner does with each."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from localspec.catalog import load_catalog
from localspec.engine.devices import GgmlDevice
from localspec.hardware import (
    BuildFacts,
    CpuFacts,
    GiB,
    HardwareFacts,
    MiB,
    launcher_choice,
    merge_devices,
    parse_nvidia_smi,
    probe,
)
from localspec.plan import PlanSettings, make_plan, render_plan
from localspec.planning.facts import model_facts_from_gguf
from localspec.planning.memory import model_usage, output_on_host
from localspec.planning.types import Layout

CPU = CpuFacts("AMD EPYC", 16, 32, 64 * GiB, 60 * GiB, bandwidth_gbps=80.0)
HOST = GgmlDevice("CPU", "AMD EPYC", "cpu", "CPU", 64 * GiB, 60 * GiB, "CPU")
NVIDIA_MIXED = """\
0, NVIDIA GeForce RTX 3060, 12288, 11805, 8.6
1, NVIDIA GeForce RTX 4090, 24564, 23957, 8.9
"""


def _dev(name: str, description: str, backend: str, total_mib: int, free_mib: int) -> GgmlDevice:
    return GgmlDevice(
        name, description, "gpu", backend, total_mib * MiB, free_mib * MiB, name
    )  # fmt: skip


def _facts(gpus: list, build_devices: tuple[str, ...], backends: tuple[str, ...]) -> HardwareFacts:
    return HardwareFacts(
        name="this machine",
        description="test",
        kind="personal",
        cpu=CPU,
        gpus=tuple(gpus),
        build=BuildFacts(True, "0.3.36", bool(build_devices), backends, "", build_devices),
    )


def test_a_cuda_build_plans_for_its_devices_with_nvidia_smis_compute_capability() -> None:
    # CUDA orders the faster card first; nvidia-smi lists by PCI bus: matched by name
    seen = [
        HOST,
        _dev("CUDA0", "NVIDIA GeForce RTX 4090", "CUDA", 24080, 23500),
        _dev("CUDA1", "NVIDIA GeForce RTX 3060", "CUDA", 11910, 11700),
    ]
    gpus, notes = merge_devices(seen, parse_nvidia_smi(NVIDIA_MIXED), CPU)
    assert notes == []
    assert [(g.llama_name, g.name, g.compute_capability) for g in gpus] == [
        ("CUDA0", "NVIDIA GeForce RTX 4090", "8.9"),
        ("CUDA1", "NVIDIA GeForce RTX 3060", "8.6"),
    ]
    assert [g.index for g in gpus] == [0, 1]  # llama.cpp's device order: main_gpu, split
    assert gpus[0].free_bytes == 23500 * MiB  # llama.cpp's own figure, not nvidia-smi's
    assert gpus[0].bandwidth_gbps == 1008 and not gpus[0].unified


def test_a_vulkan_card_no_vendor_tool_reports_is_planned_like_any_gpu() -> None:
    seen = [HOST, _dev("Vulkan0", "AMD Radeon RX 7900 XTX (RADV NAVI31)", "Vulkan", 24560, 24000)]
    gpus, notes = merge_devices(seen, [], CPU)
    (gpu,) = gpus
    assert (gpu.backend, gpu.llama_name, gpu.bandwidth_gbps) == ("vulkan", "Vulkan0", 960)
    assert not gpu.unified and notes == []
    facts = _facts(gpus, ("Vulkan0: AMD Radeon RX 7900 XTX",), ("Vulkan", "CPU"))
    plan = make_plan(load_catalog(), facts, PlanSettings())
    assert plan.target_ngl == plan.target_layers  # all layers on the card
    assert plan.memory[0].device.startswith("vulkan:0 AMD Radeon RX 7900 XTX")
    assert plan.memory[0].weights > 0 and plan.memory[-1].device.startswith("cpu")
    text = render_plan(plan)
    assert "build:    llama.cpp with Vulkan, CPU" in text
    assert "device:   Vulkan0: AMD Radeon RX 7900 XTX" in text
    assert facts.warnings == ()


def test_a_software_vulkan_device_is_host_memory_at_the_cpus_speed_and_can_play_a_card() -> None:
    lavapipe = _dev("Vulkan0", "llvmpipe (LLVM 15.0.6, 256 bits)", "Vulkan", 64 * 1024, 60 * 1024)
    gpus, notes = merge_devices([lavapipe, HOST], [], CPU)
    (gpu,) = gpus
    assert gpu.unified and gpu.bandwidth_gbps == CPU.bandwidth_gbps and gpu.tflops == CPU.tflops
    assert "software Vulkan device" in notes[0]
    facts = _facts(gpus, ("Vulkan0: llvmpipe",), ("Vulkan", "CPU"))
    plan = make_plan(load_catalog(), facts, PlanSettings(context=4096))
    assert plan.target_ngl == plan.target_layers
    assert plan.memory[0].device.startswith("vulkan:0 llvmpipe")
    assert plan.memory[-1].shared_with == plan.memory[0].used  # one pool: the host's RAM
    # limits.gpu_memory_gb plays an 8 GB card: the device's budget is the cap, less the margin
    as_card = make_plan(
        load_catalog(), facts, PlanSettings(context=4096, gpu_memory_cap_bytes=8 * 10**9)
    )
    assert as_card.memory[0].available == 8 * 10**9
    assert as_card.memory[0].used <= as_card.memory[0].budget


def test_a_cpu_build_keeps_the_vendor_list_and_says_how_to_rebuild() -> None:
    gpus, notes = merge_devices([HOST], parse_nvidia_smi(NVIDIA_MIXED), CPU)
    assert [g.llama_name for g in gpus] == [None, None] and notes == []
    facts = replace(_facts(gpus, (), ("CPU",)), build=BuildFacts(True, "0.3.36", False, ("CPU",)))
    assert facts.usable_gpus == ()
    assert any("-DGGML_CUDA=on" in w for w in facts.warnings)


def test_a_backend_localspec_does_not_plan_for_is_named() -> None:
    sycl = _dev("SYCL0", "Intel(R) Arc(TM) A770 Graphics", "SYCL", 16000, 15000)
    gpus, notes = merge_devices([sycl, HOST], [], CPU)
    assert gpus == [] and "SYCL0 (SYCL) is not planned for" in notes[0]


def test_probe_asks_llama_cpp_for_its_devices() -> None:
    seen = [HOST, _dev("Vulkan0", "llvmpipe (LLVM 15.0.6, 256 bits)", "Vulkan", 4096, 4000)]
    facts = probe(lambda argv: None, llama_devices=lambda: seen)
    (gpu,) = facts.gpus
    assert gpu.llama_name == "Vulkan0" and gpu.free_bytes == 4000 * MiB
    assert any("software Vulkan device" in n for n in facts.notes)
    assert "llvmpipe" in facts.description


def test_logits_past_the_devices_storage_range_are_computed_on_the_host(
    smollm_fim_f16: Path,
) -> None:
    """lavapipe's 128 MiB maxStorageBufferRange holds 512 rows of SmolLM2's 49k logits, not
    1024: llama.cpp then runs the output layer on the CPU (with a copy of its weights)."""
    m = model_facts_from_gguf(smollm_fim_f16)
    lavapipe = 128 * MiB

    def usage(n_ubatch: int) -> list:
        layout = Layout(1024, 1, "f16", n_ubatch, m.n_layer + 1, (1.0,), None, spec_n_max=0)
        return model_usage(m, layout, m.n_layer + 1, (1.0,), 2, [lavapipe])

    assert not output_on_host(m, 512, lavapipe) and output_on_host(m, 1024, lavapipe)
    assert not output_on_host(m, 1024, None)  # no such limit (CUDA, Metal)
    fits, spills = usage(512), usage(1024)
    assert fits[0].compute >= 4 * 512 * m.n_vocab  # the logits on the device
    assert spills[0].compute < 4 * 1024 * m.n_vocab <= spills[1].compute
    assert spills[1].compute >= 4 * 1024 * m.n_vocab + m.output_bytes
    assert spills[0].weights == fits[0].weights  # the weights stay where they were loaded


def test_the_launchers_recorded_choice_is_read_and_shown(tmp_path: Path) -> None:
    (tmp_path / ".localspec-backend").write_text(
        "backend=cpu\ncmake_args=-DLLAVA_BUILD=OFF\n"
        "fallback=the cuda build failed (see the compiler output above)\nwheelhouse=/w\n"
    )
    choice = launcher_choice(tmp_path)
    assert choice["backend"] == "cpu" and choice["fallback"].startswith("the cuda build failed")
    assert launcher_choice(tmp_path / "elsewhere") == {}
    facts = _facts([], (), ("CPU",))
    facts = replace(facts, build=replace(facts.build, chosen="cpu", fallback=choice["fallback"]))
    text = render_plan(make_plan(load_catalog(), facts, PlanSettings()))
    assert "build:    llama.cpp with CPU (the launcher chose cpu)" in text
    assert "fell back to the CPU: the cuda build failed" in text
