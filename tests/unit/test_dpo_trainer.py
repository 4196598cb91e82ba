"""DPOTrainer on a tiny model: every loss type fused = unfused, reference-free, empty batches;
padding-free, shared-prompt and token-budget training equal padded training (losses, metrics,
weights, evaluation, precomputed reference), length grouping, and refusals."""

from __future__ import annotations

import dataclasses
import functools
import random
from collections import Counter
from pathlib import Path

import pytest
import torch
from datasets import Dataset

from fusedalign.attention import PackedAttentionError
from fusedalign.configs import DPOConfig
from fusedalign.data import DataError, DPOCollator, load_dataset_any
from fusedalign.data.preference_batches import dpo_row_tokens
from fusedalign.data.samplers import LengthGroupedSampler, TokenBudgetBatchSampler, padded_tokens, plan_micro_batches
from fusedalign.losses import DPO_LOSSES, pairwise_dpo_losses
from fusedalign.models import load_model
from fusedalign.trainers.base import MissingPartError
from fusedalign.trainers.dpo import DPOTrainer
from fusedalign.trainers.preference_steps import DPOStepBatch
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
        _, total = trainer.get_batch_samples(iter([batch, batch, batch]), 3, batch.rows.input_ids.device)
    assert float(total) == 3 * expected_pairs
    logged = trainer.metrics.read("train")
    stats = dict(metrics.stats())
    assert set(logged) == set(stats)
    for name, stat in stats.items():  # every DPO metric is a mean: twice the sums over twice the counts
        want = 2 * float(stat.sum.double().sum()) / (2 * float(stat.count.double().sum()))
        assert logged[name] == pytest.approx(want, rel=1e-12, abs=1e-12), name


# ------------------------------------------------------------------ padding-free and shared-prompt rows


def _tokens(g: random.Random, n: int) -> list[int]:
    return [g.randrange(1, 512) for _ in range(n)]


def _edge_rows(seed: int = 0, n: int = 16) -> Dataset:
    """Tokenised pairs: one-token completions and prompt, no prompt, nothing to score on one
    side, a prompt cut to max_prompt_length and completions cut to max_length, uneven lengths."""
    g = random.Random(seed)
    rows = [
        dict(prompt_ids=_tokens(g, 9), chosen_ids=_tokens(g, 1), rejected_ids=_tokens(g, 1)),
        dict(prompt_ids=_tokens(g, 1), chosen_ids=_tokens(g, 6), rejected_ids=_tokens(g, 2)),
        dict(prompt_ids=[], chosen_ids=_tokens(g, 4), rejected_ids=_tokens(g, 7)),
        dict(prompt_ids=_tokens(g, 5), chosen_ids=[], rejected_ids=_tokens(g, 3)),
        dict(prompt_ids=_tokens(g, 40), chosen_ids=_tokens(g, 12), rejected_ids=_tokens(g, 30)),
    ]
    rows += [dict(prompt_ids=_tokens(g, g.randint(2, 30)), chosen_ids=_tokens(g, g.randint(1, 20)),
                  rejected_ids=_tokens(g, g.randint(1, 20))) for _ in range(n - len(rows))]
    return Dataset.from_list(rows)


def _run(tmp_path, dataset, model=MODEL, calls: Counter | None = None, eval_dataset=None, **overrides):
    """(logged training entries, final weights, trainer); `calls` counts the loss-aware head's paths."""
    torch.manual_seed(0)
    policy = load_model(model) if isinstance(model, str) else model
    trainer = DPOTrainer(model=policy, args=_args(tmp_path, **overrides), train_dataset=dataset,
                         eval_dataset=eval_dataset)
    with HeadCalls() as counted:
        trainer.train()
    if calls is not None:
        calls.update(counted)
    logs = [{k: v for k, v in e.items() if k != "step"} for e in trainer.state.log_history if "loss" in e]
    return logs, {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}, trainer


