#!/usr/bin/env bash
# Creates .venv with fusedalign and its test tools. Idempotent: a second run only
# reinstalls when pyproject.toml changed. Without an NVIDIA GPU it installs the CPU
# build of PyTorch first (a bare `torch` requirement would pull a multi-GB CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
stamp=.venv/.fusedalign-installed
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
fi
pip_install() { .venv/bin/python -m pip install --disable-pip-version-check -q "$@"; }
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        pip_install torch
    else
        pip_install "torch==2.13.0"
    fi
fi
pip_install -e ".[test]"
echo "$want" > "$stamp"
echo "fusedalign installed in .venv" >&2
