"""What machine are we on: GPUs, CPU, RAM and the llama.cpp build, as plain facts.

The planner (localspec.plan) is a pure function of these facts, so every probe here only
*reads* the machine: nvidia-smi / rocm-smi / sysctl output goes through small parsers that the
tests feed with captured samples, and a described machine (a built-in profile or a TOML file)
replaces the probe entirely when planning for a machine you are not on.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, Protocol

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

GiB = 1024**3
MiB = 1024**2

Backend = Literal["cuda", "rocm", "metal", "vulkan"]
MachineKind = Literal["personal", "datacenter"]

LLAMA_CPP_VERSION = "0.3.36"
REBUILD_FLAGS: dict[str, str] = {
    "cuda": "-DGGML_CUDA=on",
    "rocm": "-DGGML_HIP=on",
    "metal": "-DGGML_METAL=on",
    "vulkan": "-DGGML_VULKAN=on",
}

PROFILES_FILE = Path(__file__).resolve().parent / "hardware_profiles.toml"

# A CPU whose memory bandwidth we cannot measure is assumed to be a dual-channel DDR4 desktop.
DEFAULT_CPU_BANDWIDTH_GBPS = 51.0
# Rough dense fp16/fp32 throughput per physical core of a modern x86/ARM core (AVX2/NEON, FMA).
CPU_TFLOPS_PER_CORE = 0.05


class HardwareError(ValueError):
    """A hardware description could not be read (unknown profile, malformed file)."""


@dataclass(frozen=True)
class DeviceSpec:
    """Published peak figures for one accelerator model: what bounds decode speed."""

    bandwidth_gbps: float  # memory bandwidth, GB/s (decimal)
    tflops: float  # dense fp16 tensor throughput (fp32 accumulate), TFLOPS


# Ordered: the first pattern found in the (lower-cased) device name wins, so specific names
# (H100 NVL, A100 80GB PCIe) come before general ones (H100, A100).
KNOWN_DEVICES: tuple[tuple[str, DeviceSpec], ...] = (
    ("h200", DeviceSpec(4800, 989)),
    ("gh200", DeviceSpec(4000, 989)),
    ("h100 nvl", DeviceSpec(3900, 835)),
    ("h100 pcie", DeviceSpec(2000, 756)),
    ("h100", DeviceSpec(3350, 989)),  # SXM: "NVIDIA H100 80GB HBM3"
    ("a100 80gb pcie", DeviceSpec(1935, 312)),
    ("a100-pcie-80gb", DeviceSpec(1935, 312)),
    ("a100-sxm4-80gb", DeviceSpec(2039, 312)),
    ("a100-sxm-80gb", DeviceSpec(2039, 312)),
    ("a100", DeviceSpec(1555, 312)),  # the 40 GB cards, SXM4 or PCIe
    ("l40s", DeviceSpec(864, 362)),
    ("l40", DeviceSpec(864, 181)),
    ("l4", DeviceSpec(300, 121)),
    ("a10g", DeviceSpec(600, 70)),
    ("a10", DeviceSpec(600, 125)),
    ("t4", DeviceSpec(320, 65)),
    ("rtx 6000 ada", DeviceSpec(960, 364)),
    ("rtx a6000", DeviceSpec(768, 155)),
    ("rtx 5090", DeviceSpec(1792, 210)),
    ("rtx 5080", DeviceSpec(960, 113)),
    ("rtx 4090", DeviceSpec(1008, 165)),
    ("rtx 4080", DeviceSpec(717, 97)),
    ("rtx 4070 ti", DeviceSpec(504, 80)),
    ("rtx 4070", DeviceSpec(504, 58)),
    ("rtx 4060 ti", DeviceSpec(288, 44)),
    ("rtx 4060", DeviceSpec(272, 30)),
    ("rtx 3090", DeviceSpec(936, 71)),
    ("rtx 3080", DeviceSpec(760, 59)),
    ("rtx 3070", DeviceSpec(448, 40)),
    ("rtx 3060 ti", DeviceSpec(448, 32)),
    ("rtx 3060", DeviceSpec(360, 25)),
    ("mi300x", DeviceSpec(5300, 1307)),
    ("mi250x", DeviceSpec(3277, 383)),
    ("mi250", DeviceSpec(3277, 362)),
    ("mi210", DeviceSpec(1638, 181)),
    ("7900 xtx", DeviceSpec(960, 123)),
    ("7900 xt", DeviceSpec(800, 103)),
    ("6900 xt", DeviceSpec(512, 46)),
    ("6800 xt", DeviceSpec(512, 41)),
    # Apple: unified memory bandwidth of the chip; GPU fp32 TFLOPS (Metal has no faster fp16 path)
    ("m4 max", DeviceSpec(546, 18.4)),
    ("m4 pro", DeviceSpec(273, 9.2)),
    ("m4", DeviceSpec(120, 4.3)),
    ("m3 ultra", DeviceSpec(819, 28.2)),
    ("m3 max", DeviceSpec(400, 16.4)),
    ("m3 pro", DeviceSpec(150, 7.4)),
    ("m3", DeviceSpec(100, 4.1)),
    ("m2 ultra", DeviceSpec(800, 27.2)),
    ("m2 max", DeviceSpec(400, 13.6)),
    ("m2 pro", DeviceSpec(200, 6.8)),
    ("m2", DeviceSpec(100, 3.6)),
    ("m1 ultra", DeviceSpec(800, 21.2)),
    ("m1 max", DeviceSpec(400, 10.6)),
    ("m1 pro", DeviceSpec(200, 5.3)),
    ("m1", DeviceSpec(68, 2.6)),
)
UNKNOWN_GPU = DeviceSpec(300, 20)  # conservative: a mid-range card we have no figures for


def lookup_device(name: str) -> DeviceSpec | None:
    """Published bandwidth/throughput for a device name as the driver reports it."""
    lowered = " ".join(name.lower().replace("geforce", " ").split())
    for pattern, spec in KNOWN_DEVICES:
        if re.search(rf"(?<![a-z0-9]){re.escape(pattern)}(?![a-z0-9])", lowered):
            return spec
    return None


@dataclass(frozen=True)
class GpuDevice:
    """One accelerator llama.cpp can offload to."""

    index: int
    name: str
    backend: Backend
    total_bytes: int
    free_bytes: int
    bandwidth_gbps: float
    tflops: float
    compute_capability: str | None = None
    unified: bool = False  # shares RAM with the CPU: Apple, an integrated or software GPU
    llama_name: str | None = None  # llama.cpp's name for it (Vulkan0, CUDA0); None: not seen
    software: bool = False  # a Vulkan driver running on the CPU (lavapipe): its heap is RAM
    max_tensor_bytes: int | None = None  # larger ops run on the CPU (Vulkan: storage range)


@dataclass(frozen=True)
class CpuFacts:
    model: str
    physical_cores: int
    logical_cores: int
    ram_total_bytes: int
    ram_available_bytes: int
    simd: tuple[str, ...] = ()
    bandwidth_gbps: float = DEFAULT_CPU_BANDWIDTH_GBPS

    @property
    def tflops(self) -> float:
        return self.physical_cores * CPU_TFLOPS_PER_CORE


@dataclass(frozen=True)
class BuildFacts:
    """What the installed llama-cpp-python can do; gpu_offload None = not installed/unknown."""

    installed: bool
    version: str | None = None
    gpu_offload: bool | None = None
    backends: tuple[str, ...] = ()
    system_info: str = ""
    devices: tuple[str, ...] = ()  # the offload devices llama.cpp sees, "Vulkan0: llvmpipe (...)"
    chosen: str = ""  # the launcher's backend choice for this environment ("" unknown)
    fallback: str = ""  # why the launcher fell back to the CPU, when it did


@dataclass(frozen=True)
class HardwareFacts:
    """Everything the planner needs to know about a machine, probed or described."""

    name: str  # "this machine" or the profile name
    description: str
    kind: MachineKind
    cpu: CpuFacts
    gpus: tuple[GpuDevice, ...] = ()
    build: BuildFacts = field(default_factory=lambda: BuildFacts(installed=False))
    working_set_bytes: int | None = None  # Apple: Metal's recommended max working set
    notes: tuple[str, ...] = ()  # anything else the probe wants the user to know

    @property
    def warnings(self) -> tuple[str, ...]:
        """Derived, so a changed build or GPU list can never carry a stale warning."""
        return self.notes + build_warnings(self.gpus, self.build)

    @property
    def unified_memory(self) -> bool:
        return any(g.unified for g in self.gpus)

    @property
    def usable_gpus(self) -> tuple[GpuDevice, ...]:
        """The GPUs the llama.cpp build can actually use (none for a CPU-only build)."""
        return () if self.build.gpu_offload is False else self.gpus

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["unified_memory"] = self.unified_memory
        data["warnings"] = list(self.warnings)
        return data


# --------------------------------------------------------------------------- parsers (pure)

NVIDIA_SMI_QUERY = "index,name,memory.total,memory.free,compute_cap"
NVIDIA_SMI_QUERY_OLD = "index,name,memory.total,memory.free"  # drivers before 510


def _mib_field(value: str) -> int:
    """nvidia-smi prints memory in MiB; '[N/A]' or '[Insufficient Permissions]' mean unknown."""
    cleaned = value.strip().removesuffix("MiB").strip()
    return int(float(cleaned)) * MiB if re.fullmatch(r"\d+(\.\d+)?", cleaned) else 0


def parse_nvidia_smi(text: str) -> list[GpuDevice]:
    """Parse `nvidia-smi --query-gpu=<NVIDIA_SMI_QUERY> --format=csv,noheader,nounits`."""
    gpus: list[GpuDevice] = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 4 or not parts[0].isdigit():
            continue
        index, name, total, free = parts[:4]
        compute_cap = parts[4] if len(parts) > 4 and re.fullmatch(r"\d+\.\d+", parts[4]) else None
        spec = lookup_device(name) or UNKNOWN_GPU
        total_bytes = _mib_field(total)
        free_raw = _mib_field(free)
        gpus.append(
            GpuDevice(
                index=int(index),
                name=name,
                backend="cuda",
                total_bytes=total_bytes,
                free_bytes=free_raw if free_raw or not total_bytes else 0,
                bandwidth_gbps=spec.bandwidth_gbps,
                tflops=spec.tflops,
                compute_capability=compute_cap,
            )
        )
    return gpus


def _find_key(card: Mapping[str, Any], *needles: str) -> str | None:
    for key, value in card.items():
        lowered = key.lower()
        if all(n in lowered for n in needles):
            return str(value)
    return None


def parse_rocm_smi(text: str) -> list[GpuDevice]:
    """Parse `rocm-smi --showproductname --showmeminfo vram --json` (keys vary by release)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return []
    gpus: list[GpuDevice] = []
    for key in sorted(data, key=lambda k: int(re.sub(r"\D", "", k) or 0)):
        card = data[key]
        if not key.lower().startswith("card") or not isinstance(card, dict):
            continue
        total = _find_key(card, "vram total memory")
        used = _find_key(card, "vram total used")
        if total is None:
            continue
        name = (
            _find_key(card, "card series")
            or _find_key(card, "card model")
            or _find_key(card, "device name")
            or "AMD GPU"
        )
        total_bytes = int(total)
        spec = lookup_device(name) or UNKNOWN_GPU
        gpus.append(
            GpuDevice(
                index=int(re.sub(r"\D", "", key) or 0),
                name=name,
                backend="rocm",
                total_bytes=total_bytes,
                free_bytes=max(0, total_bytes - int(used or 0)),
                bandwidth_gbps=spec.bandwidth_gbps,
                tflops=spec.tflops,
                compute_capability=_find_key(card, "gfx version"),
            )
        )
    return gpus