def _assert_same_training(got, want, steps: int, beta: float = 0.5):
    """Every logged value of every step (losses, rewards/*, logps/*, logits/*, entropy, accuracy,
    num_tokens, grad_norm) and every final weight, to 1e-5.

    A reward is beta times a difference of two float32 sums of size |logps| (summed in another
    order by another layout), so its error is absolute, about beta * |logps| * 1e-7: compared
    to 2e-6 of that scale."""
    (got_logs, got_weights, _), (want_logs, want_weights, _) = got, want
    assert len(got_logs) == len(want_logs) == steps
    for g, w in zip(got_logs, want_logs):
        assert set(g) == set(w)
        scale = beta * max(abs(w["logps/chosen"]), abs(w["logps/rejected"]))
        for key, value in w.items():
            tol = 1e-6 + (2e-6 * scale if key.startswith("rewards/") else 0.0)
            assert g[key] == pytest.approx(value, rel=1e-5, abs=tol), (key, g[key], value)
    for key, value in want_weights.items():
        torch.testing.assert_close(got_weights[key], value, rtol=1e-5, atol=1e-6, msg=key)


@functools.lru_cache(maxsize=None)
def _padded_baseline(model: str, data: str, tmp: str):
    return _run(Path(tmp) / f"padded-{model}-{data}", DATA[data](), model, fused_head=False)


DATA = {"zen": lambda: load_dataset_any("builtin:zen", "standard_preference").select(range(16)), "edge": _edge_rows}
LAYOUTS = {"padding_free": dict(padding_free=True), "shared_prompt": dict(padding_free=True, share_prompt=True)}


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("data", sorted(DATA))
@pytest.mark.parametrize("model", ["builtin:tiny-qwen2", "builtin:tiny-llama"])
def test_packed_rows_train_like_padded_rows(tmp_path_factory, model, data, layout, fused):
    """Per-step losses, every metric and the final weights of padding-free (and shared-prompt)
    training equal the padded unfused run's; the fused head is loss-aware in every step."""
    want = _padded_baseline(model, data, str(tmp_path_factory.getbasetemp()))
    calls = Counter()
    got = _run(tmp_path_factory.mktemp("packed"), DATA[data](), model, calls, fused_head=fused, **LAYOUTS[layout])
    batch = next(iter(got[2].get_train_dataloader()))
    assert batch["input_ids"].shape[0] == 1 and "attention_mask" not in batch  # one row, no padding
    if data == "edge":  # a prompt cut to max_prompt_length, a completion to max_length
        row = got[2].train_dataset[4]
        assert (len(row["prompt_ids"]), len(row["chosen_ids"]), len(row["rejected_ids"])) == (24, 12, 24)
    _assert_same_training(got, want, steps=2)
    if fused:
        _assert_loss_aware_ran(calls, steps=2)
    else:
        assert sum(calls.values()) == 0, calls


def _long_rows() -> Dataset:
    """Pairs that reach past tiny-gemma2's 64-token sliding window."""
    g = random.Random(5)
    return Dataset.from_list([dict(prompt_ids=_tokens(g, g.randint(40, 60)), chosen_ids=_tokens(g, g.randint(15, 30)),
                                   rejected_ids=_tokens(g, g.randint(15, 30))) for _ in range(8)])


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_gemma2_trains_like_padded_rows_on_eager_attention_past_its_window(tmp_path, layout):
    options = dict(max_length=96, max_prompt_length=64)
    want = _run(tmp_path / "padded", _long_rows(), "builtin:tiny-gemma2", fused_head=False, **options)
    assert max(len(r["prompt_ids"]) + len(r["chosen_ids"]) for r in want[2].train_dataset) > 64
    got = _run(tmp_path / "packed", _long_rows(), "builtin:tiny-gemma2", **options, **LAYOUTS[layout])
    assert want[2].model.config._attn_implementation == "eager"
    _assert_same_training(got, want, steps=2)


