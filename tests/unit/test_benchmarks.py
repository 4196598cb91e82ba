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


def _e2e_module():
    sys.path.insert(0, str(ROOT))
    import importlib

    return importlib.import_module("benchmarks.e2e_dpo")


@pytest.mark.parametrize("limit, start, want_probes, want", [
    (3072, 2048, [2048, 3072, 4096], (3072, 4096)),  # the prediction fits: walk up to the first OOM
    (2048, 3072, [3072, 2048], (2048, 3072)),        # the prediction does not fit: walk down
    (9999, 2048, [2048, 3072, 4096], (4096, None)),  # out of probes before an OOM: no bracket claimed
])
def test_verify_boundary_brackets_the_longest_length(monkeypatch, limit, start, want_probes, want):
    e2e = _e2e_module()
    calls = []

    def fake_launch(args, config, length, tag, **steps):
        calls.append(length)
        return {"status": "ok" if length <= limit else "OOM", "peak_gib": 1.0}

    monkeypatch.setattr(e2e, "launch", fake_launch)
    args = e2e.parse_args(["--device", "cpu", "--tiny", "--search_step", "1024", "--verify_probes", "3"])
    out = e2e.verify_boundary(args, "ours_fused", start)
    assert calls == want_probes
    assert (out["longest_fit"], out["shortest_oom"]) == want


def test_kernel_kinds_of_a_profile():
    e2e = _e2e_module()
    assert e2e.kernel_kind("nvjet_hsh_256x128_64x4_2x1_v_bz_coopB_TNT") == "GEMM"
    assert e2e.kernel_kind("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma") == "attention"
    assert e2e.kernel_kind("bwd_chunk_kernel") == "head element-wise"
    assert e2e.kernel_kind("triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_0") == "compiled element-wise (inductor)"
    assert e2e.kernel_kind("void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor>") == "optimizer and clipping"
    assert e2e.kernel_kind("void at::native::vectorized_elementwise_kernel<4, copy>").startswith("other")
