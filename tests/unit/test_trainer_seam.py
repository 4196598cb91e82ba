"""The seam of `trainers/base.py`: `prepare_step` runs once per optimizer step, with all of
that step's micro-batches, before any forward of the step; evaluation prepares each batch.
And the trainers leave what the backend allows to `fusedalign.distributed`."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset

from fusedalign.configs import DPOConfig
from fusedalign.data import load_dataset_any
from fusedalign.models import load_model
from fusedalign.trainers.dpo import DPOTrainer

MODEL = "builtin:tiny-qwen2"
STEPS, ACCUMULATION = 2, 3


@pytest.fixture(scope="module")
def zen() -> Dataset:
    return load_dataset_any("builtin:zen", "standard_preference").select(range(12))


def _trainer(tmp_path, zen: Dataset) -> DPOTrainer:
    args = DPOConfig(
        output_dir=str(tmp_path), max_steps=STEPS, gradient_accumulation_steps=ACCUMULATION,
        per_device_train_batch_size=2, per_device_eval_batch_size=4, learning_rate=0.01, optim="sgd",
        lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=0.0, logging_steps=1, save_strategy="no",
        seed=0, train_sampling_strategy="sequential", max_length=48, max_prompt_length=24, disable_tqdm=True,
        report_to="none",
    )
    torch.manual_seed(0)
    return DPOTrainer(model=load_model(MODEL), args=args, train_dataset=zen, eval_dataset=zen.select(range(8)))


def _record(trainer: DPOTrainer) -> list[tuple]:
    """Events in call order: ("prepare", mode, tags), ("loss", mode, tag), ("policy forward",),
    ("reference forward", inside prepare_step); each prepared micro-batch gets a tag."""
    events: list[tuple] = []
    preparing = [False]
    tag_of: dict[int, int] = {}  # id of a prepared micro-batch -> its tag
    prepare, loss = trainer.prepare_step, trainer.loss_and_metrics

    def prepare_step(model, batches, mode):
        tags = [len([e for e in events if e[0] == "prepare"]) * 100 + i for i in range(len(batches))]
        events.append(("prepare", mode, tags))
        preparing[0] = True
        try:
            prepared = prepare(model, batches, mode)
        finally:
            preparing[0] = False
        for batch, tag in zip(prepared, tags):
            tag_of[id(batch)] = tag
        return prepared

    def loss_and_metrics(model, inputs, mode):
        events.append(("loss", mode, tag_of[id(inputs)]))
        return loss(model, inputs, mode)

    trainer.prepare_step, trainer.loss_and_metrics = prepare_step, loss_and_metrics
    trainer.model.register_forward_pre_hook(lambda *_: events.append(("policy forward",)))
    trainer.ref_model.register_forward_pre_hook(lambda *_: events.append(("reference forward", preparing[0])))
    return events


def test_prepare_step_runs_once_per_optimizer_step_with_all_its_micro_batches_before_any_forward(tmp_path, zen):
    trainer = _trainer(tmp_path, zen)
    events = _record(trainer)
    trainer.train()
    assert trainer.state.global_step == STEPS
    # The reference runs only in the step's preparation (one forward a micro-batch).
    assert [e for e in events if e[0] == "reference forward"] == [("reference forward", True)] * (STEPS * ACCUMULATION)
    order = [e for e in events if e[0] != "reference forward"]
    want = []
    for step in range(STEPS):
        tags = [step * 100 + i for i in range(ACCUMULATION)]
        want.append(("prepare", "train", tags))
        for tag in tags:
            want += [("loss", "train", tag), ("policy forward",)]
    assert order == want


def test_evaluation_prepares_each_batch_as_its_own_step(tmp_path, zen):
    trainer = _trainer(tmp_path, zen)
    events = _record(trainer)
    trainer.evaluate()
    order = [e for e in events if e[0] != "reference forward"]
    assert order == [("prepare", "eval", [0]), ("loss", "eval", 0), ("policy forward",),
                     ("prepare", "eval", [100]), ("loss", "eval", 100), ("policy forward",)]


def test_compiled_layers_are_refused_under_zero3_by_the_backend_package(tmp_path, monkeypatch):
    import fusedalign.distributed.backend as backend
    import fusedalign.trainers.policy as policy

    # The trainers ask `fusedalign.distributed` whether the option runs, never which backend is on.
    assert not hasattr(policy, "zero3_enabled")
    monkeypatch.setattr(backend, "zero3_enabled", lambda: True)
    args = DPOConfig(output_dir=str(tmp_path), compile_layers=True, report_to="none")
    with pytest.raises(ValueError, match="not supported under DeepSpeed ZeRO-3: its parameter hooks"):
        policy.load_policy(MODEL, args)