def apple_working_set(ram_bytes: int, wired_limit_mb: int | None) -> int:
    """Metal's recommendedMaxWorkingSetSize: 2/3 of RAM below 36 GiB, 3/4 above.

    Those ratios are what llama.cpp logs on real Macs (16 GiB M2: 10.67 GiB; 64 GiB M3 Max:
    48 GiB). `sudo sysctl iogpu.wired_limit_mb=N` overrides them (0 = the default).
    """
    if wired_limit_mb:
        return min(wired_limit_mb * MiB, ram_bytes)
    return ram_bytes * 2 // 3 if ram_bytes < 36 * GiB else ram_bytes * 3 // 4


def parse_sysctl(text: str) -> dict[str, str]:
    """Parse `sysctl hw.memsize machdep.cpu.brand_string ...` ("name: value" lines)."""
    values: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            values[key.strip()] = value.strip()
    return values


def apple_gpu(sysctl: Mapping[str, str], available_bytes: int) -> GpuDevice | None:
    """The Metal device of an Apple Silicon Mac, from its sysctl values."""
    chip = sysctl.get("machdep.cpu.brand_string", "")
    if not chip.startswith("Apple") or "hw.memsize" not in sysctl:
        return None
    ram = int(sysctl["hw.memsize"])
    wired = sysctl.get("iogpu.wired_limit_mb", "0")
    working_set = apple_working_set(ram, int(wired) if wired.isdigit() else None)
    spec = lookup_device(chip) or UNKNOWN_GPU
    return GpuDevice(
        index=0,
        name=chip,
        backend="metal",
        total_bytes=working_set,
        free_bytes=min(working_set, available_bytes),
        bandwidth_gbps=spec.bandwidth_gbps,
        tflops=spec.tflops,
        unified=True,
    )


