"""Distillation on packed rows (`padding_free`, `max_tokens_per_batch`) equals padded unfused training:
per-step loss, entropy and the final weights, for beta 0, 0.5 and 1, uneven completions (one-token
and truncated ones), a token budget just above the longest prompt + completion, and LoRA on the
student's head; both models read the same packed row; `share_prompt` is refused in one line."""

from __future__ import annotations

import warnings

import pytest
import torch
from datasets import Dataset

from fusedalign.configs import DistillationConfig
from fusedalign.data import load_dataset_any
from fusedalign.data.prompts import prepare_prompt_dataset
from fusedalign.models import load_model, load_tokenizer
from fusedalign.trainers.distillation import DistillationTrainer
from fusedalign.trainers.distillation_batch import DistillationBatch, PackedDistillationBatch
from tests.grpo_replay import uneven_replay
from tests.micro_batches import record_micro_batches

MODEL, TEACHER = "builtin:tiny-qwen2", "builtin:tiny-zen-teacher"
ROWS, T = 16, 0.9
COMPARED = ("loss", "entropy", "grad_norm", "num_tokens", "completions/mean_length", "completions/clipped_ratio")


@pytest.fixture(scope="module")
def prompts() -> Dataset:
    return load_dataset_any("builtin:zen", "standard_prompt_only").select(range(ROWS))


@pytest.fixture(scope="module")
def replay():
    # Lengths 1..11, every 3rd completion truncated (no EOS): one-token completions with and without EOS.
    return uneven_replay(ROWS, 1, load_tokenizer(MODEL).eos_token_id, truncate_every=3)


@pytest.fixture(scope="module")
def longest(prompts, replay) -> int:
    """Tokens of the longest prompt + a completion of max_completion_length (12; the replay's are 1 to 12):
    the smallest budget the trainer takes."""
    rows, _ = prepare_prompt_dataset(prompts, load_tokenizer(MODEL))
    assert max(len(replay.records[(r, 0)][0]) for r in range(ROWS)) == 12
    return max(len(rows[r]["prompt_ids"]) for r in range(ROWS)) + 12


def _args(tmp_path, **overrides) -> DistillationConfig:
    values = dict(
        output_dir=str(tmp_path), max_steps=3, learning_rate=0.5, optim="sgd", lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, max_grad_norm=0.0, per_device_train_batch_size=4,
        gradient_accumulation_steps=2, max_completion_length=12, temperature=T, logging_steps=1, save_strategy="no",
        seed=0, report_to="none", disable_tqdm=True, shuffle_dataset=False,
    )
    values.update(overrides)
    return DistillationConfig(**values)


def _train(tmp_path, prompts, replay, peft_config=None, **overrides):
    torch.manual_seed(0)
    trainer = DistillationTrainer(load_model(MODEL), TEACHER, args=_args(tmp_path, **overrides), train_dataset=prompts,
                                  generator=replay, peft_config=peft_config)
    seen = record_micro_batches(trainer)
    initial = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    trainer.train()
    logs = [e for e in trainer.state.log_history if "loss" in e]
    return logs, {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}, seen, initial


def _assert_same_training(packed, padded):
    assert len(packed[0]) == len(padded[0]) == 3
    for step, (a, b) in enumerate(zip(packed[0], padded[0])):
        for key in COMPARED:
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), (step, key)
    assert len(set(r["loss"] for r in padded[0])) == 3 and all(r["loss"] > 0 for r in padded[0])
    assert any(not torch.equal(v, padded[3][k]) for k, v in padded[1].items())  # training moved the weights
    for key, value in padded[1].items():
        torch.testing.assert_close(packed[1][key], value, rtol=1e-5, atol=1e-6, msg=key)


def _assert_packed(seen, budget: int | None, micro_batches: int | None = 6):
    """`seen`: every forward's batch; `micro_batches`: how many (None: not checked)."""
    assert micro_batches is None or len(seen) == micro_batches
    assert all(isinstance(b, PackedDistillationBatch) for b in seen)
    for b in seen:
        assert b.rows.input_ids.shape[0] == 1 and b.rows.num_sequences >= 1
        assert not bool((b.rows.parent_ids >= 0).any())  # each sequence its own prompt: nothing shared
        # No padding: the row holds exactly the prompt + completion tokens of its sequences.
        assert b.rows.forward_tokens() == int(b.rows.sequence_tokens.sum())
    if budget is not None:
        assert max(b.rows.forward_tokens() for b in seen) <= budget


