#!/usr/bin/env bash
# Builds llama.cpp's `llama-server` (and, with TARGETS, other tools such as llama-bench) from the llama.cpp that
# llama-cpp-python vendors, so the bench's llama.cpp peer runs the very kernels the llama.cpp backend links.
#
#   scripts/build_llama_server.sh [SDIST.tar.gz]
#
# Without a path it fetches the pinned sdist with pip. The binary lands in
# $DRAFTWISE_HOME/llama.cpp/<version>/bin/ (default ~/.cache/draftwise); a second run with the binary present
# does nothing. CPU build, Release, tuned to this machine (GGML_NATIVE), only the named targets.
# Environment: LLAMA_CPP_PYTHON_VERSION (default 0.3.36), TARGETS (default llama-server), JOBS (default 2),
# PYTHON (default python3, for `pip download`).
set -euo pipefail

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
TARGETS="${TARGETS:-llama-server}"
JOBS="${JOBS:-2}"
PYTHON="${PYTHON:-python3}"
HOME_DIR="${DRAFTWISE_HOME:-$HOME/.cache/draftwise}"
PREFIX="$HOME_DIR/llama.cpp/$VERSION"
BIN="$PREFIX/bin"

missing=()
for target in $TARGETS; do
    [ -x "$BIN/$target" ] || missing+=("$target")
done
if [ ${#missing[@]} -eq 0 ]; then
    echo "already built: $BIN ($TARGETS)"
    exit 0
fi

SRC="$PREFIX/src"
if [ ! -f "$SRC/CMakeLists.txt" ]; then
    SDIST="${1:-}"
    WORK="$(mktemp -d)"
    trap 'rm -rf "$WORK"' EXIT
    if [ -z "$SDIST" ]; then
        echo "fetching llama-cpp-python==$VERSION source ..."
        "$PYTHON" -m pip download -q --no-deps --no-binary=:all: -d "$WORK" "llama-cpp-python==$VERSION"
        SDIST="$(ls "$WORK"/llama_cpp_python-*.tar.gz)"
    fi
    # Only the vendored llama.cpp is needed; the Python package around it is not.
    top="$(tar -tzf "$SDIST" | awk -F/ 'NR == 1 { print $1 }')"  # awk reads it all: no SIGPIPE under pipefail
    tar -xzf "$SDIST" -C "$WORK" "$top/vendor/llama.cpp"
    mkdir -p "$PREFIX"
    rm -rf "$SRC"
    mv "$WORK/$top/vendor/llama.cpp" "$SRC"
fi

# Shared libraries off so the binaries carry their own ggml and do not pick up another copy at run time.
# No network at build or run time: the bench hands the server local files only (no curl/openssl), and the
# web UI is neither built (needs npm) nor downloaded prebuilt.
# No AMX (the macro -march=native defines is taken away): the vendored ggml's AMX path dies at its first tile
# instruction (SIGILL) on Xeons that have AMX (llama.cpp PR 26954), as in the Makefile's build of llama-cpp-python.
cmake -S "$SRC" -B "$SRC/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF \
      -DCMAKE_C_FLAGS=-U__AMX_INT8__ -DCMAKE_CXX_FLAGS=-U__AMX_INT8__ \
      -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON
start=$(date +%s)
for target in "${missing[@]}"; do
    cmake --build "$SRC/build" --config Release --target "$target" -j "$JOBS"
    mkdir -p "$BIN"
    cp "$SRC/build/bin/$target" "$BIN/$target"
done
echo "built ${missing[*]} in $(( $(date +%s) - start ))s: $BIN"
