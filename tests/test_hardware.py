"""Hardware probes: parsers fed with captured tool output, profiles, the llama.cpp build check."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from localspec.hardware import (
    HARDWARE_PROFILES,
    BuildFacts,
    GiB,
    GpuDevice,
    HardwareError,
    MiB,
    apple_gpu,
    apple_working_set,
    build_warnings,
    load_hardware_profile,
    lookup_device,
    parse_cpuinfo,
    parse_nvidia_smi,
    parse_rocm_smi,
    parse_sysctl,
    parse_system_info,
    probe,
    probe_nvidia,
)

# `nvidia-smi --query-gpu=index,name,memory.total,memory.free,compute_cap
#  --format=csv,noheader,nounits` on a DGX-style node and on a mixed workstation.
NVIDIA_2XH100 = """\
0, NVIDIA H100 80GB HBM3, 81559, 81004, 9.0
1, NVIDIA H100 80GB HBM3, 81559, 2310, 9.0
"""
NVIDIA_MIXED = """\
0, NVIDIA GeForce RTX 3060, 12288, 11805, 8.6
1, NVIDIA GeForce RTX 4090, 24564, 23957, 8.9
"""
# Older drivers reject compute_cap; MIG or permission-limited boards print [N/A].
NVIDIA_OLD_DRIVER = "0, Tesla T4, 15360, 15101\n"
NVIDIA_NA = "0, NVIDIA A100-SXM4-40GB, 40960, [N/A], 8.0\n"
NVIDIA_BAD_FIELD = 'Field "compute_cap" is not a valid field to query.\n\n'

# `rocm-smi --showproductname --showmeminfo vram --json` (ROCm 5.7 on an MI250X node; ROCm 6
# on a Radeon workstation spells the series key with a capital S).
ROCM_MI250 = json.dumps(
    {
        "card0": {
            "VRAM Total Memory (B)": "68702699520",
            "VRAM Total Used Memory (B)": "11452416",
            "Card series": "AMD INSTINCT MI250X",
            "Card model": "0x740c",
            "Card vendor": "Advanced Micro Devices, Inc. [AMD/ATI]",
            "Card SKU": "D65209",
            "GFX Version": "gfx90a",
        },
        "card1": {
            "VRAM Total Memory (B)": "68702699520",
            "VRAM Total Used Memory (B)": "68702699520",
            "Card series": "AMD INSTINCT MI250X",
            "Card model": "0x740c",
            "GFX Version": "gfx90a",
        },
    }
)
ROCM_RADEON = json.dumps(
    {
        "card0": {
            "VRAM Total Memory (B)": "25753026560",
            "VRAM Total Used Memory (B)": "1053097984",
            "Card Series": "Navi 31 [Radeon RX 7900 XT/7900 XTX]",
            "Card Vendor": "Advanced Micro Devices, Inc. [AMD/ATI]",
        },
        "system": {"Driver version": "6.7.0"},
    }
)

# `sysctl hw.memsize`, `sysctl machdep.cpu.brand_string`, `sysctl iogpu.wired_limit_mb`
SYSCTL_M2 = "hw.memsize: 17179869184\nmachdep.cpu.brand_string: Apple M2\n"
SYSCTL_M3MAX_RAISED = (
    "hw.memsize: 68719476736\nmachdep.cpu.brand_string: Apple M3 Max\niogpu.wired_limit_mb: 57344\n"
)

CPUINFO_X86 = """\
processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD Ryzen 9 7950X 16-Core Processor
flags\t\t: fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx \
fxsr sse sse2 ht syscall nx mmxext fxsr_opt pdpe1gb rdtscp lm constant_tsc rep_good nopl \
nonstop_tsc cpuid extd_apicid aperfmperf rapl pni pclmulqdq monitor ssse3 fma cx16 sse4_1 \
sse4_2 movbe popcnt aes xsave avx f16c rdrand lahf_lm cmp_legacy svm extapic avx2 bmi2 \
avx512f avx512dq avx512ifma avx512cd avx512bw avx512vl avx512_bf16 avx512vbmi avx512_vnni

