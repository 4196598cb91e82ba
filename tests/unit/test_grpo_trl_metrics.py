"""Metrics TRL 1.16's GRPO and RLOO log, with TRL's meaning: `num_tokens` counts a generation's tokens
once however many times `num_iterations` trains on them, the terminated-length statistics are 0 in a
window where no completion ended, `step_time` every optimizer step, `policy_loss` and `entropy_coef`
with an entropy bonus; and KTO's `kl` is 0 for a loss type without z0."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset

from fusedalign.configs import GRPOConfig, RLOOConfig
from fusedalign.data import load_dataset_any
from fusedalign.models import load_model, load_tokenizer
from fusedalign.trainers.grpo import GRPOTrainer
from fusedalign.trainers.rloo import RLOOTrainer
from tests.grpo_replay import token_sum_reward, uneven_replay

MODEL = "builtin:tiny-qwen2"
ROWS, G = 8, 4


@pytest.fixture(scope="module")
def prompts() -> Dataset:
    return load_dataset_any("builtin:zen", "standard_prompt_only").select(range(ROWS))


def _train(tmp_path, prompts, replay, trainer_cls=GRPOTrainer, config_cls=GRPOConfig, **overrides):
    values = dict(output_dir=str(tmp_path), max_steps=4, learning_rate=0.1, optim="sgd", lr_scheduler_type="constant",
                  warmup_steps=0, per_device_train_batch_size=8, num_generations=G, max_completion_length=12,
                  logging_steps=1, save_strategy="no", seed=0, report_to="none", disable_tqdm=True,
                  shuffle_dataset=False)
    values.update(overrides)
    torch.manual_seed(0)
    trainer = trainer_cls(load_model(MODEL), reward_funcs=token_sum_reward, args=config_cls(**values),
                          train_dataset=prompts, generator=replay)
    trainer.train()
    return trainer, [e for e in trainer.state.log_history if "loss" in e]


def _window_tokens(prompts, replay, rows) -> int:
    """Prompt + completion tokens of the completions of dataset `rows`, each prompt counted per completion."""
    tokenizer = load_tokenizer(MODEL)
    total = 0
    for row in rows:
        prompt = len(tokenizer(prompts[row]["prompt"])["input_ids"])
        total += sum(prompt + len(replay.records[(row, g)][0]) for g in range(G))
    return total


@pytest.mark.parametrize("trainer_cls,config_cls", [(GRPOTrainer, GRPOConfig), (RLOOTrainer, RLOOConfig)])
def test_num_tokens_counts_a_generation_once_over_its_iterations(tmp_path, prompts, trainer_cls, config_cls):
    """num_iterations 2: steps 1-2 train on generation 1 (rows 0-1), steps 3-4 on generation 2 (rows 2-3)."""
    replay = uneven_replay(ROWS, G, load_tokenizer(MODEL).eos_token_id)
    _, logs = _train(tmp_path, prompts, replay, trainer_cls, config_cls, num_iterations=2)
    seen = [e["num_tokens"] for e in logs]
    assert seen[0] == seen[1] == _window_tokens(prompts, replay, [0, 1])
    assert seen[2] == seen[3] == seen[0] + _window_tokens(prompts, replay, [2, 3])


def test_terminated_lengths_are_zero_when_no_completion_ended(tmp_path, prompts):
    """Generation 1 (rows 0-1) all truncated; generation 2 with ended completions: their own statistics."""
    eos = load_tokenizer(MODEL).eos_token_id
    replay = uneven_replay(ROWS, G, eos, truncate_every=0, truncate_rows=[0, 1])
    _, logs = _train(tmp_path, prompts, replay, max_steps=2)
    for name in ("mean", "min", "max"):
        assert logs[0][f"completions/{name}_terminated_length"] == 0.0
    ended = [len(replay.records[(row, g)][0]) for row in (2, 3) for g in range(G)]
    assert logs[1]["completions/mean_terminated_length"] == pytest.approx(sum(ended) / len(ended))
    assert logs[1]["completions/min_terminated_length"] == min(ended) > 0
    assert logs[1]["completions/max_terminated_length"] == max(ended)


def test_step_time_every_step_and_policy_loss_with_an_entropy_bonus(tmp_path, prompts):
    """policy_loss is the loss without the bonus: loss + coef x the entropy the bonus sums per loss token
    (every completion token here: no entropy mask), which is the logged `entropy`."""
    replay = uneven_replay(ROWS, G, load_tokenizer(MODEL).eos_token_id)
    _, logs = _train(tmp_path, prompts, replay, entropy_coef=0.05, max_steps=2)
    for entry in logs:
        assert entry["step_time"] > 0 and entry["entropy_coef"] == 0.05
        assert entry["policy_loss"] == pytest.approx(entry["loss"] + 0.05 * entry["entropy"], rel=1e-5)
        assert "bonus_entropy" not in entry
    _, plain = _train(tmp_path / "plain", prompts, replay, max_steps=2)
    assert all("policy_loss" not in e and "entropy_coef" not in e and e["step_time"] > 0 for e in plain)
    # The bonus changed the loss by exactly what policy_loss adds back.
    assert plain[0]["loss"] == pytest.approx(logs[0]["policy_loss"], rel=1e-5)


def test_a_negative_entropy_coef_is_trls_entropy_penalty_and_epsilon_1_turns_the_lower_clip_off(tmp_path, prompts):
    replay = uneven_replay(ROWS, G, load_tokenizer(MODEL).eos_token_id)
    _, penalised = _train(tmp_path / "n", prompts, replay, entropy_coef=-0.05, max_steps=1)
    _, plain = _train(tmp_path / "p", prompts, replay, max_steps=1)
    entry = penalised[0]
    assert entry["policy_loss"] == pytest.approx(entry["loss"] - 0.05 * entry["entropy"], rel=1e-5)
    assert entry["policy_loss"] == pytest.approx(plain[0]["loss"], rel=1e-5) and entry["loss"] > plain[0]["loss"]
    assert GRPOConfig(output_dir=str(tmp_path), epsilon=1.5).epsilon == 1.5


def test_kto_logs_kl_zero_for_a_loss_type_without_z0():
    from fusedalign.losses.kto import KTOOptions, kto_batch_loss

    logps = torch.tensor([-3.0, -4.0, -5.0])
    desirable = torch.tensor([True, False, True])
    valid = torch.ones(3, dtype=torch.bool)
    _, metrics = kto_batch_loss(logps, logps - 0.5, torch.tensor(0.0), desirable, valid,
                                KTOOptions(loss_type="apo_zero_unpaired"))
    assert metrics.logged()["kl"] == 0.0
    _, metrics = kto_batch_loss(logps, logps - 0.5, torch.tensor(0.7), desirable, valid, KTOOptions(loss_type="kto"))
    assert metrics.logged()["kl"] == pytest.approx(0.7)  # z0 itself where the loss has one
