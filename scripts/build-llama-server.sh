#!/usr/bin/env bash
# Build llama.cpp's llama-server (the benchmark anchor) from the sources vendored in the
# llama-cpp-python sdist that localspec pins, into a directory OUTSIDE the repository.
#
#   scripts/build-llama-server.sh            # build (downloads the sdist if needed)
#   export LLAMA_SERVER_BIN="$(scripts/build-llama-server.sh --print-bin)"
#
# Environment knobs:
#   LCP_VERSION   llama-cpp-python version whose vendored llama.cpp is built (default 0.3.36)
#   LCP_SRC       an unpacked sdist directory (default: $CACHE/src/llama_cpp_python-$LCP_VERSION,
#                 or /tmp/lcp/llama_cpp_python-$LCP_VERSION when that exists)
#   CACHE         where sources, build tree and binary live (default ~/.cache/localspec)
#   JOBS          parallel compile jobs (default 2)
#   PYTHON        python with pip, used to fetch the sdist (default .venv/bin/python or python3)
#   CMAKE_EXTRA   extra cmake configure flags (e.g. "-DGGML_CUDA=ON")
set -euo pipefail

LCP_VERSION="${LCP_VERSION:-0.3.36}"
CACHE="${CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/localspec}"
BUILD_DIR="$CACHE/llama-server-build"
BIN="$BUILD_DIR/bin/llama-server"
JOBS="${JOBS:-2}"

if [[ "${1:-}" == "--print-bin" ]]; then
    echo "$BIN"
    exit 0
fi

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-}"
if [[ -z "$PYTHON" ]]; then
    if [[ -x "$repo_root/.venv/bin/python" ]]; then PYTHON="$repo_root/.venv/bin/python"; else PYTHON=python3; fi
fi

if [[ -z "${LCP_SRC:-}" ]]; then
    if [[ -d "/tmp/lcp/llama_cpp_python-$LCP_VERSION/vendor/llama.cpp" ]]; then
        LCP_SRC="/tmp/lcp/llama_cpp_python-$LCP_VERSION"
    else
        LCP_SRC="$CACHE/src/llama_cpp_python-$LCP_VERSION"
    fi
fi

if [[ ! -d "$LCP_SRC/vendor/llama.cpp" ]]; then
    echo "==> fetching the llama-cpp-python $LCP_VERSION sdist"
    mkdir -p "$CACHE/src"
    "$PYTHON" -m pip download --no-deps --no-binary :all: "llama-cpp-python==$LCP_VERSION" -d "$CACHE/src"
    tar xzf "$CACHE/src/llama_cpp_python-$LCP_VERSION.tar.gz" -C "$CACHE/src"
    LCP_SRC="$CACHE/src/llama_cpp_python-$LCP_VERSION"
fi

echo "==> configuring llama-server from $LCP_SRC/vendor/llama.cpp into $BUILD_DIR"
# shellcheck disable=SC2086
cmake -S "$LCP_SRC/vendor/llama.cpp" -B "$BUILD_DIR" \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DGGML_NATIVE=ON -DCMAKE_BUILD_TYPE=Release ${CMAKE_EXTRA:-}

echo "==> building (nice, $JOBS jobs; several minutes on a small machine)"
nice -n 10 cmake --build "$BUILD_DIR" --target llama-server -j"$JOBS"

echo "==> done: $BIN"
echo "export LLAMA_SERVER_BIN=$BIN"
