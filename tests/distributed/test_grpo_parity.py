"""GRPO on DDP, ZeRO-2, ZeRO-3 and FSDP2 (2 CPU processes, gloo) equals a single-process unfused run.

Completions are replayed (tests/grpo_replay.py: uneven lengths, some truncated, a reward that
varies within every group), so the comparison is of the training maths alone: generation
batches of 2 prompts x 4 generations split 2 ranks x 4 against 1 process x 8, groups whole
after the reward gather. Per step: the loss, the rewards, KL and entropy; at the end every
weight, to 1e-5. Plus beta > 0 with a separate reference and with the policy's adapter
disabled (LoRA on lm_head), an all-masked step, and real generation with keyed sampling
(the same draws on any split) under ZeRO-3 and FSDP2, a training step after every generation.
"""

from __future__ import annotations

import pytest

from tests.distributed.parity import BACKENDS, assert_same_training, lazy_runs, result

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

GRPO = {"trainer": "grpo", "steps": 3}
LORA = {"peft": True, "lora_target_modules": ["q_proj", "v_proj", "lm_head"], "init_lora_weights": False}

BASELINE = [
    {**GRPO, "name": "dapo", "fused": False, "per_device_batch": 8},
    {**GRPO, "name": "dapo_fused", "fused": True, "per_device_batch": 8},
    {**GRPO, "name": "grpo_kl", "fused": False, "per_device_batch": 8, "loss_type": "grpo", "beta": 0.1,
     "top_entropy_quantile": 0.5},
    {**GRPO, "name": "lora_kl", "fused": False, "per_device_batch": 8, "beta": 0.1, **LORA},
    {**GRPO, "name": "masked", "fused": False, "per_device_batch": 8, "truncate_every": 1,
     "mask_truncated_completions": True},
    {**GRPO, "name": "keyed", "fused": False, "per_device_batch": 8, "keyed": True},
]
_common = [
    ({**GRPO, "name": "fused", "fused": True, "per_device_batch": 4}, "dapo"),
    ({**GRPO, "name": "unfused", "fused": False, "per_device_batch": 4}, "dapo"),
    ({**GRPO, "name": "masked", "fused": True, "per_device_batch": 4, "truncate_every": 1,
      "mask_truncated_completions": True}, "masked"),
]
_kl = ({**GRPO, "name": "grpo_kl", "fused": True, "per_device_batch": 4, "loss_type": "grpo", "beta": 0.1,
        "top_entropy_quantile": 0.5}, "grpo_kl")
_lora = ({**GRPO, "name": "lora_kl", "fused": True, "per_device_batch": 4, "beta": 0.1, **LORA}, "lora_kl")
_keyed = ({**GRPO, "name": "keyed", "fused": True, "per_device_batch": 4, "keyed": True}, "keyed")
SCENARIOS = {
    "ddp": _common + [_lora],
    "zero2": _common + [_kl],
    "zero3": _common + [_kl, _lora, _keyed],
    "fsdp2": _common + [_kl, _lora, _keyed],
}
CASES = [(backend, spec["name"], want) for backend in BACKENDS for spec, want in SCENARIOS[backend]]
COMPARED = ("reward", "reward_std", "kl", "entropy", "completions/mean_length", "clip_ratio/region_mean")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return lazy_runs(tmp_path_factory.mktemp("grpo_parity"), BASELINE, SCENARIOS)


def _assert_same_history(got: dict, want: dict) -> None:
    assert len(got["history"]) == len(want["history"]) == 3
    for step, (g, w) in enumerate(zip(got["history"], want["history"]), 1):
        for key in COMPARED:
            if key in w:
                assert abs(g[key] - w[key]) <= 1e-5 * abs(w[key]) + 1e-6, (step, key, g[key], w[key])


def test_baseline_fused_equals_unfused_and_masked_steps_train_nothing(runs):
    single = runs(None)
    assert_same_training(single, "dapo_fused", single, "dapo", backend=None)
    _assert_same_history(result(single, "dapo_fused"), result(single, "dapo"))
    assert result(single, "grpo_kl")["history"][1]["kl"] > 0 and result(single, "lora_kl")["history"][0]["kl"] > 0
    assert result(single, "masked")["losses"] == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("backend,name,want", CASES, ids=[f"{b}-{n}" for b, n, _ in CASES])
def test_backend_equals_single_process_unfused(runs, backend, name, want):
    got, baseline = runs(backend), runs(None)
    assert_same_training(got, name, baseline, want, backend=backend)
    _assert_same_history(result(got, name), result(baseline, want))
