"""The launcher's choice of llama.cpp backend, run for real (launcher/backend over bootstrap.sh)
on a PATH that holds only the shell's tools and fake nvidia-smi / nvcc / rocminfo / vulkaninfo
/ glslc / uname scripts: every branch, the CPU wheel's unchanged key, and the fallbacks."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BACKEND = ROOT / "launcher" / "backend"
# what bootstrap.sh runs besides the tools each test fakes
SHELL_TOOLS = [
    "sh", "tr", "sed", "awk", "grep", "sort", "paste", "cksum", "cut", "head", "dirname",
    "readlink", "cat", "date", "mkdir", "ls", "getconf", "basename", "rm", "ln", "mv", "cp",
    "timeout", "uname", "printf",
]  # fmt: skip

H100_BANNER = "| NVIDIA-SMI 550.54.15   Driver Version: 550.54.15   CUDA Version: {cuda}     |"
LLVMPIPE = """Devices:
========
GPU0:
\tapiVersion         = 1.3.230
\tdeviceType         = PHYSICAL_DEVICE_TYPE_CPU
\tdeviceName         = llvmpipe (LLVM 15.0.6, 256 bits)
"""
ARC = """Devices:
========
GPU0:
\tdeviceType         = PHYSICAL_DEVICE_TYPE_CPU
\tdeviceName         = llvmpipe (LLVM 15.0.6, 256 bits)
GPU1:
\tdeviceType         = PHYSICAL_DEVICE_TYPE_DISCRETE_GPU
\tdeviceName         = Intel(R) Arc(tm) A770 Graphics (DG2)
"""
ROCMINFO = """*******
Agent 1
*******
  Name:                    AMD Ryzen 9 7950X 16-Core Processor
  Device Type:             CPU
*******
Agent 2
*******
  Name:                    gfx1100
  Marketing Name:          Radeon RX 7900 XTX
  Device Type:             GPU
"""


def posix_cksum(data: bytes) -> int:
    """POSIX `cksum`'s CRC (polynomial 0x04C11DB7, the length folded in), computed here so the
    CPU wheel's key is checked against its definition rather than against the shell's output."""
    crc = 0

    def feed(byte: int) -> None:
        nonlocal crc
        crc ^= byte << 24
        for _ in range(8):
            crc = ((crc << 1) ^ 0x04C11DB7) if crc & 0x80000000 else crc << 1
            crc &= 0xFFFFFFFF

    for byte in data:
        feed(byte)
    length = len(data)
    while length:
        feed(length & 0xFF)
        length >>= 8
    return ~crc & 0xFFFFFFFF


@dataclass
class Machine:
    """A fake machine: a bin directory of tools, a home with the wheelhouse, an environment."""

    root: Path

    def __post_init__(self) -> None:
        self.bin = self.root / "bin"
        self.bin.mkdir()
        for tool in SHELL_TOOLS:
            found = shutil.which(tool)
            if found:
                (self.bin / tool).symlink_to(found)
        self.wheels = self.root / "wheels"
        self.env = {
            "PATH": str(self.bin),
            "HOME": str(self.root / "home"),
            "LOCALSPEC_WHEELHOUSE": str(self.wheels),
            "LOCALSPEC_VENV": str(self.root / "venv"),
            "LOCALSPEC_CUDA_DEFAULT": str(self.root / "no-cuda"),
            "LOCALSPEC_SYSTEM_INCLUDE": str(self.root / "include"),
        }

    def tool(self, name: str, script: str) -> None:
        """A fake command: a shell script body."""
        path = self.bin / name
        if path.is_symlink():
            path.unlink()
        path.write_text("#!/bin/sh\n" + script)
        path.chmod(0o755)

    def prints(self, name: str, text: str) -> None:
        """A fake command that prints `text` whatever it is asked."""
        (self.root / f"{name}.out").write_text(text)
        self.tool(name, f'cat "{self.root}/{name}.out"\n')

    def nvidia(self, caps: list[str], cuda: str = "12.4") -> None:
        (self.root / "caps").write_text("".join(f"{c}\n" for c in caps))
        self.tool(
            "nvidia-smi",
            f'case "$*" in *compute_cap*) cat "{self.root}/caps" ;; '
            f'*) echo "{H100_BANNER.format(cuda=cuda)}" ;; esac\n',
        )

    def cuda_toolkit(self, *, cublas: bool) -> Path:
        home = self.root / "cuda"
        (home / "bin").mkdir(parents=True)
        (home / "include").mkdir()
        if cublas:
            (home / "include" / "cublas_v2.h").write_text("")
        nvcc = home / "bin" / "nvcc"
        nvcc.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 12.4, V12.4.131'\n")
        nvcc.chmod(0o755)
        self.env["CUDA_HOME"] = str(home)
        return nvcc

    def run(self, *args: str, **extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["sh", str(BACKEND), *args],
            env={**self.env, **extra},
            capture_output=True,
            text=True,
            timeout=60,
        )

    def detect(self, **extra: str) -> tuple[dict[str, str], str]:
        """launcher/backend's key=value answer, and the one line it says on stderr."""
        result = self.run("detect", **extra)
        assert result.returncode == 0, result.stderr
        values = dict(line.split("=", 1) for line in result.stdout.splitlines())
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1, lines
        return values, lines[0]


