"""GRPO and RLOO on packed rows (`padding_free`, `share_prompt`, a token budget just above the longest
group; and the smallest one the trainer accepts, which trains each micro-batch in parts) train as on
padded rows, both fused: GRPO in bf16 on CUDA on the Qwen2.5-0.5B shape (marked
gpu), and the same check for GRPO and RLOO in float32 on the CPU on the builtin tiny model. RLOO
shares every packed pass with GRPO (it differs in its advantages and where its KL goes), so the
GPU gate's time goes to one of them.

The GPU case keeps Qwen2.5-0.5B's width, heads, MLP and vocabulary (896, 14 q / 2 kv heads, 4864,
151936) but 4 of its 24 layers (the head, the attention and the packing are what is tested; depth
only costs time). It is loaded by path with no attention implementation asked for, so the packed
runs take flex attention, their CUDA default (attention/selection.py), and the padded ones sdpa.

Micro-batches of one group (G completions), two a step, three steps, num_iterations 2, beta 0.04,
loss dapo, SGD with the gradient clipped to norm 1. Three runs on the same replayed completions
(uneven, some truncated, one-token ones): the truth, padded rows in float32 (no TF32); padded rows
in bf16 (autocast over float32 weights); packed rows in bf16. The criterion (tests/bf16_parity.py): the packed run's largest error over the steps in
loss, kl and entropy, and in the weights' change, at most 3x the padded bf16 run's plus a floor of
1e-3 of the largest value compared. On the CPU in float32 the padded run is the truth, so the packed
run must equal it within the float32 floor, 1e-5: a fault of the test itself shows in CPU CI.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from fusedalign.configs import GRPOConfig, RLOOConfig
from fusedalign.data import load_dataset_any
from fusedalign.data.packed_rows import group_tokens
from fusedalign.data.prompts import prepare_prompt_dataset
from fusedalign.models import load_model, load_tokenizer
from fusedalign.trainers.grpo import GRPOTrainer
from fusedalign.trainers.grpo_packed_batch import PackedGRPOMicroBatch
from fusedalign.trainers.rloo import RLOOTrainer
from tests.bf16_parity import assert_within, no_tf32, save_shaped_model
from tests.grpo_replay import token_sum_reward, uneven_replay
from tests.micro_batches import record_micro_batches

COMPARED = ("loss", "kl", "entropy")
TRAINERS = {"grpo": (GRPOTrainer, GRPOConfig), "rloo": (RLOOTrainer, RLOOConfig)}


@dataclass(frozen=True)
class Shape:
    model: str  # a builtin name or a saved model's path
    rows: int  # prompts over the run
    generations: int  # G
    max_completion_length: int
    batch: int  # completions per micro-batch: one group (G), so that a budget just above the longest group holds it


def _replay(shape: Shape, eos: int):
    return uneven_replay(shape.rows, shape.generations, eos, truncate_every=3, max_length=shape.max_completion_length - 1)


def _budgets(shape: Shape, prompts, replay, tokenizer) -> tuple[int, int]:
    """One token above the longest prompt group in a shared-prompt row (one row a micro-batch), and the
    smallest budget the trainer accepts (each micro-batch in parts): one token above the longest
    prompt + completion, at least the longest prompt + max_completion_length (check_budget)."""
    rows, _ = prepare_prompt_dataset(prompts, tokenizer)
    lengths = [(len(rows[r]["prompt_ids"]), [len(replay.records[(r, g)][0]) for g in range(shape.generations)])
               for r in range(shape.rows)]
    return (1 + max(group_tokens(p, cs, True) for p, cs in lengths),
            max(1 + max(p + c for p, cs in lengths for c in cs),
                max(p for p, _ in lengths) + shape.max_completion_length))


def _train(shape: Shape, trainer: str, device: str, dtype: torch.dtype, out, prompts, replay, **layout):
    no_tf32()
    trainer_cls, config_cls = TRAINERS[trainer]
    args = config_cls(
        output_dir=str(out), max_steps=3, learning_rate=0.1, optim="sgd", lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, per_device_train_batch_size=shape.batch,
        gradient_accumulation_steps=2, num_generations=shape.generations, num_iterations=2, beta=0.04,
        max_completion_length=shape.max_completion_length, mask_truncated_completions=False, loss_type="dapo",
        bf16=dtype == torch.bfloat16, use_cpu=device == "cpu", fused_head=True, logging_steps=1,
        save_strategy="no", seed=0, report_to="none", disable_tqdm=True, shuffle_dataset=False, **layout)
    torch.manual_seed(0)
    model = load_model(shape.model)  # float32 weights; bf16 computes under autocast
    run = trainer_cls(model, reward_funcs=token_sum_reward, args=args, train_dataset=prompts, generator=replay)
    seen = record_micro_batches(run)
    before = torch.cat([p.detach().float().flatten().cpu() for p in run.model.parameters()])
    run.train()
    delta = torch.cat([p.detach().float().flatten().cpu() for p in run.model.parameters()]) - before
    logs = [e for e in run.state.log_history if "loss" in e]
    return (logs, delta), seen, run.model.config._attn_implementation


def assert_packed_trains_as_padded(shape: Shape, trainer: str, device: str, dtype: torch.dtype, tmp_path) -> None:
    """The module docstring's check, on `device` in `dtype` (float32 or bfloat16)."""
    tokenizer = load_tokenizer(shape.model)
    prompts = load_dataset_any("builtin:zen", "standard_prompt_only").select(range(shape.rows))
    replay = _replay(shape, tokenizer.eos_token_id)
    budget, smallest = _budgets(shape, prompts, replay, tokenizer)
    truth, _, _ = _train(shape, trainer, device, torch.float32, tmp_path / "truth", prompts, replay)
    padded = truth
    if dtype != torch.float32:
        padded, _, _ = _train(shape, trainer, device, dtype, tmp_path / "padded", prompts, replay)
    packed, seen, attn = _train(shape, trainer, device, dtype, tmp_path / "packed", prompts, replay,
                                padding_free=True, share_prompt=True, max_tokens_per_batch=budget)
    assert all(isinstance(b, PackedGRPOMicroBatch) for b in seen) and len(seen) == 6
    assert all(bool((b.rows.parent_ids >= 0).any()) for b in seen)  # prompts shared in every row
    assert max(b.rows.forward_tokens() for b in seen) <= budget
    assert attn == ("flex_attention" if device == "cuda" else "sdpa")
    # Each micro-batch in parts, one row of at most one completion's budget each, a backward each.
    parts, seen, _ = _train(shape, trainer, device, dtype, tmp_path / "parts", prompts, replay,
                            padding_free=True, share_prompt=True, max_tokens_per_batch=smallest)
    assert len(seen) > 6 and max(b.rows.forward_tokens() for b in seen) <= smallest
    for run in (padded, packed, parts):  # the same completions: the same rewards
        assert [e.get("reward") for e in run[0]] == [e.get("reward") for e in truth[0]]
    assert any(e.get("kl", 0) > 0 for e in truth[0]) and len({e["loss"] for e in truth[0]}) == 3
    assert_within(dtype, COMPARED, truth, padded, packed, name=trainer)
    assert_within(dtype, COMPARED, truth, padded, parts, name=f"{trainer} in parts")


@pytest.mark.parametrize("trainer", sorted(TRAINERS))
def test_packed_rows_train_as_padded_in_float32_on_the_cpu(tmp_path, trainer):
    shape = Shape("builtin:tiny-qwen2", rows=8, generations=4, max_completion_length=12, batch=4)
    assert_packed_trains_as_padded(shape, trainer, "cpu", torch.float32, tmp_path)


@pytest.fixture(scope="module")
def qwen05b_shape(tmp_path_factory) -> str:
    from benchmarks.builders.model import QWEN05B

    return save_shaped_model(str(tmp_path_factory.mktemp("qwen05b_4l")), QWEN05B, layers=4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_packed_rows_train_as_padded_in_bf16_on_the_05b_shape(tmp_path, qwen05b_shape):
    shape = Shape(qwen05b_shape, rows=16, generations=8, max_completion_length=64, batch=8)
    assert_packed_trains_as_padded(shape, "grpo", "cuda", torch.bfloat16, tmp_path)
