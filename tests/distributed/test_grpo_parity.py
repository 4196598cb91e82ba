"""GRPO on DDP, ZeRO-2, ZeRO-3 and FSDP2 (2 CPU processes, gloo) equals a single-process unfused run.

Completions are replayed (tests/grpo_replay.py: uneven lengths, some truncated, a reward that
varies within every group), so the comparison is of the training maths alone: generation
batches of 2 prompts x 4 generations split 2 ranks x 4 against 1 process x 8, groups whole
after the reward gather. Per step: the loss, the rewards, KL and entropy; at the end every
weight, to 1e-5. Plus beta > 0 with a separate reference and with the policy's adapter
disabled (LoRA on lm_head), an all-masked step, and real generation with keyed sampling
(the same draws on any split) under ZeRO-3 and FSDP2, a training step after every generation,
once through transformers' generate and once through StaticDecode's own decoding loop, and
through that loop with the sampling head drawing and rows that ended compacted away against one
process's logits path (every 8th token id an EOS, so that rows end early); a
reward model beside the token sum (split over the ranks by ZeRO-3 and FSDP2); and,
under ZeRO-3, a keyed run with num_iterations 2 stopped inside a generation window and resumed
from its checkpoint by new processes.

Three splits that layout never makes, on DDP and, where noted, ZeRO-3:
- groups that span ranks (also ZeRO-3): G = 8, each prompt's 8 completions 4 on rank 0 and
  4 on rank 1, so every advantage needs the gathered rewards of both;
- ranks x accumulation: 2 ranks x accumulation 2 x batch 2 against 1 process x 1 x 8 (dapo);
- one rank all masked (also ZeRO-3): every completion of rank 0's share truncated and masked
  while rank 1 has loss tokens, the entropy quantile's cross-rank gather included.
The keys each rank generated for (run_scenarios.py records them) show each split happened.
On every backend, packed rows (`packed_kl_mu2`: padding_free, share_prompt, a token budget,
beta > 0, num_iterations 2, 2 ranks x accumulation 2 x batch 2) against padded 1 x 1 x 8, with
and without gradient checkpointing (dapo there: its normaliser is the step's tokens over both
ranks), and under a budget below a prompt group, where each micro-batch is trained in parts (as
many on each rank, none over the budget); on DDP, packed rows for every other loss type but bnpo
(a mean per micro-batch, which depends on how a step is split by definition: its packed rows are
compared with padded ones of the same split in tests/unit/test_grpo_packed.py). Each packed run is
checked to have trained on shared-prompt rows. The checkpointed packed run once more with each
layer's MLP over tiles of tokens (`tiled_mlp_tokens`), on every backend, and on ZeRO-3 with LoRA
adapters inside the tiled MLPs.
"""

from __future__ import annotations

import json

import torch

import pytest

from tests.distributed.parity import (BACKENDS, RTOL, WEIGHT_ATOL, assert_same_training, lazy_runs, result,
                                      weights)
from tests.reward_model import REWARD_MODEL_ENV, save_tiny_reward_model

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

GRPO = {"trainer": "grpo", "steps": 3}
LORA = {"peft": True, "lora_target_modules": ["q_proj", "v_proj", "lm_head"], "init_lora_weights": False}
# LoRA inside the MLPs too, for the tiled MLP: the adapters' weights are gathered with the MLP's own.
LORA_MLP = {**LORA, "lora_target_modules": ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]}
# Adapters in every projection at the other scenarios' learning rate (0.1) make six updates that amplify
# rounding: on an AMD EPYC, one process splitting its 8 rows into 2 micro-batches of 4 (nothing else
# changed) moved a weight by 1.4x the tolerance, and ZeRO-3's packed, tiled run by 1.08x. At 0.01 both stay
# near 1% of it while every adapter still moves by 49x it or more, so a lost gradient cannot pass.
LORA_MLP_LR = 0.01
# Rank 0 generates for the first prompt of each generation batch (rows 0, 2, 4 in 3 steps):
# all their completions truncated and masked; rank 1's rows keep loss tokens.
MASKED_ROWS = [0, 2, 4]
PARTS_BUDGET = 21  # the longest prompt (9 tokens) + max_completion_length (12): the least it takes
MASKED_RANK0 = {"truncate_rows": MASKED_ROWS, "mask_truncated_completions": True, "top_entropy_quantile": 0.5}