@pytest.fixture
def machine(tmp_path: Path) -> Machine:
    return Machine(tmp_path)


def _cpu_key(cmake_args: str) -> int:
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    flags = next((line for line in lines if line.startswith("flags")), "")
    uname = subprocess.run(["uname", "-sm"], capture_output=True, text=True).stdout.strip()
    return posix_cksum(f"{cmake_args}|{uname}|{flags}".encode())


@pytest.mark.skipif(not Path("/proc/cpuinfo").exists(), reason="the key reads Linux's cpuinfo")
def test_no_gpu_builds_for_the_cpu_under_the_key_it_always_had(machine: Machine) -> None:
    values, line = machine.detect()
    assert values["backend"] == "cpu"
    assert values["cmake_args"] == "-DLLAVA_BUILD=OFF"
    # the CPU wheel already built on every machine stays valid: same directory, same key
    expected = machine.wheels / f"llama-cpp-python-0.3.36-{_cpu_key('-DLLAVA_BUILD=OFF')}"
    assert values["wheelhouse"] == str(expected)
    assert line.startswith("localspec: building llama.cpp for the CPU: no GPU found")


def test_nvidia_with_nvcc_builds_cuda_for_the_cards_architectures(machine: Machine) -> None:
    machine.nvidia(["9.0", "8.6", "9.0"])
    nvcc = machine.cuda_toolkit(cublas=True)
    values, line = machine.detect()
    assert values["backend"] == "cuda"
    assert values["cuda_plan"] == "system"
    assert values["cmake_args"] == (
        "-DLLAVA_BUILD=OFF -DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=86;90"
    )
    assert "/llama-cpp-python-0.3.36-cuda-" in values["wheelhouse"]
    assert line == f"localspec: building llama.cpp for CUDA (architectures 86;90) with {nvcc}."


def test_nvidia_without_nvcc_plans_the_toolkit_wheels_for_the_drivers_cuda(
    machine: Machine,
) -> None:
    machine.nvidia(["8.9"], cuda="13.0")
    values, line = machine.detect()
    assert values["backend"] == "cuda"
    assert values["cuda_plan"] == "wheels"
    assert values["cmake_args"].endswith("-DCMAKE_CUDA_ARCHITECTURES=89")
    specs = (
        "nvidia-cuda-nvcc<13.1 nvidia-cuda-crt<13.1 nvidia-nvvm<13.1 nvidia-cuda-runtime<13.1 "
        "nvidia-cuda-cccl<13.1 nvidia-cublas<14"
    )
    assert f"toolkit wheels from PyPI: {specs}, into {machine.wheels}/cuda-toolkit-13.0." in line
    # detection only looks: nothing was downloaded or built
    assert not machine.wheels.exists()


def test_a_cuda_12_driver_without_nvcc_says_what_to_install(machine: Machine) -> None:
    """CUDA 12's nvcc wheel has no compiler in it (ptxas and libnvvm only)."""
    machine.nvidia(["8.6"], cuda="12.4")
    values, line = machine.detect()
    assert values["backend"] == "cpu"
    assert values["cmake_args"] == "-DLLAVA_BUILD=OFF"
    assert "this NVIDIA driver runs CUDA 12.4, older than the CUDA 13" in line
    assert "for CUDA install the toolkit" in line and "a driver for CUDA 13 (R580+)" in line


def test_nvcc_without_cublas_is_not_a_toolkit(machine: Machine) -> None:
    machine.nvidia(["9.0"], cuda="13.0")
    nvcc = machine.cuda_toolkit(cublas=False)
    values, line = machine.detect()
    assert values["cuda_plan"] == "wheels"
    assert f"({nvcc} has no cuBLAS beside it)" in line


