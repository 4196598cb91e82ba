"""DPOTrainer on a tiny model: every loss type fused = unfused, reference-free, empty batches."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from datasets import Dataset

from fusedalign.configs import DPOConfig
from fusedalign.data import load_dataset_any
from fusedalign.losses import DPO_LOSSES, pairwise_dpo_losses
from fusedalign.models import load_model
from fusedalign.trainers.dpo import DPOTrainer
from tests.head_calls import HeadCalls

MODEL = "builtin:tiny-qwen2"


@pytest.fixture(scope="module")
def zen() -> Dataset:
    return load_dataset_any("builtin:zen", "standard_preference").select(range(16))


def _args(tmp_path, **overrides) -> DPOConfig:
    values = dict(
        output_dir=str(tmp_path), max_steps=2, learning_rate=0.01, optim="sgd", lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, max_grad_norm=0.0, per_device_train_batch_size=4, logging_steps=1,
        save_strategy="no", seed=0, train_sampling_strategy="sequential", max_length=48, max_prompt_length=24,
        disable_tqdm=True, beta=0.5,
    )
    values.update(overrides)
    return DPOConfig(**values)


def _train(tmp_path, dataset, calls: Counter | None = None, **overrides):
    """(per-step losses, final weights); `calls` receives how often each loss-aware path ran."""
    torch.manual_seed(0)
    trainer = DPOTrainer(model=load_model(MODEL), args=_args(tmp_path, **overrides), train_dataset=dataset)
    with HeadCalls() as counted:
        trainer.train()
    if calls is not None:
        calls.update(counted)
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    return losses, {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def _assert_loss_aware_ran(calls: Counter, steps: int) -> None:
    """The policy's head formed its gradient in every step's forward and never had to recompute."""
    assert calls["forward"] == steps and calls["backward"] == steps, calls
    assert calls["mismatch"] == 0 and calls["over_budget"] == 0, calls


# label_smoothing must be > 0 for exo_pair; use it for every type that accepts it.
LOSS_TYPES = sorted(set(DPO_LOSSES) - {"aot_unpaired"})


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_every_loss_type_trains_the_same_fused_and_unfused(tmp_path, zen, loss_type):
    smoothing = 1e-3 if loss_type == "exo_pair" else 0.0
    # A step with a non-trivial reference (the policy after step 1) exercises every term.
    calls = Counter()
    fused = _train(tmp_path / "f", zen, calls, loss_type=[loss_type], label_smoothing=smoothing, fused_head=True)
    unfused = _train(tmp_path / "u", zen, loss_type=[loss_type], label_smoothing=smoothing, fused_head=False)
    if pairwise_dpo_losses(loss_type):
        _assert_loss_aware_ran(calls, steps=2)
    else:  # aot sorts across the batch, bco_pair shifts by this batch's mean: the per-token op
        assert calls["forward"] == 0, calls
    assert len(fused[0]) == 2 and all(torch.isfinite(torch.tensor(fused[0])))
    torch.testing.assert_close(torch.tensor(fused[0]), torch.tensor(unfused[0]), rtol=1e-5, atol=1e-6)
    for key, value in unfused[1].items():
        torch.testing.assert_close(fused[1][key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_combined_loss_types_with_weights(tmp_path, zen):
    combo = dict(loss_type=["sigmoid", "sft", "apo_zero"], loss_weights=[1.0, 0.5, 0.2])
    calls = Counter()
    fused = _train(tmp_path / "f", zen, calls, fused_head=True, **combo)
    unfused = _train(tmp_path / "u", zen, fused_head=False, **combo)
    _assert_loss_aware_ran(calls, steps=2)
    torch.testing.assert_close(torch.tensor(fused[0]), torch.tensor(unfused[0]), rtol=1e-5, atol=1e-6)
    for key, value in unfused[1].items():
        torch.testing.assert_close(fused[1][key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_loss_aware_head_off_runs_the_per_token_op_and_trains_the_same(tmp_path, zen):
    on_calls, off_calls = Counter(), Counter()
    on = _train(tmp_path / "on", zen, on_calls)
    off = _train(tmp_path / "off", zen, off_calls, loss_aware_head=False)
    _assert_loss_aware_ran(on_calls, steps=2)
    assert sum(off_calls.values()) == 0, off_calls
    torch.testing.assert_close(torch.tensor(on[0]), torch.tensor(off[0]), rtol=1e-5, atol=1e-6)
    for key, value in off[1].items():
        torch.testing.assert_close(on[1][key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_loss_aware_head_with_gradient_accumulation_equals_one_large_batch(tmp_path, zen):
    # The trainer's normaliser differs between the two (1/8 vs 1/4 per micro-batch): the head
    # fits it in backward.
    calls = Counter()
    split = _train(tmp_path / "s", zen, calls, per_device_train_batch_size=2, gradient_accumulation_steps=4)
    whole = _train(tmp_path / "w", zen, per_device_train_batch_size=8)
    _assert_loss_aware_ran(calls, steps=8)
    torch.testing.assert_close(torch.tensor(split[0]), torch.tensor(whole[0]), rtol=1e-5, atol=1e-6)
    for key, value in whole[1].items():
        torch.testing.assert_close(split[1][key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_reference_free_needs_no_reference_and_differs_from_dpo(tmp_path, zen):
    torch.manual_seed(0)
    trainer = DPOTrainer(model=load_model(MODEL), args=_args(tmp_path, reference_free=True), train_dataset=zen)
    assert trainer.ref_model is None
    trainer.train()
    free = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    with_ref, _ = _train(tmp_path / "r", zen)
    assert abs(with_ref[0] - 0.6931) < 1e-3  # policy == reference at step 1
    assert abs(free[0] - with_ref[0]) > 1e-3  # reference-free compares raw log-probs


def test_a_batch_with_no_completion_tokens_gives_zero_loss_and_a_connected_graph(tmp_path, zen):
    torch.manual_seed(0)
    trainer = DPOTrainer(model=load_model(MODEL), args=_args(tmp_path), train_dataset=zen)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    batch["completion_mask"] = torch.zeros_like(batch["completion_mask"])  # everything truncated away
    model = trainer.model
    model.train()
    trainer.model_accepts_loss_kwargs = False
    loss = trainer.compute_loss(model, batch, num_items_in_batch=torch.tensor(0.0))
    assert torch.isfinite(loss) and loss.item() == 0.0
    loss.backward()  # connected: backward runs and every gradient is zero
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(g.abs().sum() == 0 for g in grads)


def test_metrics_and_item_counts_wait_for_nothing_on_the_host(tmp_path, zen, monkeypatch):
    """Recording a micro-batch's metrics and counting a step's pairs read nothing back from
    the device (on a GPU, a read-back there would stall the host before the backward); the
    values read back at logging are exactly those recorded."""
    trainer = DPOTrainer(model=load_model(MODEL), args=_args(tmp_path), train_dataset=zen)
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    batch = trainer._prepared(trainer.model, [batch], "train")[0]  # the reference pass of the step
    with torch.no_grad():
        _, metrics = trainer.loss_and_metrics(trainer.model, batch, "train")
    expected_pairs = float(trainer.count_items(batch))

    def read_back(*_a, **_k):
        raise AssertionError("a tensor was read back to the host")

    with monkeypatch.context() as m:
        for name in ("tolist", "item", "__int__", "__float__", "__bool__", "cpu", "numpy"):
            m.setattr(torch.Tensor, name, read_back)
        trainer.metrics.record("train", metrics)
        trainer.metrics.record("train", metrics)
        _, total = trainer.get_batch_samples(iter([batch, batch, batch]), 3, batch["input_ids"].device)
    assert float(total) == 3 * expected_pairs
    logged = trainer.metrics.read("train")
    stats = dict(metrics.stats())
    assert set(logged) == set(stats)
    for name, stat in stats.items():  # every DPO metric is a mean: twice the sums over twice the counts
        want = 2 * float(stat.sum.double().sum()) / (2 * float(stat.count.double().sum()))
        assert logged[name] == pytest.approx(want, rel=1e-12, abs=1e-12), name
