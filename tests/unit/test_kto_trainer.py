"""KTOTrainer on a tiny model: fused = unfused, any split of the step trains the same,
reference modes, z0 and the loss against a hand computation, one-class batches, bad input;
padding-free, shared-prompt (the reference's joint row) and token-budget training equal padded
training (every logged value, weights, evaluation, precomputed reference), also on edge rows
(one-token completions and prompt, no prompt, nothing to score, cut prompts and completions) on
tiny-qwen2, tiny-llama and tiny-gemma2 (eager; sdpa refused)."""

from __future__ import annotations

import dataclasses
import logging
import math
import random

import pytest
import torch
from datasets import Dataset

from fusedalign.attention import PackedAttentionError
from fusedalign.configs import KTOConfig
from fusedalign.data import DataError, load_dataset_any, position_labels
from fusedalign.data.kto import KLPairCollator, kl_partners
from fusedalign.data.preference_batches import kto_row_tokens
from fusedalign.data.samplers import TokenBudgetBatchSampler
from fusedalign.head import token_logprobs
from fusedalign.models import load_model, load_tokenizer
from fusedalign.trainers.base import MissingPartError
from fusedalign.trainers.kto import KTOTrainer
from fusedalign.trainers.preference_steps import KTOStepBatch

MODEL = "builtin:tiny-qwen2"
ROWS = 24


@pytest.fixture(scope="module")
def zen() -> Dataset:
    return load_dataset_any("builtin:zen", "standard_unpaired_preference").select(range(ROWS))


@pytest.fixture(scope="module")
def warm_state() -> dict[str, torch.Tensor]:
    """The checkpoint after 3 Adam steps of language modelling on zen.

    Used as the policy, with the checkpoint itself as the reference: log-ratios and the KL
    reference point z0 are then non-zero from the first step (a fresh policy equals its
    reference, and the tiny model's z0 stays clamped at 0 for a few steps).
    """
    torch.manual_seed(0)
    model = load_model(MODEL)
    tokenizer = load_tokenizer(MODEL)
    rows = load_dataset_any("builtin:zen", "standard_unpaired_preference")
    batch = tokenizer([r["prompt"] + r["completion"] for r in rows.select(range(64))], return_tensors="pt", padding=True)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(3):
        optimizer.zero_grad()
        model(**batch, labels=labels).loss.backward()
        optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _policy(state: dict[str, torch.Tensor] | None = None):
    model = load_model(MODEL)
    if state is not None:
        model.load_state_dict(state)
    return model


def _args(tmp_path, **overrides) -> KTOConfig:
    values = dict(
        output_dir=str(tmp_path), max_steps=3, learning_rate=0.1, optim="sgd", lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, max_grad_norm=0.0, per_device_train_batch_size=4,
        per_device_eval_batch_size=4, train_sampling_strategy="sequential", logging_steps=1, save_strategy="no",
        report_to="none", seed=0, data_seed=0, dataloader_drop_last=True, max_length=64, max_prompt_length=32,
        disable_tqdm=True, beta=0.5,
    )
    values.update(overrides)
    return KTOConfig(**values)


def _train(policy, args, data, **kwargs):
    trainer = KTOTrainer(policy, args=args, train_dataset=data, **kwargs)
    trainer.train()
    history = trainer.state.log_history
    losses = [e["loss"] for e in history if "loss" in e]
    kls = [e["kl"] for e in history if "kl" in e]
    weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return trainer, losses, kls, weights


def _assert_same_run(a, b, rtol=1e-5):
    (_, losses_a, kl_a, weights_a), (_, losses_b, kl_b, weights_b) = a, b
    assert len(losses_a) == len(losses_b) == 3
    torch.testing.assert_close(torch.tensor(losses_a), torch.tensor(losses_b), rtol=rtol, atol=0)
    torch.testing.assert_close(torch.tensor(kl_a), torch.tensor(kl_b), rtol=rtol, atol=1e-6)
    for name, value in weights_b.items():
        torch.testing.assert_close(weights_a[name], value, rtol=rtol, atol=1e-7, msg=name)


@pytest.fixture(scope="module")
def baseline(tmp_path_factory, zen, warm_state):
    """3 steps, fused, per-device batch 4, no accumulation, a separate reference model."""
    return _train(_policy(warm_state), _args(tmp_path_factory.mktemp("baseline")), zen)