def test_nvidia_without_a_cuda_build_takes_vulkan_where_it_can(machine: Machine) -> None:
    machine.nvidia(["8.6"], cuda="12.4")
    machine.prints("vulkaninfo", ARC.replace("Intel(R) Arc(tm) A770 Graphics (DG2)", "RTX 3090"))
    machine.prints("glslc", "")
    machine.prints("ldconfig", "\tlibvulkan.so.1 (libc6,x86-64) => /usr/lib/libvulkan.so.1\n")
    values, line = machine.detect()
    assert values["backend"] == "vulkan"
    assert line.startswith("localspec: building llama.cpp for Vulkan (RTX 3090): no nvcc with")


def test_an_old_driver_without_a_toolkit_stays_on_the_cpu(machine: Machine) -> None:
    machine.nvidia(["7.5"], cuda="11.8")
    values, line = machine.detect()
    assert values["backend"] == "cpu"
    assert "runs CUDA 11.8" in line


def test_rocm_builds_hip_for_the_gpu_agents(machine: Machine) -> None:
    machine.prints("rocminfo", ROCMINFO)
    machine.tool("hipconfig", "echo /opt/rocm\n")
    values, line = machine.detect()
    assert values["backend"] == "hip"
    assert values["cmake_args"] == "-DLLAVA_BUILD=OFF -DGGML_HIP=on -DAMDGPU_TARGETS=gfx1100"
    assert line == "localspec: building llama.cpp for ROCm/HIP (targets gfx1100)."


def test_rocm_without_hip_sdk_says_what_to_install(machine: Machine) -> None:
    machine.prints("rocminfo", ROCMINFO)
    values, line = machine.detect()
    assert values["backend"] == "cpu"
    assert "hipconfig is missing; for HIP install ROCm's HIP SDK" in line


def _uname(arch: str) -> str:
    """A macOS `uname` on `arch`."""
    return f'case "$1" in -s) echo Darwin ;; -m) echo {arch} ;; *) echo Darwin {arch} ;; esac\n'


def test_apple_silicon_builds_metal_under_its_old_key(machine: Machine) -> None:
    machine.tool("uname", _uname("arm64"))
    machine.prints("sysctl", "")
    values, line = machine.detect()
    assert values["backend"] == "metal"
    # llama.cpp builds Metal by default on Apple: the flags, and so the wheel, are unchanged
    assert values["cmake_args"] == "-DLLAVA_BUILD=OFF"
    assert "-metal-" not in values["wheelhouse"]
    assert line == "localspec: building llama.cpp for Metal (Apple silicon)."


def test_intel_mac_builds_for_the_cpu(machine: Machine) -> None:
    machine.tool("uname", _uname("x86_64"))
    values, _ = machine.detect()
    assert values["backend"] == "cpu"


def test_a_vulkan_gpu_with_glslc_builds_vulkan(machine: Machine) -> None:
    machine.prints("vulkaninfo", ARC)
    machine.prints("glslc", "")
    machine.prints("ldconfig", "\tlibvulkan.so.1 (libc6,x86-64) => /usr/lib/libvulkan.so.1\n")
    values, line = machine.detect()
    assert values["backend"] == "vulkan"
    assert values["cmake_args"] == "-DLLAVA_BUILD=OFF -DGGML_VULKAN=on"
    assert line == (
        "localspec: building llama.cpp for Vulkan (Intel(R) Arc(tm) A770 Graphics (DG2))."
    )


def test_a_vulkan_gpu_without_glslc_says_what_to_install(machine: Machine) -> None:
    machine.prints("vulkaninfo", ARC)
    values, line = machine.detect()
    assert values["backend"] == "cpu"
    assert "glslc or the Vulkan loader is missing" in line
    assert "apt-get install glslc libvulkan-dev" in line


def test_a_software_vulkan_device_is_no_reason_to_build_vulkan(machine: Machine) -> None:
    machine.prints("vulkaninfo", LLVMPIPE)
    machine.prints("glslc", "")
    values, line = machine.detect()
    assert values["backend"] == "cpu"
    assert values["cmake_args"] == "-DLLAVA_BUILD=OFF"
    assert "the only Vulkan device is a software one (llvmpipe" in line
    assert 'CMAKE_ARGS="-DGGML_VULKAN=on"' in line


def test_nvidia_comes_before_vulkan_on_the_same_machine(machine: Machine) -> None:
    machine.nvidia(["8.6"])
    machine.cuda_toolkit(cublas=True)
    machine.prints("vulkaninfo", ARC)
    machine.prints("glslc", "")
    values, _ = machine.detect()
    assert values["backend"] == "cuda"


