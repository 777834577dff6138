#!/usr/bin/env bash
# Wheels of what Rivulet needs beyond the GPU machine's own torch, triton and transformers (msgspec, pyzmq,
# gguf, xgrammar and their needs), for a GPU machine that cannot reach a package registry. Versions are
# this checkout's .venv's; the machine's Python is 3.12 unless PYVER says otherwise.
#
#   bash benchmarks/gpu/fetch_wheels.sh [DEST]          # DEST defaults to ./.whl
#   # there: python3 -m pip install --no-index --no-deps --target /tmp/site DEST/*.whl
#   #        PYTHONPATH=/tmp/site bash benchmarks/gpu/run.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
DEST=${1:-.whl}
PYVER=${PYVER:-3.12}
PKGS="msgspec pyzmq gguf xgrammar apache-tvm-ffi pydantic pydantic-core annotated-types typing-inspection typing-extensions"
mkdir -p "$DEST"
plat=()
for p in manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_24_x86_64 manylinux_2_26_x86_64 \
         manylinux_2_27_x86_64 manylinux_2_28_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64 any; do
    plat+=(--platform "$p")
done
for name in $PKGS; do
    pin=$(.venv/bin/python -m pip freeze 2>/dev/null | grep -i "^${name//-/[-_]}==" || true)
    [[ -n $pin ]] || { echo "error: $name is not installed in .venv (run scripts/setup.sh test first)" >&2; exit 1; }
    .venv/bin/python -m pip download --quiet --no-deps --only-binary=:all: --python-version "$PYVER" \
        --implementation cp "${plat[@]}" -d "$DEST" "$pin" 2>&1 | grep -v "^WARNING: Location" || true
done
ls "$DEST"
