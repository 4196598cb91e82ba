"""Distillation's fused divergence (both heads inside their own forwards) trains as the unfused one
(full logits of both models): in bf16 on CUDA with a Qwen2.5-0.5B-shaped student and a
Qwen2.5-1.5B-shaped teacher (marked gpu), and the same check in float32 on the CPU on the builtin
tiny student and teacher.

The GPU models keep their shapes' width, heads, MLP and vocabulary (student 896, 14 q / 2 kv heads,
4864; teacher 1536, 12 q / 2 kv heads, 8960; both 151936, random init, tied heads) but 4 layers
each (the heads and the divergence are what is tested; depth only costs time). The teacher is
given by path, so under bf16 it loads in bf16 as a user's would.

Three runs on the same replayed completions (uneven, some truncated, one-token ones), beta 0.5
(the generalised JSD: both directions of the divergence), temperature 0.9: the truth, unfused in
float32 (no TF32); unfused in bf16 (autocast over the student's float32 weights); fused in bf16.
The criterion (tests/bf16_parity.py): the fused run's largest error over the steps in loss and
entropy, and in the weights' change, at most 3x the unfused bf16 run's plus a floor of 1e-3 of the
largest value compared. On the CPU in float32 the unfused run is the truth, so the fused run must
equal it within the float32 floor, 1e-5: a fault of the test itself shows in CPU CI.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from fusedalign.configs import DistillationConfig
from fusedalign.data import load_dataset_any
from fusedalign.models import load_model, load_tokenizer
from fusedalign.trainers.distillation import DistillationTrainer
from tests.bf16_parity import assert_within, no_tf32, save_shaped_model
from tests.grpo_replay import uneven_replay

COMPARED = ("loss", "entropy")


@dataclass(frozen=True)
class Shape:
    student: str  # a builtin name or a saved model's path
    teacher: str
    rows: int  # prompts (one completion each) over the run
    max_completion_length: int
    batch: int  # completions per micro-batch


def _train(shape: Shape, device: str, dtype: torch.dtype, fused: bool, out, prompts, replay):
    no_tf32()
    args = DistillationConfig(
        output_dir=str(out), max_steps=3, learning_rate=0.5, optim="sgd", lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, per_device_train_batch_size=shape.batch,
        gradient_accumulation_steps=2, max_completion_length=shape.max_completion_length, beta=0.5,
        temperature=0.9, bf16=dtype == torch.bfloat16, use_cpu=device == "cpu", fused_head=fused, logging_steps=1,
        save_strategy="no", seed=0, report_to="none", disable_tqdm=True, shuffle_dataset=False)
    torch.manual_seed(0)
    run = DistillationTrainer(load_model(shape.student), shape.teacher, args=args, train_dataset=prompts,
                              generator=replay)
    before = torch.cat([p.detach().float().flatten().cpu() for p in run.model.parameters()])
    run.train()
    delta = torch.cat([p.detach().float().flatten().cpu() for p in run.model.parameters()]) - before
    return [e for e in run.state.log_history if "loss" in e], delta


def assert_fused_trains_as_unfused(shape: Shape, device: str, dtype: torch.dtype, tmp_path) -> None:
    """The module docstring's check, on `device` in `dtype` (float32 or bfloat16)."""
    eos = load_tokenizer(shape.student).eos_token_id
    prompts = load_dataset_any("builtin:zen", "standard_prompt_only").select(range(shape.rows))
    replay = uneven_replay(shape.rows, 1, eos, truncate_every=3, max_length=shape.max_completion_length - 1)
    truth = _train(shape, device, torch.float32, False, tmp_path / "truth", prompts, replay)
    unfused = truth
    if dtype != torch.float32:
        unfused = _train(shape, device, dtype, False, tmp_path / "unfused", prompts, replay)
    fused = _train(shape, device, dtype, True, tmp_path / "fused", prompts, replay)
    assert len(truth[0]) == 3 and len({e["loss"] for e in truth[0]}) == 3 and all(e["loss"] > 0 for e in truth[0])
    for run in (unfused, fused):  # the same completions
        assert [e["completions/mean_length"] for e in run[0]] == [e["completions/mean_length"] for e in truth[0]]
    assert_within(dtype, COMPARED, truth, unfused, fused, name="distillation")


def test_fused_trains_as_unfused_in_float32_on_the_cpu(tmp_path):
    shape = Shape("builtin:tiny-qwen2", "builtin:tiny-zen-teacher", rows=24, max_completion_length=12, batch=4)
    assert_fused_trains_as_unfused(shape, "cpu", torch.float32, tmp_path)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fused_trains_as_unfused_in_bf16_on_a_05b_student_and_15b_teacher(tmp_path_factory, tmp_path):
    from benchmarks.builders.model import QWEN05B, QWEN15B

    models = tmp_path_factory.mktemp("distill_shapes")
    student = save_shaped_model(str(models / "student"), QWEN05B, layers=4, seed=0)
    teacher = save_shaped_model(str(models / "teacher"), QWEN15B, layers=4, seed=1)
    shape = Shape(student, teacher, rows=48, max_completion_length=128, batch=8)
    assert_fused_trains_as_unfused(shape, "cuda", torch.bfloat16, tmp_path)