SIMD_FLAGS = (
    "sse3",
    "ssse3",
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx_vnni",
    "avx512f",
    "avx512bw",
    "avx512_vnni",
    "avx512_bf16",
    "amx_int8",
    "asimd",
    "asimddp",
    "i8mm",
    "sve",
    "sve2",
)


def parse_cpuinfo(text: str) -> tuple[str, tuple[str, ...]]:
    """Model name and the SIMD flags llama.cpp cares about, from /proc/cpuinfo."""
    model = ""
    flags: set[str] = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key in ("model name", "hardware", "cpu model") and not model:
            model = value.strip()
        elif key in ("flags", "features"):
            flags.update(value.split())
    if "pni" in flags:  # Linux names SSE3 "pni" (Prescott New Instructions)
        flags.add("sse3")
    return model, tuple(f for f in SIMD_FLAGS if f in flags)


def parse_system_info(info: str) -> tuple[str, ...]:
    """Backends named in llama_print_system_info(): 'CUDA : ARCHS = 890 | ... | CPU : ...'."""
    names: list[str] = []
    for part in info.split("|"):
        head, sep, _ = part.partition(":")
        name = head.strip()
        if sep and name and " " not in name and "=" not in name and name not in names:
            names.append(name)
    return tuple(names)


def build_warnings(gpus: tuple[GpuDevice, ...], build: BuildFacts) -> tuple[str, ...]:
    """Say plainly when the machine has a GPU that this llama.cpp build cannot use."""
    if not gpus:
        return ()
    if not build.installed:
        return (
            "llama-cpp-python is not installed, so whether it can use the "
            f"{gpus[0].name} is unknown; install localspec's pinned llama-cpp-python",
        )
    if build.gpu_offload:
        return ()
    backend = gpus[0].backend
    return (
        f"this machine has {gpus[0].name} ({backend.upper()}) but the installed "
        "llama-cpp-python was built for the CPU only, so the plan runs on the CPU. Rebuild it "
        f'with: CMAKE_ARGS="{REBUILD_FLAGS[backend]}" pip install --force-reinstall '
        f"--no-cache-dir llama-cpp-python=={LLAMA_CPP_VERSION}",
    )


