"""The fused divergence with both heads under the backend: 2 CPU processes equal 1 process unfused.

tests/distributed/run_distill_head.py trains a tiny Qwen2 student against a tiny Gemma 2
teacher (another architecture, its logits soft-capped at 0.5 so that the cap matters) with the
generalised JSD (beta 0.5, temperature 0.1: sharp enough for the weights to move), 3 SGD steps,
the same global batch of 4 rows: one process unfused (both models' full logits, TRL's formula)
against 2 ranks x 2 rows with the fused heads, per step loss and entropy, and final weights.
Under ZeRO-3 the teacher is a DeepSpeed inference engine holding 1/2 of each parameter; under
FSDP2 `prepare_reference_model` shards it per layer and root like the student; under DDP and
ZeRO-2 each rank holds a whole copy. Under ZeRO-3 and FSDP2, with LoRA on the student's head the adapter trains the same.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.distributed.parity import CPU_CONFIGS, EXPECTED_WRAPPER, ROOT, RTOL, _free_port, weights

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

RUNNER = ROOT / "tests" / "distributed" / "run_distill_head.py"
BASE = {"teacher_softcap": 0.5, "temperature": 0.1, "beta": 0.5, "steps": 3}
SINGLE = [{**BASE, "name": "plain", "fused": False, "per_device_batch": 4},
          {**BASE, "name": "lora", "fused": False, "per_device_batch": 4, "lora_head": True}]
SCENARIOS = {
    "ddp": [{**BASE, "name": "plain", "fused": True, "per_device_batch": 2}],
    "zero2": [{**BASE, "name": "plain", "fused": True, "per_device_batch": 2}],
    "zero3": [{**BASE, "name": "plain", "fused": True, "per_device_batch": 2},
              {**BASE, "name": "lora", "fused": True, "per_device_batch": 2, "lora_head": True}],
    "fsdp2": [{**BASE, "name": "plain", "fused": True, "per_device_batch": 2},
              {**BASE, "name": "lora", "fused": True, "per_device_batch": 2, "lora_head": True}],
}


def _launch(specs: list[dict], out: Path, backend: str | None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "specs.json").write_text(json.dumps(specs))
    cmd = [sys.executable, str(RUNNER)]
    if backend is not None:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CPU_CONFIGS / f"{backend}.yaml"),
               "--main_process_port", str(_free_port()), str(RUNNER)]
    cmd += ["--spec", str(out / "specs.json"), "--out", str(out)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, cwd=str(ROOT), env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    out = tmp_path_factory.mktemp("distill_single")
    _launch(SINGLE, out, None)
    return out


@pytest.mark.parametrize("backend", ["ddp", "zero2", "zero3", "fsdp2"])
def test_fused_both_heads_under_the_backend_equal_one_process_unfused(backend, single, tmp_path):
    out = tmp_path / backend
    _launch(SCENARIOS[backend], out, backend)
    for name in [spec["name"] for spec in SCENARIOS[backend]]:
        got = json.loads((out / name / "result.json").read_text())
        want = json.loads((single / name / "result.json").read_text())
        dist_type, wrapper = EXPECTED_WRAPPER[backend]
        assert got["world_size"] == 2 and got["distributed_type"] == dist_type, got
        if wrapper:
            assert got["wrapper"] == wrapper, got
        # Where the backend splits a frozen model, the teacher's head really was split over the ranks.
        assert got["teacher_partitioned"] == (backend in ("zero3", "fsdp2")), got
        assert len(got["losses"]) == 3 and want["losses"][0] > 0.1  # a divergence worth training on
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]), rtol=RTOL, atol=1e-7)
        torch.testing.assert_close(torch.tensor(got["entropy"]), torch.tensor(want["entropy"]), rtol=RTOL, atol=1e-6)
        _same_weights(weights(out, name), weights(single, name))


def _same_weights(got_w: dict, want_w: dict) -> None:
    if "lm_head.weight" in set(got_w) - set(want_w):  # FSDP2's full state dict writes a tied head
        got_w.pop("lm_head.weight")
    if any("lora_" in k for k in want_w):
        assert any("lm_head" in k and "lora_" in k for k in want_w)
        want_w = {k: v for k, v in want_w.items() if k in got_w}
        assert {k for k in got_w if "lora_" in k} == {k for k in want_w if "lora_" in k}
    assert set(got_w) == set(want_w), set(got_w) ^ set(want_w)
    for key, value in want_w.items():
        torch.testing.assert_close(got_w[key], value, rtol=RTOL, atol=1e-6, msg=lambda m, k=key: f"{k}: {m}")


def test_the_weights_moved(single):
    """Guards against a vacuous comparison: the baseline's training changed the student's weights."""
    from fusedalign.models import load_model

    initial = load_model("builtin:tiny-qwen2").state_dict()
    final = weights(single, "plain")
    moved = [k for k in final if k in initial and not torch.allclose(final[k], initial[k], atol=1e-4)]
    assert "lm_head.weight" in moved and len(moved) > len(final) // 2, moved
