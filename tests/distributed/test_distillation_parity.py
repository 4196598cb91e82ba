"""Distillation on DDP, ZeRO-2, ZeRO-3 and FSDP2 (2 CPU processes, gloo) equals a single-process unfused run.

Replayed completions (tests/grpo_replay.py, one a prompt), 8 prompts a step split 2 ranks x 4
against 1 process x 8. Both heads run in the loss, so both models are exercised under each
backend: the student trained (its head's gradient reduced), the teacher a frozen copy
prepared the backend's way (a DeepSpeed inference engine under ZeRO-3, an FSDP2 module), its
head gathered by its own hooks when the student's head calls it. Scenarios: `jsd`, beta 0.5
at temperature 0.8 with the zen teacher (another architecture, a tied head), fused and
unfused on every backend; `softcap_lora`, reverse KL (beta 1) from a soft-capped teacher
(tiny-gemma2, its cap lowered to 0.5 so that it changes the logits) into a student with LoRA
on q/v and on its head, fused; `packed`, the `jsd` run
on packed rows (padding_free, a token budget: each rank's 4 sequences of a step in its 2
forwards, 2 ranks x accumulation 2 x batch 2), fused, against the padded unfused 1 x 1 x 8
run, the teacher and the student reading the same row; `packed_parts`, the same with one micro-batch
a step and a budget of one sequence (21 tokens), so that each micro-batch is trained in parts,
one forward of each model and one backward a part, as many on each rank. Per step: the loss and
the entropy; at the end every weight, to 1e-5. The normaliser is the step's completion tokens
over both ranks, and rank 0's and rank 1's rows hold different numbers of tokens.
"""

from __future__ import annotations

import pytest

from tests.distributed.parity import BACKENDS, assert_same_training, lazy_runs, result

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

BASE = {"trainer": "distillation", "steps": 3, "lr": 0.5}
PARTS_BUDGET = 21  # the longest prompt (9 tokens) + max_completion_length (12): the least it takes
JSD = {**BASE, "beta": 0.5, "temperature": 0.8}
# The teacher's cap lowered from 30 to 0.5 (a from_pretrained config override): the tiny model's logits
# (|z| < 1) are too flat for a cap of 30 to change anything, and a cap that changes nothing proves nothing.
SOFTCAP = {**BASE, "beta": 1.0, "teacher": "builtin:tiny-gemma2", "teacher_kwargs": {"final_logit_softcapping": 0.5},
           "peft": True, "lora_target_modules": ["q_proj", "v_proj", "lm_head"]}

BASELINE = [
    {**JSD, "name": "jsd", "fused": False, "per_device_batch": 8},
    {**JSD, "name": "jsd_fused", "fused": True, "per_device_batch": 8},
    {**SOFTCAP, "name": "softcap_lora", "fused": False, "per_device_batch": 8},
    {**SOFTCAP, "name": "uncapped_lora", "fused": False, "per_device_batch": 8,
     "teacher_kwargs": {"final_logit_softcapping": None}},
]
_scenarios = [({**JSD, "name": "jsd", "fused": True, "per_device_batch": 4}, "jsd"),
              ({**JSD, "name": "jsd_unfused", "fused": False, "per_device_batch": 4}, "jsd"),
              ({**SOFTCAP, "name": "softcap_lora", "fused": True, "per_device_batch": 4}, "softcap_lora"),
              ({**JSD, "name": "packed", "fused": True, "per_device_batch": 2, "grad_accum": 2, "padding_free": True,
                "max_tokens_per_batch": 40}, "jsd"),
              ({**JSD, "name": "packed_parts", "fused": True, "per_device_batch": 4, "grad_accum": 1,
                "padding_free": True, "max_tokens_per_batch": PARTS_BUDGET}, "jsd")]
SCENARIOS = {backend: _scenarios for backend in BACKENDS}
CASES = [(backend, spec["name"], want) for backend in BACKENDS for spec, want in SCENARIOS[backend]]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return lazy_runs(tmp_path_factory.mktemp("distillation_parity"), BASELINE, SCENARIOS)


def _assert_same_entropy(got: dict, want: dict) -> None:
    g, w = [r["entropy"] for r in got["history"]], [r["entropy"] for r in want["history"]]
    assert len(g) == len(w) == 3 and all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(g, w)), (g, w)


def test_baseline_fused_equals_unfused_and_training_moves(runs):
    single = runs(None)
    assert_same_training(single, "jsd_fused", single, "jsd", backend=None)
    _assert_same_entropy(result(single, "jsd_fused"), result(single, "jsd"))
    for name in ("jsd", "softcap_lora"):
        losses = result(single, name)["losses"]
        assert len(set(losses)) == 3 and all(v > 0 for v in losses), (name, losses)
    # The cap bites: without it the same run's divergence differs well beyond the parity tolerance.
    capped, uncapped = result(single, "softcap_lora")["losses"][0], result(single, "uncapped_lora")["losses"][0]
    assert abs(capped - uncapped) > 1e-2 * abs(uncapped), (capped, uncapped)


@pytest.mark.parametrize("backend,name,want", CASES, ids=[f"{b}-{n}" for b, n, _ in CASES])
def test_backend_equals_single_process_unfused(runs, backend, name, want):
    got, baseline = runs(backend), runs(None)
    assert_same_training(got, name, baseline, want, backend=backend)
    _assert_same_entropy(result(got, name), result(baseline, want))
    packed = "PackedDistillationBatch" if name.startswith("packed") else "DistillationBatch"
    assert result(got, name)["batch_types"] == [packed], result(got, name)["batch_types"]
    if name == "packed_parts":  # each step's one micro-batch in parts, as many on each rank, none over the budget
        forwards, largest = result(got, name)["forwards_per_rank"], result(got, name)["largest_forward_per_rank"]
        assert forwards[0] == forwards[1] > 3 and max(largest) <= PARTS_BUDGET, (forwards, largest)