EOS_EVERY = 8  # every 8th token id ends a completion: most rows end before max_completion_length
# Loss types trained on packed rows besides grpo: dapo (the default) on every backend, the others on DDP,
# each against its own padded baseline (the normaliser over ranks x accumulation is what differs by type;
# bnpo's depends on the split by definition, see the module docstring).
PACKED_LOSSES = ("dapo", "dr_grpo", "cispo", "sapo", "luspo", "vespo")

BASELINE = [
    {**GRPO, "name": "dapo", "fused": False, "per_device_batch": 8},
    {**GRPO, "name": "dapo_fused", "fused": True, "per_device_batch": 8},
    {**GRPO, "name": "grpo_kl", "fused": False, "per_device_batch": 8, "loss_type": "grpo", "beta": 0.1,
     "top_entropy_quantile": 0.5},
    {**GRPO, "name": "lora_kl", "fused": False, "per_device_batch": 8, "beta": 0.1, **LORA},
    {**GRPO, "name": "masked", "fused": False, "per_device_batch": 8, "truncate_every": 1,
     "mask_truncated_completions": True},
    {**GRPO, "name": "keyed", "fused": False, "per_device_batch": 8, "keyed": True},
    {**GRPO, "name": "span", "fused": False, "per_device_batch": 8, "num_generations": 8},
    {**GRPO, "name": "masked_rank0", "fused": False, "per_device_batch": 8, **MASKED_RANK0},
    {**GRPO, "name": "keyed_mu2", "fused": False, "per_device_batch": 8, "keyed": True, "num_iterations": 2},
    {**GRPO, "name": "keyed_eos", "fused": False, "per_device_batch": 8, "keyed": True,
     "generation_backend": "static", "eos_every": EOS_EVERY},
    {**GRPO, "name": "grpo_kl_mu2", "fused": False, "per_device_batch": 8, "loss_type": "grpo", "beta": 0.1,
     "num_iterations": 2},
    {**GRPO, "name": "reward_model", "fused": False, "per_device_batch": 8, "reward_model": True},
    {**GRPO, "name": "lora_mlp_kl_mu2", "fused": False, "per_device_batch": 8, "beta": 0.1, "num_iterations": 2,
     **LORA_MLP, "lr": LORA_MLP_LR},
    # Its adapters as initialised (no step moves them), to show that LORA_MLP_LR trains every one.
    {**GRPO, "name": "lora_mlp_initial", "fused": False, "per_device_batch": 8, "beta": 0.1, **LORA_MLP, "lr": 0.0,
     "steps": 1},
    *({**GRPO, "name": f"{loss}_kl_mu2", "fused": False, "per_device_batch": 8, "loss_type": loss, "beta": 0.1,
       "num_iterations": 2} for loss in PACKED_LOSSES),
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
# StaticDecode's own decoding loop (eager on CPU) on the weights each backend makes whole, with each
# layer's projections fused while decoding (the copies taken at each module's first call: FSDP2
# makes its weights whole inside the forward, ZeRO-3 gathers them around the whole generation),
# and each rank's 4 rows decoded at most 3 at a time (generation_max_rows: parts of 3 and 1 rows, each its
# own call inside the one whole-weights context).
_keyed_static = ({**GRPO, "name": "keyed_static", "fused": True, "per_device_batch": 4, "keyed": True,
                  "generation_backend": "static", "fuse_projections": True, "generation_max_rows": 3}, "keyed")
# The sampling head (the draw inside the head's forward) and compaction of the rows that ended, on the
# weights ZeRO-3 and FSDP2 make whole, against one process's logits path, uncompacted rows included.
_keyed_fused = ({**GRPO, "name": "keyed_fused_sampling", "fused": True, "per_device_batch": 4, "keyed": True,
                 "generation_backend": "static", "fused_sampling": True, "eos_every": EOS_EVERY}, "keyed_eos")
_span = ({**GRPO, "name": "span", "fused": True, "per_device_batch": 4, "num_generations": 8}, "span")
_accum = ({**GRPO, "name": "accum", "fused": True, "per_device_batch": 2, "grad_accum": 2}, "dapo")
_masked_rank0 = ({**GRPO, "name": "masked_rank0", "fused": True, "per_device_batch": 4, **MASKED_RANK0},
                 "masked_rank0")
# Stopped after step 1, inside the window of steps 1-2 (num_iterations 2), and resumed by new
# processes: the window's completions and old-policy log-probs, and the generation counter that
# keys the draws of step 3, come from the checkpoint.
_resumed = ({**GRPO, "name": "keyed_mu2_resumed", "fused": True, "per_device_batch": 4, "keyed": True,
             "num_iterations": 2, "resume_at": 1}, "keyed_mu2")
# Packed rows: each rank's prompt group (4 completions) in one shared-prompt row, split into the
# step's 2 forwards under the budget; the old-policy and reference passes on the same rows.
_packed = ({**GRPO, "name": "packed_kl_mu2", "fused": True, "per_device_batch": 2, "grad_accum": 2,
            "loss_type": "grpo", "beta": 0.1, "num_iterations": 2, "padding_free": True, "share_prompt": True,
            "max_tokens_per_batch": 80}, "grpo_kl_mu2")
# The same with gradient checkpointing (non-reentrant): recomputed layers over packed rows, and dapo's
# normaliser (the step's loss tokens over both ranks).
_packed_ckpt = ({**_packed[0], "name": "packed_kl_mu2_ckpt", "gradient_checkpointing": True, "loss_type": "dapo"},
                "dapo_kl_mu2")
# The same with each layer's MLP over tiles of 16 tokens (tiled_mlp_tokens), policy and reference, each tile
# checkpointed inside the layer's checkpoint. The ranks' rows differ, so they run different numbers of tiles:
# ZeRO-3 must gather the MLP's weights once for all of them (per tile, both ranks waited forever), FSDP2
# gathers the whole layer.
_packed_tiled = ({**_packed_ckpt[0], "name": "packed_tiled_ckpt", "tiled_mlp_tokens": 16}, "dapo_kl_mu2")
# The tiled MLPs with LoRA adapters in them (and on lm_head, the reference the policy with its adapters
# off) under ZeRO-3, whose one gather a call of the MLP must take the adapters' weights along.
_packed_tiled_lora = ({**_packed_tiled[0], "name": "packed_tiled_lora_ckpt", **LORA_MLP, "lr": LORA_MLP_LR},
                      "lora_mlp_kl_mu2")
_packed_losses = [({**_packed[0], "name": f"packed_{loss}", "loss_type": loss}, f"{loss}_kl_mu2")
                  for loss in PACKED_LOSSES[1:]]
# A budget (21) below a prompt group (4 completions, 24-45 tokens): each rank's step needs 2 to 4 rows for
# its 2 micro-batches, so each micro-batch is trained in parts, one forward and backward each, as many
# on every rank (the most either needs), the gradient sync deferred to the last part.
_parts = ({**_packed[0], "name": "packed_parts_kl_mu2", "max_tokens_per_batch": PARTS_BUDGET}, "grpo_kl_mu2")
# A reward model (a path in reward_funcs) beside the token sum: held whole on DDP and ZeRO-2, split
# over the ranks by ZeRO-3 and FSDP2 as a frozen reference is.
_reward_model = ({**GRPO, "name": "reward_model", "fused": True, "per_device_batch": 4, "reward_model": True},
                 "reward_model")
SCENARIOS = {
    "ddp": _common + [_lora, _span, _accum, _masked_rank0, _packed, _packed_ckpt, _packed_tiled, _parts, _reward_model,
                      *_packed_losses],
    "zero2": _common + [_kl, _packed, _packed_ckpt, _packed_tiled, _parts, _reward_model],
    "zero3": _common + [_kl, _lora, _keyed, _keyed_static, _keyed_fused, _span, _masked_rank0, _resumed, _packed,
                        _packed_ckpt, _packed_tiled, _packed_tiled_lora, _parts, _reward_model],
    "fsdp2": _common + [_kl, _lora, _keyed, _keyed_static, _keyed_fused, _packed, _packed_ckpt, _packed_tiled, _parts,
                        _reward_model],
}
CASES = [(backend, spec["name"], want) for backend in BACKENDS for spec, want in SCENARIOS[backend]]
COMPARED = ("reward", "reward_std", "kl", "entropy", "completions/mean_length", "clip_ratio/region_mean")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo_parity")
    with pytest.MonkeyPatch.context() as patch:  # the runners read the reward model's path from it
        patch.setenv(REWARD_MODEL_ENV, str(save_tiny_reward_model(root / "reward_model")))
        yield lazy_runs(root, BASELINE, SCENARIOS)


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
    # At LORA_MLP_LR every adapter, the MLPs' too, moves by far more than the parity tolerance.
    initial, trained = weights(single, "lora_mlp_initial"), weights(single, "lora_mlp_kl_mu2")
    assert sum("mlp" in key and "lora_" in key for key in initial) == 12, sorted(initial)
    for key in (key for key in initial if "lora_" in key):
        moved = ((trained[key] - initial[key]).abs() / (WEIGHT_ATOL + RTOL * initial[key].abs())).max().item()
        assert moved > 20, (key, moved)
    # The reward model's scores reach the rewards: the sum differs from the token sum's alone.
    assert all(a["reward"] != b["reward"] for a, b in zip(result(single, "reward_model")["history"],
                                                         result(single, "dapo")["history"]))


@pytest.mark.parametrize("backend,name,want", CASES, ids=[f"{b}-{n}" for b, n, _ in CASES])
def test_backend_equals_single_process_unfused(runs, backend, name, want):
    got, baseline = runs(backend), runs(None)
    assert_same_training(got, name, baseline, want, backend=backend)
    _assert_same_history(result(got, name), result(baseline, want))
    if name.startswith("packed"):  # packed rows really ran, every one sharing its prompts
        assert result(got, name)["batch_types"] == ["PackedGRPOMicroBatch"], result(got, name)["batch_types"]
        assert result(got, name)["shared_prompt_forwards_per_rank"] == result(got, name)["forwards_per_rank"]
        assert result(baseline, want)["batch_types"] == ["GRPOMicroBatch"]
    if name == "packed_parts_kl_mu2":  # micro-batches in parts: more forwards, as many on each rank, none over
        forwards, largest = result(got, name)["forwards_per_rank"], result(got, name)["largest_forward_per_rank"]
        assert forwards[0] == forwards[1] > 3 * 2 and max(largest) <= PARTS_BUDGET, (forwards, largest)
        assert result(got, "packed_kl_mu2")["forwards_per_rank"] == [3 * 2, 3 * 2]  # 3 steps x 2 micro-batches
    if name == "packed_tiled_ckpt":  # every MLP tiled, policy and reference, and tiles ran with gradients
        assert result(got, name)["tiled_mlps"] == [2, 2] and result(got, name)["tile_checkpoints"] > 0, result(got, name)
    if name == "packed_tiled_lora_ckpt":  # the policy's MLPs tiled (the reference is the policy, adapters off)
        assert result(got, name)["tiled_mlps"] == [2, 0] and result(got, name)["tile_checkpoints"] > 0, result(got, name)
        assert result(got, name)["tiled_mlps_with_adapters"] == 2, result(got, name)
        assert result(baseline, want)["tiled_mlps"] == [0, 0] and result(baseline, want)["tile_checkpoints"] == 0
    if name == "reward_model":  # the reward model was loaded and prepared on this backend
        assert len(result(got, name)["reward_models_partitioned"]) == 1
    if name == "keyed_fused_sampling":  # the head drew, rows that ended were compacted away, in both runs
        last = result(got, name)["generator_last_call"]
        assert last["path"] == "static" and last["fused_sampling"] is True, last
        assert len(last["batch_sizes"]) >= 2 and last["batch_sizes"][-1] < last["batch_sizes"][0], last
        assert result(baseline, want)["generator_last_call"]["fused_sampling"] is False
        lengths = [step["completions/mean_length"] for step in result(baseline, want)["history"]]
        assert all(length < 12 for length in lengths), lengths  # completions ended early
    if name == "keyed_static":  # StaticDecode's own loop ran, not its fallback to generate, on parts of the rows
        assert result(got, name)["generator"] == "RowLimited"
        assert result(got, name)["generator_last_call"]["path"] == "static"
        assert result(got, name)["generator_last_call"]["batch_sizes"][0] == 1  # the last part: 4 rows = 3 + 1
        assert result(baseline, want)["generator"] == "HFGenerate"
        fused = result(got, name)["generator_last_call"]["fused_projections"]
        assert fused == {"mlps": 2, "attentions": 2}, (backend, fused)  # tiny-qwen2's two layers, every one


def _keys(out, name: str) -> list[list[list[tuple[int, int]]]]:
    """Per rank, per generation: the (dataset row, generation) keys that rank generated for."""
    ranks = sorted((out / name).glob("keys.rank*.jsonl"))
    return [[[tuple(k) for k in json.loads(line)] for line in path.read_text().splitlines()] for path in ranks]


# The parity of these scenarios is checked in test_backend_equals_single_process_unfused; these
# check that each split really happened, so that the parity is not vacuous.


@pytest.mark.parametrize("backend", ["ddp", "zero3"])
def test_groups_span_ranks(runs, backend):
    """G = 8 on 2 ranks x 4: each prompt's group half on each rank, rewards varying within it."""
    rank0, rank1 = _keys(runs(backend), "span")
    assert len(rank0) == len(rank1) == 3
    for mine, theirs in zip(rank0, rank1):
        assert len({row for row, _ in mine} | {row for row, _ in theirs}) == 1  # one prompt, split in two
        assert sorted(g for _, g in mine) == [0, 1, 2, 3] and sorted(g for _, g in theirs) == [4, 5, 6, 7]
    assert all(step["reward_std"] > 0 for step in result(runs(None), "span")["history"])


def test_ranks_times_accumulation_split(runs):
    """2 ranks x accumulation 2 x batch 2 (vs 1 x 1 x 8): a rank's window of 4 rows is 2 micro-batches
    of 2, the completions of uneven lengths."""
    got = runs("ddp")
    assert [[len(keys) for keys in rank] for rank in _keys(got, "accum")] == [[4, 4, 4], [4, 4, 4]]
    history = result(got, "accum")["history"]
    assert all(step["completions/min_length"] < step["completions/max_length"] for step in history)


@pytest.mark.parametrize("backend", ["ddp", "zero3"])
def test_one_rank_all_masked(runs, backend):
    """Rank 0's whole micro-batch is masked each step while rank 1's trains."""
    rank0, rank1 = _keys(runs(backend), "masked_rank0")
    assert len(rank0) == len(rank1) == 3
    assert all(row in MASKED_ROWS for step in rank0 for row, _ in step)
    assert not any(row in MASKED_ROWS for step in rank1 for row, _ in step)
    single = result(runs(None), "masked_rank0")
    assert all(loss != 0.0 for loss in single["losses"])  # rank 1's tokens do train
    assert all(0.5 < step["completions/clipped_ratio"] < 1.0 for step in single["history"])


def test_the_zero3_run_resumed_inside_a_window_from_each_ranks_state(runs):
    """Its parity is checked above; here, that it did resume, from a checkpoint holding each rank's
    window in progress (written by both ranks)."""
    checkpoint = runs("zero3") / "keyed_mu2_resumed" / "checkpoint-1"
    for rank in (0, 1):
        state = torch.load(checkpoint / f"fusedalign_rank{rank}.pt", weights_only=False)
        assert state["num_processes"] == 2 and state["grpo_rollout"]["window"]["served"] == 1
    assert [h["step"] for h in result(runs("zero3"), "keyed_mu2_resumed")["history"]] == [1, 2, 3]
