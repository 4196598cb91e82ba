"""Same flag, same meaning: DPO and KTO against TRL 1.16's definitions, computed by hand.

Each case is a place where the same flag once meant something else here: the sft term's
normalisation, rewards when the reference equals the policy, bco_pair's reward shift,
truncation defaults, cDPO, and the metrics TRL logs. Expected values are computed in the
test from the unfused model (`fused=False`), one row at a time, with TRL's formulas.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from datasets import Dataset

from fusedalign.configs import DPOConfig, KTOConfig
from fusedalign.data import load_dataset_any, position_labels
from fusedalign.head import IGNORE_INDEX, token_logprobs
from fusedalign.models import load_model
from fusedalign.trainers.dpo import DPOTrainer
from fusedalign.trainers.kto import KTOTrainer

MODEL, OTHER = "builtin:tiny-qwen2", "builtin:tiny-llama"  # same tokenizer


@pytest.fixture(scope="module")
def pairs() -> Dataset:
    return load_dataset_any("builtin:zen", "standard_preference").select(range(8))


def _dpo_args(tmp_path, **overrides) -> DPOConfig:
    values = dict(
        output_dir=str(tmp_path), max_steps=1, learning_rate=0.1, optim="sgd", lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, max_grad_norm=0.0, per_device_train_batch_size=4, logging_steps=1,
        save_strategy="no", seed=0, train_sampling_strategy="sequential", max_length=64, disable_tqdm=True,
        beta=0.5, report_to="none",
    )
    values.update(overrides)
    return DPOConfig(**values)


def _logs(trainer) -> list[dict]:
    return [entry for entry in trainer.state.log_history if "loss" in entry]


def _rows(trainer, count: int) -> list[dict]:
    return [trainer.train_dataset[i] for i in range(count)]  # sequential order


def _sequence(model, prompt: list[int], completion: list[int]):
    """Unfused log-probs [T], labels [T] and logits [T, V] of one prompt + completion."""
    ids = torch.tensor([prompt + completion])
    labels = position_labels(ids, torch.tensor([[0] * len(prompt) + [1] * len(completion)]))
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
        logps = token_logprobs(model, {"input_ids": ids}, targets=labels, fused=False).logps
    return logps[0], labels[0], logits[0]


# ------------------------------------------------------------------ 1. the sft term is a token mean


def test_sft_term_is_one_token_mean_over_the_steps_chosen_tokens(tmp_path, pairs):
    """TRL: cross-entropy over all chosen tokens of the batch; here over the optimizer step,
    which equals TRL's on one process without accumulation (2 micro-batches of 2 here)."""
    trainer = DPOTrainer(load_model(MODEL), args=_dpo_args(tmp_path, loss_type=["sft"], per_device_train_batch_size=2,
                                                         gradient_accumulation_steps=2), train_dataset=pairs)
    rows = _rows(trainer, 4)
    model = load_model(MODEL)
    total, tokens = 0.0, 0
    for row in rows:
        logps, labels, _ = _sequence(model, row["prompt_ids"], row["chosen_ids"])
        total -= float(logps.sum())
        tokens += int((labels != IGNORE_INDEX).sum())
    lengths = {len(r["chosen_ids"]) for r in rows}
    assert len(lengths) > 1  # uneven lengths: a mean of per-sequence means would differ
    trainer.train()
    assert _logs(trainer)[0]["loss"] == pytest.approx(total / tokens, rel=1e-5)


# ------------------------------------------------------------------ 2. equal models, zero rewards


@pytest.mark.parametrize("precompute", [False, True])
def test_rewards_are_exactly_zero_when_the_reference_equals_the_policy(tmp_path, pairs, precompute):
    trainer = DPOTrainer(load_model(MODEL), args=_dpo_args(tmp_path, precompute_ref_log_probs=precompute),
                         train_dataset=pairs)
    trainer.train()
    first = _logs(trainer)[0]
    assert first["rewards/chosen"] == 0.0 and first["rewards/rejected"] == 0.0 and first["rewards/margins"] == 0.0
    assert first["rewards/accuracies"] == 0.0
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-6)


# ------------------------------------------------------------------ 3. bco_pair