# --------------------------------------------------------------------------- probes (I/O)

Runner = Callable[[list[str]], str | None]


def run_command(argv: list[str]) -> str | None:
    """Output of a probe command, or None when it is absent, fails or hangs."""
    if shutil.which(argv[0]) is None:
        return None
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def probe_nvidia(run: Runner = run_command) -> list[GpuDevice]:
    for query in (NVIDIA_SMI_QUERY, NVIDIA_SMI_QUERY_OLD):
        out = run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits"])
        if out is not None:
            return parse_nvidia_smi(out)
    return []


def probe_rocm(run: Runner = run_command) -> list[GpuDevice]:
    out = run(["rocm-smi", "--showproductname", "--showmeminfo", "vram", "--json"])
    return parse_rocm_smi(out) if out else []


def launcher_choice(venv: str | os.PathLike[str] | None = None) -> dict[str, str]:
    """What launcher/bootstrap.sh recorded when it installed llama.cpp into this environment
    (``.localspec-backend``: backend=, cmake_args=, fallback=, wheelhouse= lines); empty for
    an environment it did not make."""
    path = Path(venv if venv is not None else sys.prefix) / ".localspec-backend"
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return {}
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


def probe_build(seen: Sequence[LlamaDevice] = ()) -> BuildFacts:
    """Ask the installed llama-cpp-python whether it can offload, with which backends (its
    backend registry) and to which devices."""
    try:
        import llama_cpp
    except ImportError:
        return BuildFacts(installed=False)
    info = llama_cpp.llama_print_system_info().decode("utf-8", "replace")
    try:
        from localspec.engine import devices as ggml_devices

        backends = ggml_devices.backends()
    except (ImportError, OSError, AttributeError):  # an older or unusual build: its text
        backends = parse_system_info(info)
    return BuildFacts(
        installed=True,
        version=getattr(llama_cpp, "__version__", None),
        gpu_offload=bool(llama_cpp.llama_supports_gpu_offload()),
        backends=backends,
        system_info=info.strip(),
        devices=tuple(f"{d.name}: {d.description}" for d in seen if d.offloads),
        chosen=(choice := launcher_choice()).get("backend", ""),
        fallback=choice.get("fallback", ""),
    )


