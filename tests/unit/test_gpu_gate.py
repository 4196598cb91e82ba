"""scripts/gpu_tests.sh runs the tests marked `gpu` or `cuda_path` in tests/unit. A test that CI
skips for want of CUDA and that has neither mark runs nowhere: this finds such tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA present: the skips this looks for do not happen here")
def test_every_test_skipped_for_want_of_cuda_is_in_the_gpu_gate(tmp_path):
    report = tmp_path / "orphans.txt"
    env = {**os.environ, "FUSEDALIGN_GATE_REPORT": str(report), "PYTHONWARNINGS": "ignore"}
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "tests.gate_coverage",
                           "-p", "no:cacheprovider", "tests"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    orphans = report.read_text()
    assert orphans == "", "skipped in CI for want of CUDA, and not marked gpu or cuda_path:\n" + orphans