def _first_batch(trainer):
    return next(iter(trainer.get_train_dataloader()))


# ------------------------------------------------------------------ parity


def test_fused_equals_unfused_losses_and_weights(tmp_path, zen, warm_state, baseline):
    assert baseline[0].args.fused_head
    unfused = _train(_policy(warm_state), _args(tmp_path, fused_head=False), zen)
    assert max(baseline[2]) > 0  # the KL term is exercised, not clamped away
    _assert_same_run(baseline, unfused)


@pytest.mark.parametrize("per_device, accumulation", [(2, 2), (1, 4)])
def test_any_split_of_the_step_trains_the_same(tmp_path, zen, warm_state, baseline, per_device, accumulation):
    """KL pairs are fixed per row and z0 is taken over the whole optimizer step, so
    accumulating micro-batches equals one big batch exactly (TRL's per-micro-batch z0 would
    differ); a per-device batch of 1 is fine when the step has more than one example."""
    split = _train(
        _policy(warm_state),
        _args(tmp_path, per_device_train_batch_size=per_device, gradient_accumulation_steps=accumulation),
        zen,
    )
    _assert_same_run(split, baseline)


def test_precomputed_reference_equals_on_the_fly_and_skips_the_reference(tmp_path, zen, warm_state, baseline):
    trainer = KTOTrainer(_policy(warm_state), args=_args(tmp_path, precompute_ref_log_probs=True,
                                                          per_device_eval_batch_size=8), train_dataset=zen)
    rows_seen = []
    trainer.ref_model.register_forward_hook(lambda module, args, kwargs, out: rows_seen.append(kwargs["input_ids"].shape[0]),
                                            with_kwargs=True)
    trainer.train()
    history = trainer.state.log_history
    precomputed = (trainer, [e["loss"] for e in history if "loss" in e], [e["kl"] for e in history if "kl" in e],
                   {n: p.detach().clone() for n, p in trainer.model.named_parameters()})
    _assert_same_run(precomputed, baseline)
    # One pass over the dataset, completions and KL pairs stacked (2 x 8 rows), then never again.
    assert rows_seen == [16] * (ROWS // 8)
    table = trainer.reference_store.table
    assert table.shape == (ROWS, 2) and bool((table[:, 1] != 0).all())


# ------------------------------------------------------------------ what is computed


def _sequence_logps(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + completion])
    mask = torch.tensor([[0] * len(prompt) + [1] * len(completion)])
    labels = position_labels(ids, mask)
    return token_logprobs(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, targets=labels, fused=False).logps.sum()


def test_z0_and_loss_match_a_hand_computation_and_no_gradient_flows_through_z0(tmp_path, zen, warm_state):
    trainer = KTOTrainer(_policy(warm_state), args=_args(tmp_path, beta=0.3, desirable_weight=1.5), train_dataset=zen)
    rows = trainer.train_dataset
    partners = kl_partners(ROWS, seed=0)
    assert all(p != i for i, p in enumerate(partners))
    assert rows["kl_completion_ids"] == [rows[p]["completion_ids"] for p in partners]

    batch = _first_batch(trainer)
    policy, reference = trainer.model, trainer.ref_model
    policy.zero_grad()
    trainer.compute_loss(policy, batch).backward()  # a local mean outside the training loop
    got = {n: p.grad.clone() for n, p in policy.named_parameters()}

    policy.zero_grad()
    index = list(range(batch["input_ids"].shape[0]))  # sequential order: the first batch holds rows 0..B-1
    first = rows[0]["prompt_ids"] + rows[0]["completion_ids"]
    assert batch["input_ids"][0, :len(first)].tolist() == first
    with torch.no_grad():
        kl = [_sequence_logps(policy, rows[i]["prompt_ids"], rows[i]["kl_completion_ids"])
              - _sequence_logps(reference, rows[i]["prompt_ids"], rows[i]["kl_completion_ids"]) for i in index]
    z0 = max(0.0, float(sum(kl)) / len(kl))
    assert z0 > 0
    losses = []
    for i in index:
        r = _sequence_logps(policy, rows[i]["prompt_ids"], rows[i]["completion_ids"]) - _sequence_logps(
            reference, rows[i]["prompt_ids"], rows[i]["completion_ids"]).detach()
        if rows[i]["label"]:
            losses.append(1.5 * (1 - torch.sigmoid(0.3 * (r - z0))))
        else:
            losses.append(1 - torch.sigmoid(0.3 * (z0 - r)))
    expected = torch.stack(losses).mean()
    expected.backward()
    prepared = trainer.prepare_step(policy, [batch], "eval")[0]
    torch.testing.assert_close(prepared.kl, torch.tensor(z0), rtol=1e-5, atol=0)
    assert torch.isclose(trainer.compute_loss(policy, batch).detach(), expected.detach(), rtol=1e-5)
    for name, param in policy.named_parameters():
        torch.testing.assert_close(got[name], param.grad, rtol=1e-4, atol=1e-7, msg=name)


