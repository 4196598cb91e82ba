"""SFT on DDP, ZeRO-2, ZeRO-3 and FSDP2 (2 CPU processes) equals a single-process unfused run.

Padded and packed batches, fused and unfused, and LoRA on attention and on the head, on
every backend: 3 SGD steps in fp32 over the same global batches (2 ranks x 2 rows
against 1 process x 4 rows); per-step losses and final weights to 1e-5 relative.
"""

from __future__ import annotations

import pytest

from tests.distributed.parity import BACKENDS, ROOT, assert_same_training, assert_weights_changed, lazy_runs, weights

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

SFT = {"trainer": "sft"}
LORA = {"peft": True, "lora_target_modules": ["q_proj", "v_proj", "lm_head"]}

BASELINE = [
    {**SFT, "name": "padded", "fused": False, "per_device_batch": 4},
    {**SFT, "name": "packed", "fused": False, "per_device_batch": 4, "packing": True},
    {**SFT, "name": "lora", "fused": False, "per_device_batch": 4, **LORA},
]
SCENARIOS = {
    backend: [
        ({**SFT, "name": "fused_padded", "fused": True, "per_device_batch": 2}, "padded"),
        ({**SFT, "name": "unfused_padded", "fused": False, "per_device_batch": 2}, "padded"),
        ({**SFT, "name": "fused_packed", "fused": True, "per_device_batch": 2, "packing": True}, "packed"),
        ({**SFT, "name": "unfused_packed", "fused": False, "per_device_batch": 2, "packing": True}, "packed"),
        ({**SFT, "name": "lora", "fused": True, "per_device_batch": 2, **LORA}, "lora"),
    ]
    for backend in BACKENDS
}
CASES = [(backend, spec["name"], want) for backend in BACKENDS for spec, want in SCENARIOS[backend]]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return lazy_runs(tmp_path_factory.mktemp("sft_parity"), BASELINE, SCENARIOS)


def test_baseline_trains(runs):
    from safetensors.torch import load_file

    initial = load_file(str(ROOT / "fusedalign" / "resources" / "models" / "tiny-qwen2" / "model.safetensors"))
    assert_weights_changed(runs(None), "padded", initial)
    assert_weights_changed(runs(None), "packed", initial)
    adapter = weights(runs(None), "lora")
    assert any("lm_head" in k and "lora_B" in k and adapter[k].abs().sum() > 0 for k in adapter)


@pytest.mark.parametrize("backend,name,want", CASES, ids=[f"{b}-{n}" for b, n, _ in CASES])
def test_backend_equals_single_process_unfused(runs, backend, name, want):
    assert_same_training(runs(backend), name, runs(None), want, backend=backend)