def _padded_cut(seen) -> list[list[int]]:
    """Each micro-batch's sequences by their length (prompt + completion), sorted: what a row holds."""
    return [sorted(int(t) for t in b.rows.sequence_tokens) for b in seen]


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_packed_fused_equals_padded_unfused(tmp_path, prompts, replay, longest, beta):
    """8 sequences a step in 4 forwards under a budget of two longest sequences: the step's sequences are
    regrouped into the budget's rows (not the padded micro-batches), no row over it, no padding."""
    common = dict(beta=beta, per_device_train_batch_size=2, gradient_accumulation_steps=4)
    budget = 2 * longest + 1
    padded = _train(tmp_path / "p", prompts, replay, fused_head=False, **common)
    assert all(isinstance(b, DistillationBatch) for b in padded[2])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the budget holds each step in its 4 rows
        packed = _train(tmp_path / "k", prompts, replay, padding_free=True, max_tokens_per_batch=budget, **common)
    _assert_same_training(packed, padded)
    _assert_packed(packed[2], budget, micro_batches=12)
    assert _padded_cut(packed[2]) != [sorted(int(m.sum()) for m in b.attention_mask) for b in padded[2]]


def test_packed_without_a_budget_equals_padded_and_holds_each_micro_batch_in_one_row(tmp_path, prompts, replay):
    padded = _train(tmp_path / "p", prompts, replay, beta=0.5, fused_head=False)
    packed = _train(tmp_path / "k", prompts, replay, beta=0.5, padding_free=True)
    _assert_same_training(packed, padded)
    _assert_packed(packed[2], None)
    assert [b.rows.num_sequences for b in packed[2]] == [4] * 6


def test_a_budget_just_above_the_longest_sequence(tmp_path, prompts, replay, longest):
    """Budget = longest + 1: with 8 forwards a step every row fits it; with 2 the step's 8 sequences
    cannot, and each micro-batch is trained as several rows of the budget, one forward and backward
    each. Both train as padded batches, no row over the budget, no warning."""
    budget = longest + 1
    common = dict(beta=1.0, per_device_train_batch_size=1, gradient_accumulation_steps=8)
    padded = _train(tmp_path / "p", prompts, replay, fused_head=False, **common)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        packed = _train(tmp_path / "k", prompts, replay, padding_free=True, max_tokens_per_batch=budget, **common)
    _assert_same_training(packed, padded)
    _assert_packed(packed[2], budget, micro_batches=24)
    padded = _train(tmp_path / "p2", prompts, replay, beta=1.0, fused_head=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        packed = _train(tmp_path / "k2", prompts, replay, beta=1.0, padding_free=True, max_tokens_per_batch=budget)
    _assert_same_training(packed, padded)
    _assert_packed(packed[2], budget, micro_batches=None)
    assert len(packed[2]) > 6  # 6 micro-batches, more forwards


def test_packed_fused_equals_padded_unfused_with_lora_on_the_students_head(tmp_path, prompts, replay, longest):
    from peft import LoraConfig

    def lora():
        return LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                          target_modules=["q_proj", "v_proj", "lm_head"])

    common = dict(beta=0.5, per_device_train_batch_size=2, gradient_accumulation_steps=4)
    padded = _train(tmp_path / "p", prompts, replay, peft_config=lora(), fused_head=False, **common)
    packed = _train(tmp_path / "k", prompts, replay, peft_config=lora(), padding_free=True,
                    max_tokens_per_batch=2 * longest + 1, **common)
    _assert_same_training(packed, padded)
    head = [n for n in packed[1] if "lm_head" in n and "lora_" in n]
    assert head and any(not torch.equal(packed[1][n], packed[3][n]) for n in head)  # the head's adapter learned


def test_packed_evaluation_equals_padded(tmp_path, prompts, replay):
    got = {}
    for packed in (True, False):
        trainer = DistillationTrainer(load_model(MODEL), TEACHER, train_dataset=prompts, eval_dataset=prompts,
                                      generator=replay, args=_args(tmp_path, per_device_eval_batch_size=5, beta=0.3,
                                                                   padding_free=packed, fused_head=packed))
        got[packed] = trainer.evaluate()
    assert got[True]["eval_loss"] > 0
    for key in ("eval_loss", "eval_entropy", "eval_completions/mean_length"):
        assert got[True][key] == pytest.approx(got[False][key], rel=1e-5), key


def test_share_prompt_is_refused_in_one_line(tmp_path):
    for flags in (dict(padding_free=True, share_prompt=True), dict(share_prompt=True)):
        with pytest.raises(ValueError, match=r"^--share_prompt: distillation samples one completion per prompt"):
            _args(tmp_path, **flags)
    with pytest.raises(ValueError, match="add --padding_free true"):
        _args(tmp_path, max_tokens_per_batch=64)
    with pytest.raises(ValueError, match="max_tokens_per_batch=16 cannot hold one completion"):
        _args(tmp_path, padding_free=True, max_tokens_per_batch=16, max_prompt_length=8)