@pytest.mark.parametrize(
    ("cmake_args", "backend"),
    [
        ("-DGGML_VULKAN=on", "vulkan"),
        ("-DLLAVA_BUILD=OFF -DGGML_NATIVE=OFF -DGGML_AVX512=OFF", "cpu"),
        ("-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=80", "cuda"),
    ],
)
def test_the_users_cmake_args_win(machine: Machine, cmake_args: str, backend: str) -> None:
    machine.nvidia(["9.0"])
    machine.cuda_toolkit(cublas=True)
    values, line = machine.detect(CMAKE_ARGS=cmake_args)
    assert values["backend"] == backend
    assert values["cmake_args"] == cmake_args
    assert line == (
        f"localspec: building llama.cpp for {backend}: CMAKE_ARGS is set ({cmake_args}), "
        "so it is used as given."
    )


# ---- building: a fake venv python stands in for `pip wheel` (no compile, no network) ----

FAKE_PIP = """#!/bin/sh
# the venv's python: `python -m pip wheel ... -w DIR llama-cpp-python==V`; other calls pass
[ "$1 $2 $3" = "-m pip wheel" ] || exit 0
printf '%s\\n' "$CMAKE_ARGS" >>"{log}"
case "$CMAKE_ARGS" in *{fail}*) echo "nvcc fatal: unsupported gpu architecture" >&2; exit 1 ;; esac
while [ $# -gt 0 ]; do [ "$1" = -w ] && dir=$2; shift; done
: >"$dir/llama_cpp_python-0.3.36-py3-none-linux_x86_64.whl"
"""


def _fake_venv(machine: Machine, fail: str) -> Path:
    """A venv whose python builds a wheel instantly, or fails when CMAKE_ARGS contains `fail`."""
    log = machine.root / "builds.log"
    venv_bin = machine.root / "venv" / "bin"
    venv_bin.mkdir(parents=True)
    python = venv_bin / "python"
    python.write_text(FAKE_PIP.format(log=log, fail=fail))
    python.chmod(0o755)
    for compiler in ("cc", "c++"):
        machine.prints(compiler, "")
    machine.env["LOCALSPEC_PYTHON"] = str(python)
    return log


def test_a_failed_gpu_build_falls_back_to_the_cpu_and_remembers(machine: Machine) -> None:
    machine.nvidia(["9.0"])
    machine.cuda_toolkit(cublas=True)
    log = _fake_venv(machine, fail="GGML_CUDA")
    result = machine.run("wheel")
    assert result.returncode == 0, result.stderr
    values = dict(line.split("=", 1) for line in result.stdout.splitlines())
    assert values["backend"] == "cpu"
    assert values["fallback"].startswith("the cuda build failed")
    said = "localspec: building llama.cpp for the CPU instead: the cuda build failed"
    assert said in result.stderr
    built = log.read_text().splitlines()
    assert built == [
        "-DLLAVA_BUILD=OFF -DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90",
        "-DLLAVA_BUILD=OFF",
    ]
    cpu_wheel = Path(values["wheel"])
    assert cpu_wheel.exists() and "-cuda-" not in str(cpu_wheel.parent)
    (marker,) = machine.wheels.glob("llama-cpp-python-0.3.36-cuda-*/BUILD-FAILED")
    # the next start does not spend another build on it, and says how to retry
    values, line = machine.detect()
    assert values["backend"] == "cpu"
    assert "the cuda build failed on an earlier run" in line and f"delete {marker}" in line
    again = machine.run("wheel")
    assert again.returncode == 0 and len(log.read_text().splitlines()) == 2


def test_a_failed_build_of_the_users_cmake_args_is_not_replaced(machine: Machine) -> None:
    machine.nvidia(["9.0"])
    machine.cuda_toolkit(cublas=True)
    log = _fake_venv(machine, fail="GGML_CUDA")
    result = machine.run("wheel", CMAKE_ARGS="-DGGML_CUDA=on")
    assert result.returncode == 1
    assert "is yours, so there is no fallback" in result.stderr
    assert log.read_text().splitlines() == ["-DLLAVA_BUILD=OFF -DGGML_CUDA=on"]


def _vulkan_system(machine: Machine, *, layer_settings: bool) -> None:
    include = machine.root / "include"
    (include / "spirv" / "unified1").mkdir(parents=True)
    (include / "spirv" / "unified1" / "spirv.hpp").write_text("")
    (include / "vulkan").mkdir()
    (include / "vulkan" / "vulkan.h").write_text("")
    structs = "struct LayerSettingEXT {};\n" if layer_settings else "struct Viewport {};\n"
    (include / "vulkan" / "vulkan_structs.hpp").write_text(structs)
    for tool in ("glslc", "glslangValidator"):
        machine.prints(tool, "")
    machine.prints("ldconfig", "\tlibvulkan.so.1 (libc6,x86-64) => /usr/lib/libvulkan.so.1\n")