def _bco_expected(trainer, beta: float, shift: bool) -> float:
    """TRL 1.16's bco_pair (shift=False), or the BCO paper's with the running mean of this batch."""
    policy, reference = load_model(MODEL), load_model(OTHER)
    chosen, rejected = [], []
    for row in _rows(trainer, 4):
        for side, out in (("chosen_ids", chosen), ("rejected_ids", rejected)):
            p = float(_sequence(policy, row["prompt_ids"], row[side])[0].sum())
            r = float(_sequence(reference, row["prompt_ids"], row[side])[0].sum())
            out.append(beta * (p - r))
    delta = sum(chosen + rejected) / 8 if shift else 0.0
    losses = [-F.logsigmoid(torch.tensor(c - delta)) - F.logsigmoid(torch.tensor(-(r - delta)))
              for c, r in zip(chosen, rejected)]
    return float(torch.stack(losses).mean())


@pytest.mark.parametrize("running_mean", [False, True])
def test_bco_pair_is_trl_116s_by_default_and_the_running_shift_is_explicit(tmp_path, pairs, running_mean):
    args = _dpo_args(tmp_path, loss_type=["bco_pair"], bco_running_mean=running_mean, ref_model_name_or_path=OTHER)
    trainer = DPOTrainer(load_model(MODEL), args=args, train_dataset=pairs)
    trainer.train()
    want = _bco_expected(trainer, args.beta, shift=running_mean)
    assert _logs(trainer)[0]["loss"] == pytest.approx(want, rel=1e-5)
    assert _bco_expected(trainer, args.beta, shift=True) != pytest.approx(_bco_expected(trainer, args.beta, shift=False))


def test_bco_pair_with_the_default_config_is_trl_116s_without_a_running_shift(tmp_path, pairs):
    # Issue 18: the test above always passes bco_running_mean, so it cannot see the default.
    args = _dpo_args(tmp_path, loss_type=["bco_pair"], ref_model_name_or_path=OTHER)
    assert args.bco_running_mean is False and DPOConfig(output_dir=str(tmp_path)).bco_running_mean is False
    trainer = DPOTrainer(load_model(MODEL), args=args, train_dataset=pairs)
    assert trainer.bco_shift is None
    trainer.train()
    assert _logs(trainer)[0]["loss"] == pytest.approx(_bco_expected(trainer, args.beta, shift=False), rel=1e-5)


def test_bco_running_mean_survives_resume(tmp_path, pairs):
    def run(out, resume=None):
        args = _dpo_args(out, loss_type=["bco_pair"], bco_running_mean=True, ref_model_name_or_path=OTHER,
                         max_steps=2, per_device_train_batch_size=2, save_strategy="steps", save_steps=1)
        trainer = DPOTrainer(load_model(MODEL), args=args, train_dataset=pairs)
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    straight = run(tmp_path / "a")
    resumed = run(tmp_path / "b")
    checkpoint = tmp_path / "b" / "checkpoint-1"
    assert (checkpoint / "fusedalign_state.json").is_file()
    again = run(tmp_path / "b", resume=str(checkpoint))
    assert again.bco_shift.state_dict() == pytest.approx(straight.bco_shift.state_dict(), rel=1e-6)
    step2 = [e["loss"] for e in again.state.log_history if e.get("step") == 2 and "loss" in e]
    assert step2 and step2[-1] == pytest.approx(_logs(straight)[1]["loss"], rel=1e-5)
    assert resumed.bco_shift.state_dict() == pytest.approx(straight.bco_shift.state_dict(), rel=1e-6)


# ------------------------------------------------------------------ 4. truncation defaults