class LlamaDevice(Protocol):
    """What the probe reads of a device llama.cpp sees (localspec.engine.devices.GgmlDevice)."""

    name: str
    description: str
    type: str
    backend: str
    total_bytes: int
    free_bytes: int

    @property
    def offloads(self) -> bool: ...


def probe_llama_devices() -> list[LlamaDevice]:
    """The devices the installed llama.cpp sees (ggml's device registry); empty when
    llama-cpp-python is missing or its libraries cannot be read."""
    try:
        from localspec.engine import devices as ggml_devices

        return list(ggml_devices.devices())
    except (ImportError, OSError, AttributeError):
        return []


# ggml backend registry names -> localspec's backend names
_LLAMA_BACKENDS: dict[str, Backend] = {
    "cuda": "cuda",
    "rocm": "rocm",
    "hip": "rocm",
    "metal": "metal",
    "mtl": "metal",
    "vulkan": "vulkan",
}
# Vulkan drivers that run on the CPU (Mesa's lavapipe/llvmpipe, SwiftShader): their "device
# memory" is host RAM and their speed the CPU's
SOFTWARE_DEVICES = ("llvmpipe", "lavapipe", "swiftshader")


def _same_card(a: str, b: str) -> bool:
    def norm(name: str) -> str:
        return " ".join(name.lower().replace("nvidia", "").replace("geforce", "").split())

    return bool(norm(a)) and (norm(a) in norm(b) or norm(b) in norm(a))


def merge_devices(
    seen: Sequence[LlamaDevice], vendor: Sequence[GpuDevice], cpu: CpuFacts
) -> tuple[list[GpuDevice], list[str]]:
    """The GPUs to plan for: llama.cpp's own devices (what it can offload to, with the memory
    its backend reports), each given what nvidia-smi / rocm-smi / sysctl add (compute
    capability, the vendor's name for the bandwidth table) where the names match. With no
    offload device (a CPU-only build) the vendor tools' list stands, so the plan can say the
    build cannot use the card. Returns the GPUs and notes for the user."""
    offload = [d for d in seen if d.offloads]
    if not offload:
        return list(vendor), []
    gpus: list[GpuDevice] = []
    notes: list[str] = []
    unmatched = list(vendor)
    for index, dev in enumerate(offload):
        backend = _LLAMA_BACKENDS.get(dev.backend.lower())
        if backend is None:
            notes.append(f"llama.cpp device {dev.name} ({dev.backend}) is not planned for")
            continue
        match = next((g for g in unmatched if _same_card(g.name, dev.description)), None)
        if match is not None:
            unmatched.remove(match)
        name = dev.description or (match.name if match else dev.name)
        total = dev.total_bytes or (match.total_bytes if match else 0)
        free = dev.free_bytes if dev.total_bytes else (match.free_bytes if match else 0)
        software = any(s in name.lower() for s in SOFTWARE_DEVICES)
        spec = lookup_device(name) or UNKNOWN_GPU
        if match is not None:  # the vendor tool's name found it in the table (or not)
            spec = DeviceSpec(match.bandwidth_gbps, match.tflops)
        if software:
            spec = DeviceSpec(cpu.bandwidth_gbps, cpu.tflops)
            notes.append(
                f"{dev.name} ({name}) is a software Vulkan device: its memory is host RAM "
                "and it runs at the CPU's speed (limits.gpu_memory_gb sets its size, to play a "
                "card)"
            )
        gpus.append(
            GpuDevice(
                index=index,
                name=name,
                backend=backend,
                total_bytes=total,
                free_bytes=min(free, total) if total else free,
                bandwidth_gbps=spec.bandwidth_gbps,
                tflops=spec.tflops,
                compute_capability=match.compute_capability if match else None,
                unified=backend == "metal" or software or dev.type == "igpu",
                llama_name=dev.name,
                software=software,
                max_tensor_bytes=getattr(dev, "max_tensor_bytes", None),
            )
        )
    return gpus, notes