def test_peft_reference_is_the_policy_with_its_adapter_disabled(tmp_path, zen):
    from peft import LoraConfig

    torch.manual_seed(0)
    lora = LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8, lora_dropout=0.0,
                      target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    trainer = KTOTrainer(_policy(), args=_args(tmp_path, max_steps=2), train_dataset=zen, peft_config=lora)
    assert trainer.ref_model is None
    batch = _first_batch(trainer)
    prepared = trainer.prepare_step(trainer.model, [batch], "eval")[0]
    base = _policy()
    labels = position_labels(batch["input_ids"], batch["completion_mask"])
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    with torch.no_grad():
        expected = token_logprobs(base, inputs, targets=labels, fused=False).logps.sum(-1)
        adapted = token_logprobs(trainer.model, inputs, targets=labels, fused=False).logps.sum(-1)
    torch.testing.assert_close(prepared.ref_logps, expected, rtol=1e-5, atol=1e-5)
    assert (adapted - expected).abs().max() > 1e-3  # the adapter is on in the policy

    lora_before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" in n}
    trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    for name, param in trainer.model.named_parameters():
        if "lora_" in name:
            assert not torch.equal(param, lora_before[name]), name
    base_after = {n.replace("base_model.model.", "").replace(".base_layer", ""): p
                  for n, p in trainer.model.named_parameters() if "lora_" not in n}
    for name, param in base.named_parameters():
        assert torch.equal(base_after[name], param), name


@pytest.mark.parametrize("loss_type", ["kto", "apo_zero_unpaired"])
@pytest.mark.parametrize("label", [True, False])
def test_one_class_data_warns_and_gives_finite_connected_losses(tmp_path, zen, warm_state, caplog, label, loss_type):
    one_class = zen.filter(lambda row: row["label"] == label)
    with caplog.at_level(logging.WARNING):
        trainer = KTOTrainer(_policy(warm_state), args=_args(tmp_path, loss_type=loss_type), train_dataset=one_class)
    warning = caplog.text
    assert "desirable_weight" in warning and "undesirable_weight" in warning and "[1, 4/3]" in warning
    batch = _first_batch(trainer)
    loss = trainer.compute_loss(trainer.model, batch)
    assert torch.isfinite(loss)
    loss.backward()
    for name, param in trainer.model.named_parameters():
        assert param.grad is not None and bool(torch.isfinite(param.grad).all()), name
    metrics = trainer.metrics.read("train" if trainer.model.training else "eval")
    absent = "count/undesirable" if label else "count/desirable"
    assert metrics[absent] == 0


def test_metrics_counts_are_per_step_totals_and_margins_derived(tmp_path, zen, warm_state):
    evaluation = load_dataset_any("builtin:zen", "standard_unpaired_preference", split="test").select(range(8))
    trainer = KTOTrainer(_policy(warm_state), args=_args(tmp_path, max_steps=4, logging_steps=2), train_dataset=zen,
                         eval_dataset=evaluation)
    trainer.train()
    logs = [e for e in trainer.state.log_history if "loss" in e]
    assert len(logs) == 2
    for entry in logs:
        assert entry["count/desirable"] + entry["count/undesirable"] == 4  # per step, not per window or mean
        assert entry["rewards/margins"] == pytest.approx(entry["rewards/chosen"] - entry["rewards/rejected"])
        for key in ("logps/chosen", "logps/rejected", "kl"):
            assert math.isfinite(entry[key])
    metrics = trainer.evaluate()
    assert metrics["eval_count/desirable"] + metrics["eval_count/undesirable"] == 8
    assert metrics["eval_rewards/margins"] == pytest.approx(metrics["eval_rewards/chosen"] - metrics["eval_rewards/rejected"])