def test_a_vulkan_build_brings_newer_headers_than_debian_12s(machine: Machine) -> None:
    _vulkan_system(machine, layer_settings=False)
    log = _fake_venv(machine, fail="never")
    # the private copy of Debian 13's headers, as an earlier run left it (fetching is apt's)
    headers = machine.wheels / "vulkan-headers-1.4.309.0-1"
    (headers / "usr" / "include" / "vulkan").mkdir(parents=True)
    (headers / "usr" / "include" / "vulkan" / "vulkan.hpp").write_text("")
    result = machine.run("wheel", CMAKE_ARGS="-DGGML_VULKAN=on")
    assert result.returncode == 0, result.stderr
    assert log.read_text().splitlines() == [
        f"-DLLAVA_BUILD=OFF -DGGML_VULKAN=on -DVulkan_INCLUDE_DIR={headers}/usr/include"
    ]
    assert "/llama-cpp-python-0.3.36-vulkan-" in result.stdout


def test_new_enough_system_headers_are_used_as_they_are(machine: Machine) -> None:
    _vulkan_system(machine, layer_settings=True)
    log = _fake_venv(machine, fail="never")
    result = machine.run("wheel", CMAKE_ARGS="-DGGML_VULKAN=on")
    assert result.returncode == 0, result.stderr
    assert log.read_text().splitlines() == ["-DLLAVA_BUILD=OFF -DGGML_VULKAN=on"]


def test_a_vulkan_build_without_its_packages_names_them(machine: Machine) -> None:
    log = _fake_venv(machine, fail="never")
    result = machine.run("wheel", CMAKE_ARGS="-DGGML_VULKAN=on")
    assert result.returncode == 1
    assert "sudo apt-get install glslc glslang-tools spirv-headers" in result.stderr
    assert not log.exists()


def test_the_launcher_records_the_backend_for_localspec(tmp_path: Path) -> None:
    """ensure_env writes $VENV/.localspec-backend when it installs llama.cpp (read by plan)."""
    text = (ROOT / "launcher" / "bootstrap.sh").read_text()
    assert '"$VENV/.localspec-backend"' in text
    # sourced and run: record_backend alone, on a fake choice
    venv = tmp_path / "venv"
    venv.mkdir()
    script = (
        f'. "{ROOT}/launcher/bootstrap.sh"; BACKEND=vulkan; CMAKE_ARGS=-DGGML_VULKAN=on; '
        f'WHEELHOUSE=/w; VENV="{venv}"; record_backend'
    )
    subprocess.run(["sh", "-c", script, str(BACKEND)], check=True, env={**os.environ})
    assert (venv / ".localspec-backend").read_text() == (
        "backend=vulkan\ncmake_args=-DGGML_VULKAN=on\nfallback=\nwheelhouse=/w\n"
    )


def test_cuda_from_the_wheels_links_its_runtime_beside_llama_cpp(tmp_path: Path) -> None:
    """llama.cpp's CUDA library looks beside itself ($ORIGIN) for cudart and cuBLAS: the
    launcher links them there from the build-only toolkit folder, also for a wheel an earlier
    run built."""
    wheels = tmp_path / "wheels"
    lib = wheels / "cuda-toolkit-13.0" / "cuda" / "lib"
    lib.mkdir(parents=True)
    for name in ("libcudart.so.13", "libcublas.so.13", "libcublasLt.so.13", "libnvrtc.so.13"):
        (lib / name).write_text(name)
    llama_lib = tmp_path / "site" / "llama_cpp" / "lib"
    llama_lib.mkdir(parents=True)
    venv_bin = tmp_path / "venv" / "bin"
    venv_bin.mkdir(parents=True)
    (venv_bin / "python").write_text(f"#!/bin/sh\necho {llama_lib}\n")
    (venv_bin / "python").chmod(0o755)
    script = (
        f'. "{ROOT}/launcher/bootstrap.sh"; VENV="{tmp_path / "venv"}"; BACKEND=cuda; '
        "CUDA_PLAN=wheels; CUDA_DRIVER=13.0; link_cuda_runtime"
    )
    env = {**os.environ, "LOCALSPEC_WHEELHOUSE": str(wheels)}
    subprocess.run(["sh", "-c", script, str(BACKEND)], check=True, env=env)
    linked = {p.name: p.resolve() for p in llama_lib.iterdir()}
    assert linked == {
        "libcudart.so.13": lib / "libcudart.so.13",
        "libcublas.so.13": lib / "libcublas.so.13",
        "libcublasLt.so.13": lib / "libcublasLt.so.13",
    }
