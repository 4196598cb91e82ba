"""The end-to-end benchmark's CPU smoke run: it trains, compares and rechecks.

The GPU numbers live in docs/benchmarks.md; this keeps the script working between GPU
sessions. Ours fused and ours unfused must pass the script's own agreement check.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "e2e_dpo.py"

pytestmark = pytest.mark.slow


def _run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *argv], cwd=str(ROOT), capture_output=True, text=True,
                          timeout=900)


def test_e2e_dpo_cpu_smoke_agrees_and_rechecks(tmp_path):
    proc = _run("--device", "cpu", "--tiny", "--configs", "ours_fused", "ours_unfused", "--log_dir", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "  agree" in proc.stdout and "COMPARISON VOID" not in proc.stdout, proc.stdout[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())["results"]["64"]
    assert {r["status"] for r in results.values()} == {"ok"}
    assert all(r["tokens_per_s"] > 0 and len(r["logs"]) == 3 for r in results.values())

    again = _run("--device", "cpu", "--recheck", str(tmp_path / "results.json"))
    assert again.returncode == 0 and "  agree" in again.stdout, again.stdout[-3000:]
    # A tolerance no difference can meet voids the comparison, and says so.
    strict = _run("--device", "cpu", "--recheck", str(tmp_path / "results.json"), "--loss_atol", "-1")
    assert strict.returncode == 1 and "COMPARISON VOID" in strict.stdout, strict.stdout[-3000:]