def test_conversational_and_paired_data(tmp_path):
    conversational = load_dataset_any("builtin:zen", "conversational_unpaired_preference").select(range(8))
    trainer = KTOTrainer(_policy(), args=_args(tmp_path / "c", max_steps=1), train_dataset=conversational)
    assert torch.isfinite(trainer.compute_loss(trainer.model, _first_batch(trainer)))

    paired = load_dataset_any("builtin:zen", "standard_preference").select(range(6))
    with pytest.raises(DataError, match="unpair_preference"):
        KTOTrainer(_policy(), args=_args(tmp_path / "p"), train_dataset=paired)
    trainer = KTOTrainer(_policy(), args=_args(tmp_path / "p", unpair_preference=True), train_dataset=paired)
    assert len(trainer.train_dataset) == 12 and sum(trainer.train_dataset["label"]) == 6


# ------------------------------------------------------------------ bad input


def test_non_boolean_label_is_refused(tmp_path):
    data = Dataset.from_dict({"prompt": ["a", "b"], "completion": [" x", " y"], "label": ["yes", "no"]})
    with pytest.raises(DataError, match="label"):
        KTOTrainer(_policy(), args=_args(tmp_path), train_dataset=data)


def test_too_few_examples_per_step_for_the_kl_estimate(tmp_path, zen):
    with pytest.raises(ValueError, match=r"per_device_train_batch_size=1.*at least 2|at least 2.*per_device_train_batch_size=1"):
        KTOTrainer(_policy(), args=_args(tmp_path, per_device_train_batch_size=1), train_dataset=zen)
    # No KL term, no constraint.
    KTOTrainer(_policy(), args=_args(tmp_path, per_device_train_batch_size=1, loss_type="apo_zero_unpaired"),
               train_dataset=zen)


def test_options_checked_at_parse_time(tmp_path):
    with pytest.raises(ValueError, match="loss_type"):
        KTOConfig(output_dir=str(tmp_path), loss_type="sigmoid")
    with pytest.raises(ValueError, match="beta"):
        KTOConfig(output_dir=str(tmp_path), beta=0.0)
    with pytest.raises(ValueError, match="undesirable_weight"):
        KTOConfig(output_dir=str(tmp_path), undesirable_weight=-1.0)


def test_unbalanced_weights_warn_with_the_ranges(tmp_path, zen, caplog):
    unbalanced = zen.filter(lambda row, i: row["label"] or i < 4, with_indices=True)  # 12 desirable, 2 undesirable
    with caplog.at_level(logging.WARNING):
        KTOTrainer(_policy(), args=_args(tmp_path), train_dataset=unbalanced)
    assert "EITHER desirable_weight in [0.167, 0.222] OR undesirable_weight in [4.5, 6]" in caplog.text


def test_cli_demo_defaults(tmp_path):
    from fusedalign.cli import parse
    from fusedalign.configs import ModelArguments, ScriptArguments

    script, args, model = parse("kto", (ScriptArguments, KTOConfig, ModelArguments), ["--output_dir", str(tmp_path)])
    assert (model.model_name_or_path, script.dataset_name, script.dataset_config) == (
        "builtin:tiny-qwen2", "builtin:zen", "standard_unpaired_preference")
    assert args.eval_strategy == "epoch" and args.loss_type == "kto"


# ------------------------------------------------------------------ padding-free and shared-prompt rows


LAYOUTS = {"padding_free": dict(padding_free=True), "shared_prompt": dict(padding_free=True, share_prompt=True)}


def _logs(trainer) -> list[dict]:
    return [{k: v for k, v in e.items() if k != "step"} for e in trainer.state.log_history if "loss" in e]