def probe_cpu(run: Runner = run_command) -> tuple[CpuFacts, dict[str, str]]:
    """CPU and RAM facts; on macOS also the sysctl values the Apple GPU probe needs."""
    import psutil

    memory = psutil.virtual_memory()
    model, simd = "", ()
    sysctl: dict[str, str] = {}
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        model, simd = parse_cpuinfo(cpuinfo.read_text(errors="replace"))
    elif sys.platform == "darwin":
        # One key per call: sysctl fails as a whole on a key this macOS lacks (iogpu.*).
        for key in ("hw.memsize", "machdep.cpu.brand_string", "iogpu.wired_limit_mb"):
            sysctl.update(parse_sysctl(run(["sysctl", key]) or ""))
        model = sysctl.get("machdep.cpu.brand_string", "")
        simd = ("asimd",) if platform.machine() == "arm64" else ()
    logical = psutil.cpu_count(logical=True) or os.cpu_count() or 1
    cpu = CpuFacts(
        model=model or platform.processor() or platform.machine(),
        physical_cores=psutil.cpu_count(logical=False) or logical,
        logical_cores=logical,
        ram_total_bytes=memory.total,
        ram_available_bytes=memory.available,
        simd=simd,
        bandwidth_gbps=_apple_bandwidth(model) or DEFAULT_CPU_BANDWIDTH_GBPS,
    )
    return cpu, sysctl


def _apple_bandwidth(chip: str) -> float | None:
    spec = lookup_device(chip) if chip.startswith("Apple") else None
    return spec.bandwidth_gbps if spec else None


def probe(
    run: Runner = run_command, llama_devices: Callable[[], Sequence[LlamaDevice]] | None = None
) -> HardwareFacts:
    """Probe this machine. Never raises for a missing tool: absent means 'not there'.
    ``llama_devices``: what llama.cpp sees (default: ask the installed build)."""
    cpu, sysctl = probe_cpu(run)
    vendor: list[GpuDevice] = probe_nvidia(run) or probe_rocm(run)
    working_set = None
    if not vendor and sysctl:
        apple = apple_gpu(sysctl, cpu.ram_available_bytes)
        if apple is not None:
            vendor = [apple]
            working_set = apple.total_bytes
    seen = llama_devices() if llama_devices is not None else probe_llama_devices()
    gpus, notes = merge_devices(seen, vendor, cpu)
    build = probe_build(seen)
    names = ", ".join(g.name for g in gpus) or "no GPU"
    return HardwareFacts(
        name="this machine",
        description=f"{cpu.model}, {cpu.ram_total_bytes / GiB:.0f} GiB RAM, {names}",
        kind="personal",
        cpu=cpu,
        gpus=tuple(gpus),
        build=build,
        working_set_bytes=working_set,
        notes=tuple(notes),
    )


# --------------------------------------------------------------------------- described machines


def _bytes(table: Mapping[str, Any], stem: str, default: int | None = None) -> int:
    """Read `<stem>_gib`, `<stem>_mib` or `<stem>_bytes` from a profile table."""
    for suffix, unit in (("_bytes", 1), ("_mib", MiB), ("_gib", GiB)):
        if stem + suffix in table:
            value = table[stem + suffix]
            if not isinstance(value, int | float) or value < 0:
                raise HardwareError(f"{stem}{suffix} must be a non-negative number, not {value!r}")
            return int(value * unit)
    if default is None:
        raise HardwareError(f"missing {stem}_gib (or {stem}_mib / {stem}_bytes)")
    return default


