"""DPO on DDP, ZeRO-2, ZeRO-3 and FSDP2 (2 CPU processes, gloo) equals a single-process unfused run.

Each backend is launched once with `accelerate launch`; several scenarios train one
after another in the same processes. Every scenario trains 3 SGD steps in fp32 over the
same global batches (2 ranks x 2 pairs against 1 process x 4 pairs, sequential order)
and must reproduce the per-step losses, evaluation metrics and final weights of the
single-process unfused baseline to 1e-5 relative: padded rows, and padding-free rows with
the prompt computed once (`padding_free`, `share_prompt`), also by token budget; and LD-DPO
with an f-divergence (`ld_alpha` 0.5, `js_divergence`), padded and packed, which cut each
sequence at its pair's shared length inside each rank's micro-batch; and WPO's pair weights
(`use_weighting`), from each sequence's own tokens, padded and packed (both on ZeRO-3).
"""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

from tests.distributed.parity import (
    BACKENDS,
    ROOT,
    assert_same_training,
    assert_weights_changed,
    lazy_runs,
    result,
    weights,
)

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

DPO = {"trainer": "dpo"}

# Baseline: one process, unfused, 4 pairs per step.
BASELINE = [
    {**DPO, "name": "qwen2", "fused": False, "per_device_batch": 4, "evaluate": True},
    {**DPO, "name": "llama", "fused": False, "per_device_batch": 4, "model": "builtin:tiny-llama"},
    {**DPO, "name": "lora", "fused": False, "per_device_batch": 4, "peft": True},
    {**DPO, "name": "qwen2_fused", "fused": True, "per_device_batch": 4, "evaluate": True},
    {**DPO, "name": "grad_accum", "fused": True, "per_device_batch": 2, "grad_accum": 2, "evaluate": True},
    {**DPO, "name": "precompute", "fused": True, "per_device_batch": 4, "precompute": True, "evaluate": True},
    {**DPO, "name": "checkpointed", "fused": True, "per_device_batch": 4, "gradient_checkpointing": True},
    {**DPO, "name": "lora_compiled", "fused": True, "per_device_batch": 4, "peft": True, "compile": True},
    # The 8 first pairs in one padded batch a step: what the token-budget scenario must equal.
    {**DPO, "name": "rows8", "fused": False, "per_device_batch": 8, "train_rows": 8},
]

# Padding-free rows with the prompt computed once (one row of 2 pairs a rank), fused (the loss-aware
# head, per-sequence segments) and unfused.
PACKED = {"padding_free": True, "share_prompt": True}
# One step, then evaluation of 27 rows: 2 ranks x 2 leave a last batch that accelerate evens out by
# repeating a row, which the per-pair metrics must drop (the one-process run has none to drop).
ODD_EVAL = {**DPO, **PACKED, "name": "odd_eval_packed", "fused": True, "evaluate": True, "eval_rows": 27, "steps": 1}
ODD_EVAL_PADDED = {**ODD_EVAL, "name": "odd_eval", "padding_free": False, "share_prompt": False}
BASELINE += [{**ODD_EVAL, "per_device_batch": 4}, {**ODD_EVAL_PADDED, "per_device_batch": 4}]
# LD-DPO (the tokens past a pair's shared length weighted 0.5) with the JS f-divergence.
LD = {**DPO, "ld_alpha": 0.5, "f_divergence_type": "js_divergence"}
BASELINE.append({**LD, "name": "ld", "fused": False, "per_device_batch": 4})
_ld = [({**LD, "name": "ld_fused", "fused": True, "per_device_batch": 2}, "ld"),
       ({**LD, **PACKED, "name": "ld_packed_fused", "fused": True, "per_device_batch": 2}, "ld")]
# WPO: each pair's loss weighted by its sequences' mean of log p - log sum p^2 (the policy's own).
WPO = {**DPO, "use_weighting": True}
BASELINE.append({**WPO, "name": "wpo", "fused": False, "per_device_batch": 4})
_wpo = [({**WPO, "name": "wpo_fused", "fused": True, "per_device_batch": 2}, "wpo"),
        ({**WPO, **PACKED, "name": "wpo_packed_fused", "fused": True, "per_device_batch": 2}, "wpo")]
# Per backend: (scenario spec, baseline it must equal). 2 processes x 2 pairs per step.
_common = [
    ({**DPO, "name": "fused", "fused": True, "per_device_batch": 2, "evaluate": True}, "qwen2"),
    ({**DPO, "name": "unfused", "fused": False, "per_device_batch": 2, "evaluate": True}, "qwen2"),
    ({**DPO, **PACKED, "name": "packed_fused", "fused": True, "per_device_batch": 2, "evaluate": True}, "qwen2"),
    ({**DPO, **PACKED, "name": "packed_unfused", "fused": False, "per_device_batch": 2}, "qwen2"),
]
# Micro-batches by token budget holding 1 or 2 pairs, every micro-batch of the plan (3 a rank) in one
# step: equal to one padded batch of the same 8 pairs a step.
BUDGET = {**DPO, **PACKED, "name": "budget", "fused": True, "per_device_batch": 2, "train_rows": 8,
          "max_tokens_per_batch": 34, "grad_accum": "epoch"}