def _assert_same_logs(got, want, steps: int = 3, beta: float = 0.5):
    """Every logged value of every step (losses, kl, rewards/*, logps/*, logits/*, entropy, counts,
    num_tokens, grad_norm), and the final weights, to 1e-5 (weights: 1e-7 absolute).

    Rewards and z0 are beta times differences of float32 sums of size |logps| ("scale"): the fused
    head's rounding against the unfused one (~1e-7 of a log-prob) enters them as about
    1e-7 of that scale, compared to 2e-6 of it. Through the loss's sigmoid the same error enters
    every gradient: grad_norm gets 1e-7 of the largest step's scale on top of its 1e-5, the weights
    (SGD) 1e-8 of it on top of their 1e-7. Rows of 200 tokens (scale 163) need that: there the
    fused head against the unfused one, padded rows both, differed by 1.1e-5 in grad_norm and by
    6.5e-7 in a weight on an AVX-512/AMX Xeon; accumulating in two micro-batches, by 1.2e-7 and
    3.4e-8."""
    got_logs, want_logs = _logs(got[0]), _logs(want[0])
    assert len(got_logs) == len(want_logs) == steps
    largest = 0.0
    for g, w in zip(got_logs, want_logs):
        assert set(g) == set(w)
        scale = beta * max(abs(w["logps/chosen"]), abs(w["logps/rejected"]))
        largest = max(largest, scale)
        for key, value in w.items():
            if key == "grad_norm":
                continue
            tol = 1e-6 + (2e-6 * scale if key.startswith("rewards/") or key == "kl" else 0.0)
            assert g[key] == pytest.approx(value, rel=1e-5, abs=tol), (key, g[key], value)
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-5 + 1e-7 * largest), (g["grad_norm"], w)
    for name, value in want[3].items():
        torch.testing.assert_close(got[3][name], value, rtol=1e-5, atol=1e-7 + 1e-8 * largest,
                                   msg=lambda m, n=name: f"{n}: {m}")


@pytest.fixture(scope="module")
def llama_baseline(tmp_path_factory, zen):
    """tiny-llama as the policy, tiny-qwen2 (same tokenizer) as its reference: z0 > 0 from step 1."""
    return _train(load_model("builtin:tiny-llama"), _args(tmp_path_factory.mktemp("llama"), fused_head=False), zen,
                  ref_model=load_model(MODEL))


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_packed_rows_train_like_padded_rows(tmp_path, zen, warm_state, baseline, layout, fused):
    """Completions, KL partners and the reference's joint row packed (the prompt shared there with
    share_prompt): per-step losses, z0, every metric and the final weights equal the padded run's."""
    got = _train(_policy(warm_state), _args(tmp_path, fused_head=fused, **LAYOUTS[layout]), zen)
    batch = _first_batch(got[0])
    assert batch["input_ids"].shape[0] == batch["kl_input_ids"].shape[0] == batch["joint_input_ids"].shape[0] == 1
    joint = batch["joint_input_ids"].shape[1]
    unshared = batch["input_ids"].shape[1] + batch["kl_input_ids"].shape[1]
    assert joint < unshared if layout == "shared_prompt" else joint == unshared
    assert max(baseline[2]) > 0  # z0 is live
    _assert_same_logs(got, baseline)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_packed_rows_train_like_padded_rows_on_llama(tmp_path, zen, llama_baseline, layout):
    got = _train(load_model("builtin:tiny-llama"), _args(tmp_path, **LAYOUTS[layout]), zen, ref_model=load_model(MODEL))
    assert max(llama_baseline[2]) > 0
    _assert_same_logs(got, llama_baseline)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_token_budget_micro_batches_train_like_one_padded_batch(tmp_path, zen, warm_state, layout):
    """Every micro-batch of the plan in one step (an example with its KL partner never split, z0 over
    the step), micro-batches of different sizes: the steps of one padded batch of all 24 rows."""
    want = _train(_policy(warm_state), _args(tmp_path / "padded", per_device_train_batch_size=ROWS), zen)
    share = layout == "shared_prompt"
    tokens = [kto_row_tokens(r, share) for r in want[0].train_dataset]
    budget = 2 * max(tokens) - 1  # the longest example and any shorter one, but never two of the longest
    plan = TokenBudgetBatchSampler(tokens, budget, seed=0).batches
    assert len(plan) >= 4 and len({len(b) for b in plan}) >= 2, plan
    got = _train(_policy(warm_state), _args(tmp_path / "budget", max_tokens_per_batch=budget, per_device_train_batch_size=1,
                                            gradient_accumulation_steps=len(plan), train_sampling_strategy="random",
                                            **LAYOUTS[layout]), zen)
    assert got[0].micro_batches.budget.batches == plan
    _assert_same_logs(got, want)