def hardware_from_dict(name: str, data: Mapping[str, Any]) -> HardwareFacts:
    """Build facts from one profile table (the built-in file's sections or a user's file)."""
    try:
        cpu_table = data["cpu"]
    except KeyError:
        raise HardwareError(f"hardware profile {name!r} has no [cpu] table") from None
    ram = _bytes(cpu_table, "ram")
    cores = int(cpu_table.get("physical_cores", 4))
    cpu = CpuFacts(
        model=str(cpu_table.get("model", "CPU")),
        physical_cores=cores,
        logical_cores=int(cpu_table.get("logical_cores", cores)),
        ram_total_bytes=ram,
        ram_available_bytes=_bytes(cpu_table, "ram_available", ram * 3 // 4),
        simd=tuple(cpu_table.get("simd", ())),
        bandwidth_gbps=float(cpu_table.get("bandwidth_gbps", DEFAULT_CPU_BANDWIDTH_GBPS)),
    )
    gpus: list[GpuDevice] = []
    working_set = None
    for i, gpu in enumerate(data.get("gpus", ())):
        gpu_name = str(gpu.get("name", f"GPU {i}"))
        backend = gpu.get("backend", data.get("backend", "cuda"))
        if backend not in REBUILD_FLAGS:
            raise HardwareError(f"{name}: unknown GPU backend {backend!r}")
        spec = lookup_device(gpu_name) or UNKNOWN_GPU
        unified = backend == "metal"
        if unified:
            wired = gpu.get("wired_limit_mb")
            total = apple_working_set(cpu.ram_total_bytes, wired)
            working_set = total
            free = min(total, cpu.ram_available_bytes)
        else:
            total = _bytes(gpu, "memory")
            free = _bytes(gpu, "free", total)
        if free > total:
            raise HardwareError(f"{name}: GPU {i} has more free memory than total")
        gpus.append(
            GpuDevice(
                index=i,
                name=gpu_name,
                backend=backend,
                total_bytes=total,
                free_bytes=free,
                bandwidth_gbps=float(gpu.get("bandwidth_gbps", spec.bandwidth_gbps)),
                tflops=float(gpu.get("tflops", spec.tflops)),
                compute_capability=gpu.get("compute_capability"),
                unified=unified,
            )
        )
    kind = data.get("kind", "personal")
    if kind not in ("personal", "datacenter"):
        raise HardwareError(f"{name}: kind must be 'personal' or 'datacenter', not {kind!r}")
    build_table = data.get("build", {})
    offload = build_table.get("gpu_offload", bool(gpus))
    backends = tuple(build_table.get("backends", [g.backend.upper() for g in gpus[:1]] + ["CPU"]))
    build = BuildFacts(
        installed=True, version=LLAMA_CPP_VERSION, gpu_offload=offload, backends=backends
    )
    return HardwareFacts(
        name=name,
        description=str(data.get("description", name)),
        kind=kind,
        cpu=cpu,
        gpus=tuple(gpus),
        build=build,
        working_set_bytes=working_set,
    )


def _read_profiles() -> dict[str, Any]:
    with PROFILES_FILE.open("rb") as f:
        return tomllib.load(f)


HARDWARE_PROFILES: tuple[str, ...] = tuple(_read_profiles())


def load_hardware_profile(name_or_path: str | os.PathLike[str]) -> HardwareFacts:
    """A built-in profile by name (see HARDWARE_PROFILES) or a TOML file describing a machine."""
    key = str(name_or_path)
    profiles = _read_profiles()
    if key in profiles:
        return hardware_from_dict(key, profiles[key])
    path = Path(key).expanduser()
    if not path.is_file():
        raise HardwareError(
            f"unknown hardware {key!r}: give a profile name ({', '.join(HARDWARE_PROFILES)}) "
            "or the path of a TOML file describing the machine"
        )
    try:
        with path.open("rb") as f:
            data = tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise HardwareError(f"{path}: not valid TOML: {e}") from e
    return hardware_from_dict(str(data.get("name", path.stem)), data)


def with_gpu_free(facts: HardwareFacts, index: int, free_bytes: int) -> HardwareFacts:
    """The same machine with one GPU's free memory changed (another process holds the rest)."""
    gpus = tuple(replace(g, free_bytes=free_bytes) if g.index == index else g for g in facts.gpus)
    return replace(facts, gpus=gpus)