processor\t: 1
model name\t: AMD Ryzen 9 7950X 16-Core Processor
flags\t\t: fpu pni ssse3 avx avx2
"""
CPUINFO_ARM = """\
processor\t: 0
BogoMIPS\t: 243.75
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm \
lrcpc dcpop sha3 sm3 sm4 asimddp sha512 sve asimdfhm dit uscat ilrcpc flagm sb paca pacg dcpodp \
sve2 sveaes svepmull svebitperm svesha3 svesm4 flagm2 frint svei8mm svebf16 i8mm bf16
CPU implementer\t: 0x41
"""

SYSINFO_CPU = (
    "CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | "
    "LLAMAFILE = 1 | OPENMP = 1 | REPACK = 1 | "
)
SYSINFO_CUDA = (
    "CUDA : ARCHS = 890 | USE_GRAPHS = 1 | PEER_MAX_BATCH_SIZE = 128 | "
    "CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | "
)


def test_nvidia_smi_two_h100_with_one_busy() -> None:
    gpus = parse_nvidia_smi(NVIDIA_2XH100)
    assert [g.index for g in gpus] == [0, 1]
    assert gpus[0].name == "NVIDIA H100 80GB HBM3"
    assert gpus[0].total_bytes == 81559 * MiB
    assert gpus[1].free_bytes == 2310 * MiB  # another process holds the rest
    assert gpus[0].compute_capability == "9.0"
    assert gpus[0].bandwidth_gbps == 3350 and gpus[0].backend == "cuda"


def test_nvidia_smi_unequal_cards_get_their_own_bandwidth() -> None:
    slow, fast = parse_nvidia_smi(NVIDIA_MIXED)
    assert (slow.bandwidth_gbps, fast.bandwidth_gbps) == (360, 1008)
    assert fast.total_bytes == 24564 * MiB


def test_nvidia_smi_unknown_free_memory_counts_as_none() -> None:
    (gpu,) = parse_nvidia_smi(NVIDIA_NA)
    assert gpu.free_bytes == 0 and gpu.total_bytes == 40960 * MiB


def test_old_driver_falls_back_to_the_query_without_compute_cap() -> None:
    calls: list[list[str]] = []

    def run(argv: list[str]) -> str | None:
        calls.append(argv)
        return None if "compute_cap" in argv[1] else NVIDIA_OLD_DRIVER

    (gpu,) = probe_nvidia(run)
    assert len(calls) == 2
    assert gpu.name == "Tesla T4" and gpu.compute_capability is None
    assert gpu.free_bytes == 15101 * MiB and gpu.bandwidth_gbps == 320


def test_nvidia_smi_error_text_yields_no_gpu() -> None:
    assert parse_nvidia_smi(NVIDIA_BAD_FIELD) == []


def test_rocm_smi_instinct_cards() -> None:
    gpus = parse_rocm_smi(ROCM_MI250)
    assert [g.index for g in gpus] == [0, 1]
    assert gpus[0].backend == "rocm" and gpus[0].name == "AMD INSTINCT MI250X"
    assert gpus[0].total_bytes == 68702699520
    assert gpus[0].free_bytes == 68702699520 - 11452416
    assert gpus[1].free_bytes == 0
    assert gpus[0].bandwidth_gbps == 3277 and gpus[0].compute_capability == "gfx90a"


def test_rocm_smi_radeon_and_bad_json() -> None:
    (gpu,) = parse_rocm_smi(ROCM_RADEON)
    assert gpu.bandwidth_gbps == 960  # the XTX figure, matched before "7900 xt"
    assert gpu.free_bytes == 25753026560 - 1053097984
    assert parse_rocm_smi("ERROR: no devices") == []


def test_apple_working_set_defaults_and_override() -> None:
    assert apple_working_set(16 * GiB, None) == 16 * GiB * 2 // 3
    assert apple_working_set(64 * GiB, None) == 48 * GiB
    assert apple_working_set(64 * GiB, 57344) == 56 * GiB
    assert apple_working_set(8 * GiB, 999_999) == 8 * GiB  # never more than the RAM


def test_apple_gpu_from_sysctl() -> None:
    m2 = apple_gpu(parse_sysctl(SYSCTL_M2), available_bytes=9 * GiB)
    assert m2 is not None and m2.unified and m2.backend == "metal"
    assert m2.total_bytes == 16 * GiB * 2 // 3
    assert m2.free_bytes == 9 * GiB  # available RAM is lower than the working set
    assert m2.bandwidth_gbps == 100
    big = apple_gpu(parse_sysctl(SYSCTL_M3MAX_RAISED), available_bytes=60 * GiB)
    assert big is not None and big.total_bytes == 56 * GiB and big.bandwidth_gbps == 400
    intel = apple_gpu({"hw.memsize": "1", "machdep.cpu.brand_string": "Intel(R) Core(TM)"}, 1)
    assert intel is None


def test_cpuinfo_flags() -> None:
    model, simd = parse_cpuinfo(CPUINFO_X86)
    assert model == "AMD Ryzen 9 7950X 16-Core Processor"
    assert {"sse3", "avx2", "fma", "f16c", "avx512f", "avx512_vnni"} <= set(simd)
    assert "amx_int8" not in simd
    _, arm = parse_cpuinfo(CPUINFO_ARM)
    assert {"asimd", "asimddp", "i8mm", "sve", "sve2"} <= set(arm)


def test_system_info_backends() -> None:
    assert parse_system_info(SYSINFO_CPU) == ("CPU",)
    assert parse_system_info(SYSINFO_CUDA) == ("CUDA", "CPU")


@pytest.mark.parametrize(
    ("name", "spec"),
    [
        ("NVIDIA H100 80GB HBM3", 3350),
        ("NVIDIA H100 PCIe", 2000),
        ("NVIDIA H100 NVL", 3900),
        ("NVIDIA H200", 4800),
        ("NVIDIA A100-SXM4-80GB", 2039),
        ("NVIDIA A100 80GB PCIe", 1935),
        ("NVIDIA A100-SXM4-40GB", 1555),
        ("NVIDIA GeForce RTX 3060 Ti", 448),
        ("NVIDIA GeForce RTX 3060", 360),
        ("NVIDIA L40S", 864),
        ("NVIDIA L4", 300),
        ("Apple M2 Pro", 200),
        ("Apple M2", 100),
    ],
)
def test_known_device_table(name: str, spec: float) -> None:
    found = lookup_device(name)
    assert found is not None and found.bandwidth_gbps == spec


def test_unknown_device() -> None:
    assert lookup_device("Matrox G200eW") is None


def _gpu(backend: str = "cuda") -> GpuDevice:
    return GpuDevice(0, "NVIDIA GeForce RTX 4090", backend, 24 * GiB, 23 * GiB, 1008, 165)  # type: ignore[arg-type]


def test_cuda_card_with_cpu_only_build_is_reported_with_the_rebuild_command() -> None:
    (warning,) = build_warnings((_gpu(),), BuildFacts(installed=True, gpu_offload=False))
    assert "CPU only" in warning
    assert (
        'CMAKE_ARGS="-DGGML_CUDA=on" pip install --force-reinstall --no-cache-dir '
        "llama-cpp-python==0.3.36" in warning
    )
    (metal,) = build_warnings((_gpu("metal"),), BuildFacts(installed=True, gpu_offload=False))
    assert "-DGGML_METAL=on" in metal


def test_no_warning_when_the_build_offloads_or_there_is_no_gpu() -> None:
    assert build_warnings((_gpu(),), BuildFacts(installed=True, gpu_offload=True)) == ()
    assert build_warnings((), BuildFacts(installed=True, gpu_offload=False)) == ()
    (missing,) = build_warnings((_gpu(),), BuildFacts(installed=False))
    assert "not installed" in missing


def test_probe_this_machine_with_fake_gpu_tools() -> None:
    """Real psutil, /proc/cpuinfo and llama.cpp build; the GPU tools answer from samples."""

    def run(argv: list[str]) -> str | None:
        return NVIDIA_MIXED if argv[0] == "nvidia-smi" else None

    facts = probe(run)
    assert facts.cpu.physical_cores >= 1 and facts.cpu.ram_total_bytes > 0
    assert 0 < facts.cpu.ram_available_bytes <= facts.cpu.ram_total_bytes
    assert [g.name for g in facts.gpus] == ["NVIDIA GeForce RTX 3060", "NVIDIA GeForce RTX 4090"]
    assert facts.build.installed and "CPU" in facts.build.backends
    if facts.build.gpu_offload is False:  # this CI machine's wheel is CPU-only
        assert facts.usable_gpus == ()
        assert any("-DGGML_CUDA=on" in w for w in facts.warnings)
    json.dumps(facts.to_json())


def test_probe_without_gpu_tools() -> None:
    facts = probe(lambda argv: None)
    assert facts.gpus == () and facts.warnings == ()
    assert facts.name == "this machine"


@pytest.mark.parametrize("name", HARDWARE_PROFILES)
def test_every_builtin_profile_loads(name: str) -> None:
    facts = load_hardware_profile(name)
    assert facts.name == name
    assert facts.cpu.ram_available_bytes <= facts.cpu.ram_total_bytes
    for gpu in facts.gpus:
        assert 0 < gpu.free_bytes <= gpu.total_bytes
        assert lookup_device(gpu.name) is not None, f"{gpu.name} missing from the device table"
    assert facts.build.gpu_offload is bool(facts.gpus)
    datacenter = name.startswith(("a100", "h100", "h200", "2xh100"))
    assert facts.kind == ("datacenter" if datacenter else "personal")


def test_issue_profiles_are_all_there() -> None:
    assert set(HARDWARE_PROFILES) >= {
        "cpu-8gb", "cpu-32gb", "rtx3060-12gb", "rtx4090-24gb", "apple-m2-16gb",
        "apple-m3max-64gb", "a100-40gb", "a100-80gb", "h100-80gb", "h200-141gb", "2xh100-80gb",
    }  # fmt: skip


def test_apple_profile_is_unified_with_the_metal_working_set() -> None:
    facts = load_hardware_profile("apple-m2-16gb")
    (gpu,) = facts.gpus
    assert gpu.unified and facts.unified_memory
    assert facts.working_set_bytes == 16 * GiB * 2 // 3


def test_profile_from_a_file(tmp_path: Path) -> None:
    path = tmp_path / "lab.toml"
    path.write_text(
        'name = "lab box"\nkind = "personal"\n'
        "cpu = { physical_cores = 12, ram_gib = 64, ram_available_gib = 40 }\n"
        "[build]\ngpu_offload = false\n"
        '[[gpus]]\nname = "NVIDIA GeForce RTX 3090"\nmemory_gib = 24\nfree_gib = 2\n'
    )
    facts = load_hardware_profile(path)
    assert facts.name == "lab box"
    assert facts.gpus[0].free_bytes == 2 * GiB and facts.gpus[0].bandwidth_gbps == 936
    assert facts.usable_gpus == () and "-DGGML_CUDA=on" in facts.warnings[0]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("kind = 'personal'\n", r"no \[cpu\] table"),
        ("cpu = { ram_gib = -1 }\n", "non-negative"),
        ("cpu = { physical_cores = 2 }\n", "missing ram_gib"),
        ("cpu = { ram_gib = 8 }\nkind = 'server'\n", "kind must be"),
        ("cpu = { ram_gib = 8 }\ngpus = [{ name = 'x', memory_gib = 4, free_gib = 5 }]\n",
         "more free"),
        ("cpu = { ram_gib = 8 }\ngpus = [{ name = 'x', backend = 'opencl', memory_gib = 4 }]\n",
         "unknown GPU backend"),
        ("cpu = [", "not valid TOML"),
    ],
)  # fmt: skip
def test_bad_profile_files_say_what_is_wrong(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(HardwareError, match=message):
        load_hardware_profile(path)


def test_unknown_profile_lists_the_known_ones() -> None:
    with pytest.raises(HardwareError, match="rtx4090-24gb"):
        load_hardware_profile("rtx9090")