@pytest.mark.parametrize("layout", ["padded", *sorted(LAYOUTS)])
def test_pad_to_multiple_of_pads_every_row_and_trains_the_same(tmp_path, zen, warm_state, baseline, layout):
    """TRL's pad_to_multiple_of: every row of a micro-batch (completions, KL partners, the reference's
    joint row) rounded up to a multiple; every logged value and weight as without it."""
    got = _train(_policy(warm_state), _args(tmp_path, pad_to_multiple_of=40, **LAYOUTS.get(layout, {})), zen)
    batch = _first_batch(got[0])
    widths = {k: v.shape[1] for k, v in batch.items() if k.endswith("input_ids")}
    assert len(widths) >= 2 and all(w % 40 == 0 for w in widths.values()), widths
    _assert_same_logs(got, baseline)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_precomputed_reference_and_evaluation_in_packed_rows(tmp_path, zen, warm_state, baseline, layout):
    evaluation = load_dataset_any("builtin:zen", "standard_unpaired_preference", split="test").select(range(7))
    got = _train(_policy(warm_state), _args(tmp_path, precompute_ref_log_probs=True, per_device_eval_batch_size=3,
                                            **LAYOUTS[layout]), zen, eval_dataset=evaluation)
    _assert_same_logs(got, baseline)
    padded_keys = KLPairCollator(0, row_keys=True)(list(got[0].train_dataset))["row_key"]
    assert got[0].reference_store.table.shape == (ROWS + 7, 2)  # training and evaluation rows
    assert set(padded_keys.tolist()) <= set(got[0].reference_store._values)  # one store for either layout
    want = KTOTrainer(_policy(warm_state), args=_args(tmp_path / "e", per_device_eval_batch_size=3), train_dataset=zen,
                      eval_dataset=evaluation)
    want.model.load_state_dict(got[0].model.state_dict())
    want_eval, got_eval = want.evaluate(), got[0].evaluate()
    timing = ("runtime", "per_second", "preparation_time")
    # `want` did not train: its epoch and training token count differ by construction.
    compared = [k for k in want_eval if not any(t in k for t in timing) and k not in ("epoch", "eval_num_tokens")]
    assert "eval_kl" in compared and "eval_rewards/chosen" in compared
    for key in compared:
        assert got_eval[key] == pytest.approx(want_eval[key], rel=1e-5, abs=1e-5), key


def test_packed_rows_without_kl_pairs(tmp_path, zen, warm_state):
    args = dict(loss_type="apo_zero_unpaired")
    want = _train(_policy(warm_state), _args(tmp_path / "padded", **args), zen)
    got = _train(_policy(warm_state), _args(tmp_path / "packed", padding_free=True, share_prompt=True, **args), zen)
    assert "kl_input_ids" not in _first_batch(got[0])
    _assert_same_logs(got, want)


def test_packed_rows_refuse_what_cannot_run(tmp_path, zen):
    with pytest.raises(ValueError, match="max_tokens_per_batch=64 packs whole examples.*add --padding_free true"):
        _args(tmp_path, max_tokens_per_batch=64)
    flash = _policy()
    flash.config._attn_implementation = "flash_attention_2"
    with pytest.raises(PackedAttentionError, match="share_prompt: attention implementation 'flash_attention_2'"):
        KTOTrainer(flash, args=_args(tmp_path, padding_free=True, share_prompt=True), train_dataset=zen)
    with pytest.raises(DataError, match=r"row \d+: \d+ tokens in a packed row, over max_tokens_per_batch=20"):
        KTOTrainer(_policy(), args=_args(tmp_path, padding_free=True, max_tokens_per_batch=20), train_dataset=zen)
    # A budget fills micro-batches with as many examples as fit: a per-device batch of 1 is no limit then.
    KTOTrainer(_policy(), args=_args(tmp_path, padding_free=True, max_tokens_per_batch=512, per_device_train_batch_size=1),
               train_dataset=zen)


# ------------------------------------------------------------------ packed rows: edge cases, three models


EDGE = dict(max_length=48, max_prompt_length=24)
EDGE_ROWS = 16


def _tokens(g: random.Random, n: int) -> list[int]:
    return [g.randrange(1, 512) for _ in range(n)]


