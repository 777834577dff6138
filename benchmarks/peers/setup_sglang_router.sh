#!/usr/bin/env bash
# sglang-router (the Rust router SGLang ships on PyPI) in its own virtual environment, outside .venv:
#   bash benchmarks/peers/setup_sglang_router.sh     # -> $PEERS_DIR/sglang-router (default ~/.cache/rivulet-peers)
# It routes any OpenAI-compatible workers, so benchmarks/router.py runs it in front of `rivulet serve` replicas:
#   $PEERS_DIR/sglang-router/bin/python -m sglang_router.launch_router --worker-urls URL ... --policy cache_aware
set -euo pipefail
PEERS_DIR=${PEERS_DIR:-$HOME/.cache/rivulet-peers}
VENV=$PEERS_DIR/sglang-router
VERSION=0.3.2
mkdir -p "$PEERS_DIR"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "sglang-router==$VERSION"
"$VENV/bin/python" -c "import sglang_router; print('sglang-router', '$VERSION', 'in', '$VENV')"