def test_truncation_defaults_are_trl_116s_and_keep_the_prompt_shared(tmp_path):
    for config in (DPOConfig(output_dir=str(tmp_path)), KTOConfig(output_dir=str(tmp_path))):
        assert config.truncation_mode == "keep_start" and config.max_prompt_length is None
    # The first row's prompt alone fills max_length; the second keeps a completion, so that the split
    # has something to learn (a split with nothing is refused).
    long = Dataset.from_list([{"prompt": "Beautiful is better than ugly. " * 3,
                               "chosen": " Explicit is better than implicit. " * 3,
                               "rejected": " Simple is better. " * 2},
                              {"prompt": "Now", "chosen": " is better.", "rejected": " never."}])
    trainer = DPOTrainer(load_model(MODEL), args=_dpo_args(tmp_path, max_length=24), train_dataset=long)
    row = trainer.train_dataset[0]
    tok = trainer.processing_class
    prompt = tok(long[0]["prompt"])["input_ids"]
    for side in ("chosen", "rejected"):
        full = prompt + tok(long[0][side], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        # TRL's keep_start: each row is the first max_length tokens of prompt + completion.
        assert row["prompt_ids"] + row[f"{side}_ids"] == full[:24]


# ------------------------------------------------------------------ 5. cDPO, said in --help


def test_label_smoothing_help_says_sigmoid_is_cdpo():
    from dataclasses import fields

    text = next(f for f in fields(DPOConfig) if f.name == "label_smoothing").metadata["help"]
    assert "cDPO" in text and "sigmoid" in text and "TRL 1.16 ignores" in text


# ------------------------------------------------------------------ 6. the metrics TRL logs


def test_dpo_logs_entropy_token_accuracy_and_num_tokens_as_trl(tmp_path, pairs):
    trainer = DPOTrainer(load_model(MODEL), args=_dpo_args(tmp_path), train_dataset=pairs)
    model = load_model(MODEL)
    ent, ent_n, correct, chosen_n, inputs = 0.0, 0, 0, 0, 0
    for row in _rows(trainer, 4):
        for side in ("chosen_ids", "rejected_ids"):
            _, labels, logits = _sequence(model, row["prompt_ids"], row[side])
            mask = labels != IGNORE_INDEX
            logp = logits.log_softmax(-1)
            ent -= float((logp.exp() * logp).sum(-1)[mask].sum())
            ent_n += int(mask.sum())
            inputs += len(row["prompt_ids"]) + len(row[side])
            if side == "chosen_ids":
                correct += int((logits.argmax(-1) == labels)[mask].sum())
                chosen_n += int(mask.sum())
    trainer.train()
    first = _logs(trainer)[0]
    assert first["entropy"] == pytest.approx(ent / ent_n, rel=1e-5)
    assert first["mean_token_accuracy"] == pytest.approx(correct / chosen_n, rel=1e-6)
    assert first["num_tokens"] == inputs


def test_kto_logs_logits_entropy_and_num_tokens_as_trl(tmp_path):
    data = load_dataset_any("builtin:zen", "standard_unpaired_preference").select(range(8))
    args = KTOConfig(output_dir=str(tmp_path), max_steps=1, learning_rate=0.1, optim="sgd", per_device_train_batch_size=4,
                     logging_steps=1, save_strategy="no", train_sampling_strategy="sequential", max_length=64,
                     disable_tqdm=True, report_to="none")
    trainer = KTOTrainer(load_model(MODEL), args=args, train_dataset=data)
    model = load_model(MODEL)
    sums = {True: [0.0, 0], False: [0.0, 0]}
    ent, ent_n, inputs = 0.0, 0, 0
    for row in _rows(trainer, 4):
        _, labels, logits = _sequence(model, row["prompt_ids"], row["completion_ids"])
        mask = labels != IGNORE_INDEX
        sums[row["label"]][0] += float(logits.mean(-1)[mask].sum())
        sums[row["label"]][1] += int(mask.sum())
        logp = logits.log_softmax(-1)
        ent -= float((logp.exp() * logp).sum(-1)[mask].sum())
        ent_n += int(mask.sum())
        inputs += len(row["prompt_ids"]) + len(row["completion_ids"])
    assert sums[True][1] and sums[False][1]
    trainer.train()
    first = _logs(trainer)[0]
    assert first["logits/chosen"] == pytest.approx(sums[True][0] / sums[True][1], rel=1e-5)
    assert first["logits/rejected"] == pytest.approx(sums[False][0] / sums[False][1], rel=1e-5)
    assert first["entropy"] == pytest.approx(ent / ent_n, rel=1e-5)
    assert first["num_tokens"] == inputs