def _edge_rows(max_length: int = 48, max_prompt_length: int = 24, seed: int = 0, long: int = 0) -> Dataset:
    """Tokenised unpaired rows, both labels: one-token completions, a one-token prompt, no prompt
    (once with a one-token completion: nothing to score), a prompt over max_prompt_length and a
    completion over max_length (both cut when the split is prepared), uneven lengths; `long` more
    rows of 40-60 prompt and 15-30 completion tokens."""
    g = random.Random(seed)
    shapes = [(9, 1, True), (5, 1, False), (1, 6, False), (0, 4, True), (0, 1, True),
              (max_prompt_length + 16, 12, False), (6, max_length + 10, True)]
    shapes += [(g.randint(2, 20), g.randint(1, 16), i % 2 == 0) for i in range(EDGE_ROWS - len(shapes) - long)]
    shapes += [(g.randint(40, 60), g.randint(15, 30), i % 2 == 1) for i in range(long)]
    return Dataset.from_list([dict(prompt_ids=_tokens(g, p), completion_ids=_tokens(g, c), label=label)
                              for p, c, label in shapes])


def _assert_edges_cut(trainer, max_length: int = 48, max_prompt_length: int = 24) -> None:
    rows = trainer.train_dataset
    assert (len(rows[4]["prompt_ids"]), len(rows[4]["completion_ids"])) == (0, 1)  # nothing to score
    assert (len(rows[5]["prompt_ids"]), len(rows[5]["completion_ids"])) == (max_prompt_length, 12)
    assert (len(rows[6]["prompt_ids"]), len(rows[6]["completion_ids"])) == (6, max_length - 6)


def _edge_models(name: str, warm_state) -> tuple:
    """(policy, reference) that differ from the first step, so rewards and z0 are live: tiny-qwen2
    fresh with the warm checkpoint as its reference (on random tokens the fresh model is the more
    likely one: z0 > 0), tiny-llama with tiny-qwen2 (the same tokenizer)."""
    if name == "qwen2":
        return _policy(), _policy(warm_state)
    return load_model("builtin:tiny-llama"), load_model(MODEL)


@pytest.fixture(scope="module")
def edge_baselines(tmp_path_factory, warm_state):
    """Padded, unfused training on `_edge_rows`, per model (trained once, when first asked for)."""
    runs = {}

    def get(name: str):
        if name not in runs:
            policy, reference = _edge_models(name, warm_state)
            runs[name] = _train(policy, _args(tmp_path_factory.mktemp(f"edge-{name}"), fused_head=False, **EDGE),
                                _edge_rows(), ref_model=reference)
        return runs[name]

    return get


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("name", ["qwen2", "llama"])
def test_edge_rows_train_like_padded_rows(tmp_path, warm_state, edge_baselines, name, layout, fused):
    """One-token completions and prompt, no prompt, nothing to score, cut prompts and completions, uneven
    lengths: padding-free and shared-prompt training, fused or not, log every value of every step and
    end at the weights of padded unfused training."""
    want = edge_baselines(name)
    policy, reference = _edge_models(name, warm_state)
    got = _train(policy, _args(tmp_path, fused_head=fused, **EDGE, **LAYOUTS[layout]), _edge_rows(),
                 ref_model=reference)
    _assert_edges_cut(got[0])
    batch = _first_batch(got[0])
    assert batch["input_ids"].shape[0] == batch["joint_input_ids"].shape[0] == 1 and "attention_mask" not in batch
    assert min(want[2]) > 0  # z0 is live in every step
    _assert_same_logs(got, want)