def _planned(rows: Dataset, budget: int, share: bool, seed: int = 0) -> list[list[int]]:
    return TokenBudgetBatchSampler([dpo_row_tokens(r, share) for r in rows], budget, seed=seed).batches


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_token_budget_micro_batches_train_like_one_padded_batch(tmp_path, layout):
    """Each optimizer step accumulates every micro-batch of the plan (one epoch), micro-batches
    holding different numbers of pairs, the longest pair alone at the budget: the same steps as one
    padded batch of all 16 pairs, however each epoch orders the micro-batches."""
    rows, share = _edge_rows(), layout == "shared_prompt"
    want = _run(tmp_path / "padded", rows, fused_head=False, per_device_train_batch_size=16, max_steps=3)
    prepared = want[2].train_dataset  # the rows as truncated for training
    budget = max(dpo_row_tokens(r, share) for r in prepared)
    plan = _planned(prepared, budget, share)
    tokens = [dpo_row_tokens(r, share) for r in prepared]
    assert len(plan) >= 4 and len({len(b) for b in plan}) >= 2, plan
    assert max(sum(tokens[i] for i in b) for b in plan) == budget
    calls = Counter()
    got = _run(tmp_path / "budget", rows, calls=calls, max_tokens_per_batch=budget, gradient_accumulation_steps=len(plan),
               train_sampling_strategy="random", max_steps=3, **LAYOUTS[layout])
    assert got[2].micro_batches.budget.batches == plan
    _assert_same_training(got, want, steps=3)
    _assert_loss_aware_ran(calls, steps=3 * len(plan))