# torch.compile'd decoder layers (refused under ZeRO-3, see test_backbone.py), evaluated too, against the
# one-process eager baseline: no one-process compiled run besides (each one compiles its graphs cold on CI).
_compiled = ({**DPO, "name": "compiled", "fused": True, "per_device_batch": 2, "compile": True, "evaluate": True},
             "qwen2")
SCENARIOS: dict[str, list[tuple[dict, str]]] = {
    # LD-DPO and WPO on ZeRO-3, where the weights are sharded: the hardest backend for them.
    "ddp": _common + [_compiled, (BUDGET, "rows8"), ({**ODD_EVAL, "per_device_batch": 2}, None),
                              ({**ODD_EVAL_PADDED, "per_device_batch": 2}, None)],
    "zero2": _common + [
        ({**DPO, "name": "compiled_checkpointed", "fused": True, "per_device_batch": 2, "compile": True,
          "gradient_checkpointing": True}, "qwen2"),
    ],
    "zero3": _common + _ld + _wpo + [
        ({**DPO, "name": "tied", "fused": True, "per_device_batch": 2, "model": "builtin:tiny-llama"}, "llama"),
        ({**DPO, "name": "lora", "fused": True, "per_device_batch": 2, "peft": True}, "lora"),
        ({**DPO, "name": "precompute", "fused": True, "per_device_batch": 2, "precompute": True, "evaluate": True}, "qwen2"),
    ],
    "fsdp2": _common + [
        ({**DPO, "name": "tied", "fused": True, "per_device_batch": 2, "model": "builtin:tiny-llama"}, "llama"),
        _compiled,
    ],
}
CASES = [(backend, spec["name"], want) for backend in BACKENDS for spec, want in SCENARIOS[backend] if want]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Launches lazily: the baseline once, each backend once, on first use."""
    return lazy_runs(tmp_path_factory.mktemp("dpo_parity"), BASELINE, SCENARIOS)


def test_baseline_trains_and_fused_equals_unfused_in_one_process(runs):
    single = runs(None)
    initial = load_file(str(ROOT / "fusedalign" / "resources" / "models" / "tiny-qwen2" / "model.safetensors"))
    assert_weights_changed(single, "qwen2", initial)
    assert_same_training(single, "qwen2_fused", single, "qwen2", backend=None)


def test_the_ld_baseline_is_not_plain_dpo(runs):
    """LD-DPO with the JS f-divergence trains otherwise than plain DPO once the policy has moved (the
    first step's loss is log 2 for both: policy = reference)."""
    single = runs(None)
    ld, plain = result(single, "ld")["losses"], result(single, "qwen2")["losses"]
    assert len(ld) == len(plain) == 3 and all(abs(a - b) > 1e-3 for a, b in zip(ld[1:], plain[1:])), (ld, plain)


def test_the_wpo_baseline_is_not_plain_dpo(runs):
    """WPO's weights (below 1) change every step's loss, the first one's included."""
    single = runs(None)
    wpo, plain = result(single, "wpo")["losses"], result(single, "qwen2")["losses"]
    assert len(wpo) == len(plain) == 3 and all(abs(a - b) > 1e-4 for a, b in zip(wpo, plain)), (wpo, plain)


# One process, each against the baseline it must reproduce: gradient accumulation 2x2 =
# 1x4, precomputed reference = reference forward, compiled layers with LoRA = eager layers
# with LoRA (compiled layers without it: on DDP and FSDP2 below), gradient checkpointing = none.
SINGLE_CASES = [("grad_accum", "qwen2"), ("precompute", "qwen2"), ("lora_compiled", "lora"),
                ("checkpointed", "qwen2")]


@pytest.mark.parametrize("name,want", SINGLE_CASES, ids=[n for n, _ in SINGLE_CASES])
def test_one_process_variant_equals_its_baseline(runs, name, want):
    single = runs(None)
    assert_same_training(single, name, single, want, backend=None)


def test_lora_baseline_trains_the_adapter(runs):
    adapter = weights(runs(None), "lora")
    lora_b = [k for k in adapter if "lora_B" in k]
    assert lora_b and any(adapter[k].abs().sum() > 0 for k in lora_b)  # B starts at zero


@pytest.mark.parametrize("backend,name,want", CASES, ids=[f"{b}-{n}" for b, n, _ in CASES])
def test_backend_equals_single_process_unfused(runs, backend, name, want):
    assert_same_training(runs(backend), name, runs(None), want, backend=backend)


def test_the_token_budget_scenario_has_micro_batches_of_different_sizes():
    from tests.distributed.run_scenarios import budget_plan

    plan = budget_plan(BUDGET, 2)
    assert len(plan) % 2 == 0 and len({len(b) for b in plan}) > 1, plan
    assert sorted(i for b in plan for i in b) == list(range(BUDGET["train_rows"]))


UNEVEN_KEYS = ("eval_rewards/accuracies", "eval_rewards/margins", "eval_logps/chosen", "eval_logits/rejected")


@pytest.mark.parametrize("name", [ODD_EVAL_PADDED["name"], ODD_EVAL["name"]])
def test_eval_metrics_ignore_rows_repeated_to_even_out_ranks(runs, name):
    """Padded and packed: DDP's metrics over 27 rows (a row repeated to even out the ranks) are one process's."""
    want, got = result(runs(None), name)["eval"], result(runs("ddp"), name)["eval"]
    for key in UNEVEN_KEYS:
        assert abs(got[key] - want[key]) <= 1e-5 * abs(want[key]) + 1e-6, (key, got[key], want[key])