def test_gemma2_edge_rows_train_like_padded_rows_on_eager_attention_past_its_window(tmp_path):
    """tiny-gemma2 soft-caps its attention logits: sdpa is refused for packed rows, eager trains like
    padded rows, in rows that reach past its first layer's 64-token sliding window."""
    options = dict(max_length=96, max_prompt_length=64)
    rows = _edge_rows(**options, long=4)
    sdpa = load_model("builtin:tiny-gemma2")
    sdpa.config._attn_implementation = "sdpa"  # transformers itself refuses to load Gemma 2 with sdpa
    with pytest.raises(PackedAttentionError, match="padding_free: Gemma2ForCausalLM soft-caps its attention logits, "
                                                   "which sdpa does not support; use --attn_implementation eager"):
        KTOTrainer(sdpa, args=_args(tmp_path / "sdpa", padding_free=True, **options), train_dataset=rows)

    def run(path, **layout):
        torch.manual_seed(1)
        policy = load_model("builtin:tiny-gemma2")
        with torch.no_grad():  # a policy off its reference from the first step
            for param in policy.parameters():
                param.add_(0.02 * torch.randn_like(param))
        return _train(policy, _args(tmp_path / path, **options, **layout), rows)

    want = run("padded", fused_head=False)
    assert want[0].model.config._attn_implementation == "eager"
    _assert_edges_cut(want[0], **options)
    prepared = want[0].train_dataset
    assert max(len(r["prompt_ids"]) + len(r["completion_ids"]) for r in prepared) > 64
    assert max(want[2]) > 0
    for layout in sorted(LAYOUTS):
        _assert_same_logs(run(layout, **LAYOUTS[layout]), want)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_edge_rows_straddling_token_budgets_train_like_one_padded_batch(tmp_path, warm_state, layout):
    """A budget just over the longest example (with its KL partner): an example that does not fit what
    is left of a micro-batch goes whole into another, micro-batches hold different numbers of examples;
    every step accumulates them all and equals one padded batch of the 16 rows."""
    policy, reference = _edge_models("qwen2", warm_state)
    want = _train(policy, _args(tmp_path / "padded", fused_head=False, per_device_train_batch_size=EDGE_ROWS, **EDGE),
                  _edge_rows(), ref_model=reference)
    share = layout == "shared_prompt"
    tokens = [kto_row_tokens(r, share) for r in want[0].train_dataset]
    budget = max(tokens) + 2
    plan = TokenBudgetBatchSampler(tokens, budget, seed=0).batches
    loads = [sum(tokens[i] for i in b) for b in plan]
    assert len(plan) >= 4 and len({len(b) for b in plan}) >= 2 and max(loads) <= budget, (plan, loads)
    # Examples that did not fit what an earlier micro-batch had left, and went whole into a later one.
    straddling = [i for k, b in enumerate(plan) for i in b
                  if any(load < budget < load + tokens[i] for load in loads[:k])]
    assert straddling, (plan, loads)
    policy, reference = _edge_models("qwen2", warm_state)
    got = _train(policy, _args(tmp_path / "budget", max_tokens_per_batch=budget, per_device_train_batch_size=1,
                               gradient_accumulation_steps=len(plan), train_sampling_strategy="random", **EDGE,
                               **LAYOUTS[layout]), _edge_rows(), ref_model=reference)
    assert got[0].micro_batches.budget.batches == plan
    assert min(want[2]) > 0
    _assert_same_logs(got, want)


@pytest.mark.parametrize("loss_type", ["kto", "apo_zero_unpaired"])
def test_a_step_batch_missing_a_part_its_loss_needs_is_refused(tmp_path, zen, loss_type):
    """kto subtracts the step's z0: a prepared batch without it is refused by name (it used to be a
    dict key), as is one that carries a z0 for apo_zero_unpaired, which has none; a collated dict
    and a batch with reference log-probs for other rows are refused too."""
    trainer = KTOTrainer(_policy(), args=_args(tmp_path, loss_type=loss_type), train_dataset=zen)
    batch = _first_batch(trainer)
    prepared = trainer.prepare_step(trainer.model, [batch], "train")[0]
    assert isinstance(prepared, KTOStepBatch) and (prepared.kl is not None) == (loss_type == "kto")
    assert prepared.desirable.tolist() == batch["label"].tolist()
    with torch.no_grad():
        trainer.loss_and_metrics(trainer.model, prepared, "train")  # complete: accepted
        if loss_type == "kto":
            missing = dataclasses.replace(prepared, kl=None)
            with pytest.raises(MissingPartError, match="KTOStepBatch has no kl, which this configuration needs: "
                                                       "loss_type 'kto' subtracts the KL reference point z0"):
                trainer.loss_and_metrics(trainer.model, missing, "train")
        else:
            extra = dataclasses.replace(prepared, kl=torch.tensor(0.5))
            with pytest.raises(MissingPartError, match="KTOStepBatch has kl, which this configuration does not use"):
                trainer.loss_and_metrics(trainer.model, extra, "train")
        with pytest.raises(TypeError, match="takes a KTOStepBatch \\(made by prepare_step\\), got dict"):
            trainer.loss_and_metrics(trainer.model, batch, "train")
    with pytest.raises(ValueError, match=r"KTOStepBatch.ref_logps has shape \(3,\); expected \(4,\)"):
        dataclasses.replace(prepared, ref_logps=prepared.ref_logps[:3])
