"""KTO on DDP, ZeRO-2, ZeRO-3 and FSDP2 (2 CPU processes) equals a single-process unfused run.

Every forward KTO makes — completions and the mismatched KL pairs, for the policy and
the reference — goes through the fused head. The reference is a different model
(builtin:tiny-llama, same tokenizer) so the KL reference point z0 is non-zero from the
first step and the KL path is really exercised. 3 SGD steps, fp32, 2 ranks x 2 rows
against 1 process x 4 rows; per-step losses, eval metrics and final weights to 1e-5; padded
and padding-free rows.
"""

from __future__ import annotations

import pytest

from tests.distributed.parity import (
    BACKENDS,
    ROOT,
    assert_same_training,
    assert_weights_changed,
    lazy_runs,
    result,
)

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

KTO = {"trainer": "kto", "ref_model": "builtin:tiny-llama"}

BASELINE = [
    {**KTO, "name": "unfused", "fused": False, "per_device_batch": 4, "evaluate": True},
    {**KTO, "name": "precompute", "fused": True, "per_device_batch": 4, "precompute": True, "evaluate": True},
]
_common = [
    ({**KTO, "name": "fused", "fused": True, "per_device_batch": 2, "evaluate": True}, "unfused"),
    ({**KTO, "name": "unfused", "fused": False, "per_device_batch": 2, "evaluate": True}, "unfused"),
    # Padding-free rows (completions, KL partners, and the reference's joint row, its prompt shared
    # in the fused scenario).
    ({**KTO, "name": "packed_fused", "fused": True, "per_device_batch": 2, "evaluate": True,
      "padding_free": True, "share_prompt": True}, "unfused"),
    ({**KTO, "name": "packed_unfused", "fused": False, "per_device_batch": 2, "padding_free": True}, "unfused"),
]
# One step, then evaluation of 27 rows: 2 ranks x 2 leave a last batch that accelerate evens out by
# repeating a row, which the per-example metrics must drop.
ODD_EVAL = {**KTO, "name": "odd_eval_packed", "fused": True, "evaluate": True, "eval_rows": 27, "steps": 1,
            "padding_free": True, "share_prompt": True}
ODD_EVAL_PADDED = {**ODD_EVAL, "name": "odd_eval", "padding_free": False, "share_prompt": False}
BASELINE += [{**ODD_EVAL, "per_device_batch": 4}, {**ODD_EVAL_PADDED, "per_device_batch": 4}]
SCENARIOS = {
    "ddp": _common + [({**ODD_EVAL, "per_device_batch": 2}, None), ({**ODD_EVAL_PADDED, "per_device_batch": 2}, None)],
    "zero2": list(_common),
    "zero3": _common + [
        ({**KTO, "name": "precompute", "fused": True, "per_device_batch": 2, "precompute": True, "evaluate": True},
         "unfused"),
    ],
    "fsdp2": list(_common),
}
CASES = [(backend, spec["name"], want) for backend in BACKENDS for spec, want in SCENARIOS[backend] if want]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return lazy_runs(tmp_path_factory.mktemp("kto_parity"), BASELINE, SCENARIOS)


def test_baseline_trains_and_precompute_equals_reference_forward(runs):
    from safetensors.torch import load_file

    initial = load_file(str(ROOT / "fusedalign" / "resources" / "models" / "tiny-qwen2" / "model.safetensors"))
    assert_weights_changed(runs(None), "unfused", initial)
    assert result(runs(None), "unfused")["eval"]["eval_kl"] > 0  # the KL term is live
    assert_same_training(runs(None), "precompute", runs(None), "unfused", backend=None)


@pytest.mark.parametrize("backend,name,want", CASES, ids=[f"{b}-{n}" for b, n, _ in CASES])
def test_backend_equals_single_process_unfused(runs, backend, name, want):
    assert_same_training(runs(backend), name, runs(None), want, backend=backend)


UNEVEN_KEYS = ("eval_rewards/chosen", "eval_rewards/rejected", "eval_logps/chosen")


@pytest.mark.parametrize("name", [ODD_EVAL_PADDED["name"], ODD_EVAL["name"]])
def test_eval_metrics_ignore_rows_repeated_to_even_out_ranks(runs, name):
    """Padded and packed: DDP's metrics over 27 rows (a row repeated to even out the ranks) are one process's."""
    want, got = result(runs(None), name)["eval"], result(runs("ddp"), name)["eval"]
    assert got["eval_count/desirable"] + got["eval_count/undesirable"] == 27
    for key in UNEVEN_KEYS:
        assert abs(got[key] - want[key]) <= 1e-5 * abs(want[key]) + 1e-6, (key, got[key], want[key])