@pytest.mark.parametrize("layout", ["padded", *sorted(LAYOUTS)])
def test_pad_to_multiple_of_pads_the_batches_and_trains_the_same(tmp_path, layout):
    """pad_to_multiple_of (TRL's flag) rounds every micro-batch's length up: padded rows get
    right padding, a padding-free row one padding segment; losses, metrics and weights are
    those of the unpadded run (the padding is neither scored nor seen)."""
    rows, extra = _edge_rows(), LAYOUTS.get(layout, {})
    want = _run(tmp_path / "plain", rows, per_device_train_batch_size=4, max_steps=2, **extra)
    got = _run(tmp_path / "multiple", rows, per_device_train_batch_size=4, max_steps=2, pad_to_multiple_of=48, **extra)
    _assert_same_training(got, want, steps=2)
    collate, prepared = got[2].data_collator, got[2].train_dataset
    lengths = [collate([prepared[i] for i in range(j, j + 4)])["input_ids"].shape[1] for j in range(0, 16, 4)]
    plain = [want[2].data_collator([prepared[i] for i in range(j, j + 4)])["input_ids"].shape[1] for j in range(0, 16, 4)]
    assert all(n % 48 == 0 for n in lengths) and lengths != plain, (lengths, plain)
    assert [-(-n // 48) * 48 for n in plain] == lengths


def test_pad_to_multiple_of_is_checked_in_the_config(tmp_path):
    with pytest.raises(ValueError, match="pad_to_multiple_of must be a positive number"):
        _args(tmp_path, pad_to_multiple_of=0)


def test_token_budget_plan_is_dealt_to_the_dataloader_and_reshuffled_per_epoch(tmp_path):
    trainer = DPOTrainer(model=load_model(MODEL), args=_args(tmp_path, padding_free=True, max_tokens_per_batch=96,
                                                              train_sampling_strategy="random"),
                         train_dataset=_edge_rows())
    sampler = trainer.micro_batches.budget
    loader = trainer.get_train_dataloader()
    first = [batch["pair_tokens"].tolist() for batch in loader]
    assert len(first) == len(sampler) and all(sum(b) <= 96 for b in first)
    assert sum(len(b) for b in first) == 16  # every pair once
    loader.set_epoch(1)
    second = [batch["pair_tokens"].tolist() for batch in loader]
    assert sorted(map(sorted, second)) == sorted(map(sorted, first)) and second != first
    sequential = DPOTrainer(model=load_model(MODEL), args=_args(tmp_path, padding_free=True, max_tokens_per_batch=96),
                            train_dataset=_edge_rows())
    tokens = [dpo_row_tokens(r) for r in sequential.train_dataset]
    assert list(sequential.micro_batches.budget) == plan_micro_batches(tokens, 96, range(16))  # dataset order


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_precomputed_reference_and_evaluation_in_packed_rows(tmp_path, zen, layout):
    evaluation = load_dataset_any("builtin:zen", "standard_preference", split="test").select(range(7))
    options = dict(eval_strategy="no", per_device_eval_batch_size=3)
    want = _run(tmp_path / "padded", zen, fused_head=False, eval_dataset=evaluation, **options)
    got = _run(tmp_path / "packed", zen, eval_dataset=evaluation, precompute_ref_log_probs=True, **options,
               **LAYOUTS[layout])
    _assert_same_training(got, want, steps=2)
    # The store is keyed as the padded collator keys a row: one store serves either layout.
    padded_keys = DPOCollator(0, row_keys=True)(list(got[2].train_dataset))["row_key"]
    assert set(padded_keys.tolist()) <= set(got[2].reference_store._values)
    want_eval, got_eval = want[2].evaluate(), got[2].evaluate()
    timing = ("runtime", "per_second", "preparation_time")
    compared = [k for k in want_eval if not any(t in k for t in timing)]
    assert "eval_rewards/margins" in compared and "eval_loss" in compared
    scale = 2e-6 * 0.5 * abs(want_eval["eval_logps/chosen"])  # rewards: see _assert_same_training
    for key in compared:
        tol = 1e-6 + (scale if key.startswith("eval_rewards/") else 0.0)
        assert got_eval[key] == pytest.approx(want_eval[key], rel=1e-5, abs=tol), key


def test_group_by_length_groups_padded_batches_and_trains_like_one_batch(tmp_path):
    rows = _edge_rows()
    grouped = _run(tmp_path / "g", rows, train_sampling_strategy="group_by_length", per_device_train_batch_size=4,
                   gradient_accumulation_steps=4, max_steps=2)
    whole = _run(tmp_path / "w", rows, per_device_train_batch_size=16, max_steps=2)
    _assert_same_training(grouped, whole, steps=2)
    trainer = grouped[2]
    sampler = trainer._get_train_sampler()
    lengths = [len(r["prompt_ids"]) + max(len(r["chosen_ids"]), len(r["rejected_ids"])) for r in trainer.train_dataset]
    assert isinstance(sampler, LengthGroupedSampler) and sampler.lengths == lengths
    batches = [b["row_index"].tolist() for b in _indexed(trainer)]
    assert sorted(i for b in batches for i in b) == list(range(16))
    in_order = [list(range(i, i + 4)) for i in range(0, 16, 4)]
    assert padded_tokens(lengths, batches) < padded_tokens(lengths, in_order)


def _indexed(trainer):
    """The training batches, each with the dataset rows it holds (`row_index`)."""
    trainer.train_dataset = trainer.train_dataset.add_column("row_index", list(range(len(trainer.train_dataset))))
    return list(trainer.get_train_dataloader())


def test_packed_rows_refuse_what_cannot_run(tmp_path):
    with pytest.raises(ValueError, match="share_prompt.*add --padding_free true"):
        _args(tmp_path, share_prompt=True)
    with pytest.raises(ValueError, match="max_tokens_per_batch=64 packs whole pairs.*add --padding_free true"):
        _args(tmp_path, max_tokens_per_batch=64)
    with pytest.raises(ValueError, match="group_by_length.*token-budget sampler"):
        _args(tmp_path, padding_free=True, max_tokens_per_batch=64, train_sampling_strategy="group_by_length")
    with pytest.raises(ValueError, match="positive number of tokens"):
        _args(tmp_path, padding_free=True, max_tokens_per_batch=0)
    flash = load_model(MODEL)
    flash.config._attn_implementation = "flash_attention_2"
    with pytest.raises(PackedAttentionError, match="share_prompt: attention implementation 'flash_attention_2'"):
        DPOTrainer(model=flash, args=_args(tmp_path, padding_free=True, share_prompt=True), train_dataset=_edge_rows())
    gemma = load_model("builtin:tiny-gemma2")
    gemma.config._attn_implementation = "sdpa"
    with pytest.raises(PackedAttentionError, match="soft-caps its attention logits.*eager or flex_attention"):
        DPOTrainer(model=gemma, args=_args(tmp_path, padding_free=True), train_dataset=_edge_rows())
    with pytest.raises(DataError, match=r"row \d+: \d+ tokens in a packed row, over max_tokens_per_batch=60; raise"):
        DPOTrainer(model=load_model(MODEL), args=_args(tmp_path, padding_free=True, max_tokens_per_batch=60),
                   train_dataset=_edge_rows())


def test_a_step_batch_missing_a_part_its_loss_needs_is_refused(tmp_path, zen):
    """The sft term divides by the step's chosen tokens per pair: a prepared batch without that
    part is refused by name (it used to be a dict key whose absence changed the divisor), as is
    one that carries it for a loss without an sft term, a collated dict, and a batch without
    reference log-probs or with the wrong number of them."""
    torch.manual_seed(0)
    trainer = DPOTrainer(model=load_model(MODEL), args=_args(tmp_path, loss_type=["sigmoid", "sft"],
                                                            loss_weights=[1.0, 0.5]), train_dataset=zen)
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    prepared = trainer.prepare_step(trainer.model, [batch], "train")[0]
    assert isinstance(prepared, DPOStepBatch)
    # Trainer's floating-point-operation count reads the typed batch as it reads the collated dict.
    assert trainer.floating_point_ops(prepared) == trainer.floating_point_ops(batch) > 0
    chosen = (prepared.rows.labels[:4] != -100).sum()  # every pair of the batch keeps its tokens
    torch.testing.assert_close(prepared.sft_tokens_per_pair, chosen.double() / 4)
    with torch.no_grad():
        trainer.loss_and_metrics(trainer.model, prepared, "train")  # complete: accepted
        with pytest.raises(MissingPartError, match="DPOStepBatch has no sft_tokens_per_pair, which this "
                                                   "configuration needs: the sft term"):
            trainer.loss_and_metrics(trainer.model, dataclasses.replace(prepared, sft_tokens_per_pair=None), "train")
        with pytest.raises(TypeError, match="takes a DPOStepBatch \\(made by prepare_step\\), got dict"):
            trainer.loss_and_metrics(trainer.model, batch, "train")
    with pytest.raises(TypeError, match="ref_logps"):
        DPOStepBatch(prepared.rows)  # noqa: the reference's log-probs are not optional
    with pytest.raises(ValueError, match=r"DPOStepBatch.ref_logps has shape \(4,\); expected \(8,\)"):
        dataclasses.replace(prepared, ref_logps=prepared.ref_logps[:4])

    plain = DPOTrainer(model=load_model(MODEL), args=_args(tmp_path / "plain"), train_dataset=zen)
    prepared = plain.prepare_step(plain.model, [batch], "train")[0]
    assert prepared.sft_tokens_per_pair is None
    with torch.no_grad(), pytest.raises(MissingPartError, match="has sft_tokens_per_pair, which this configuration "
                                                                "does not use"):
        plain.loss_and_metrics(plain.model, dataclasses.replace(prepared, sft_tokens_per_pair=torch.tensor(3.0)),
                               "train")
