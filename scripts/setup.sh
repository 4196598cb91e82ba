#!/usr/bin/env bash
# Creates .venv with fusedalign and its test tools. Idempotent: a second run only
# reinstalls when pyproject.toml or this script changed. Without an NVIDIA GPU it installs the CPU
# build of PyTorch first (a bare `torch` requirement would pull a multi-GB CUDA build), and builds
# DeepSpeed's CPU extension once, saying so, instead of the first distributed launch doing it.
set -euo pipefail
self="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
stamp=.venv/.fusedalign-installed
want=$(cat pyproject.toml "$self" | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
fi
pip_install() { .venv/bin/python -m pip install --disable-pip-version-check -q "$@"; }
gpu=false
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    gpu=true
fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    if $gpu; then
        pip_install torch
    else
        pip_install "torch==2.13.0"
    fi
fi
pip_install -e ".[test]"
if ! $gpu && ! .venv/bin/python -c "import triton" 2>/dev/null; then
    # No GPU: the CPU build of torch brings no Triton, and without it the tests of our
    # Triton kernels (run under Triton's CPU interpreter) would all be skipped. 3.6 is the
    # interpreter tests/unit/test_ops_triton.py patches for.
    pip_install "triton==3.6.0"
fi
if ! $gpu; then
    # DeepSpeed compiles its CPU communication extension at its first CPU launch (0.5-4 min,
    # silently); do it here, once, where it is expected. Torch caches it in
    # ${TORCH_EXTENSIONS_DIR:-~/.cache/torch_extensions}/py*_cpu/deepspeed_shm_comm.
    .venv/bin/python -m fusedalign.distributed.extensions
fi
# `fusedalign <command> --help` renders the real parser once and caches the text.
.venv/bin/python -m fusedalign.cli.help
echo "$want" > "$stamp"
echo "fusedalign installed in .venv" >&2
