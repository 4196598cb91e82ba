"""GRPOTrainer on the tiny model: the loss against TRL's formula, split invariance for every loss
type, generation reuse, old-policy log-probs, the reference, masked batches, fused = unfused,
and, end to end, conversational prompts through the chat template and a dataset column to the reward."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset

from fusedalign.configs import GRPOConfig
from fusedalign.data import DataError, load_dataset_any
from fusedalign.losses import group_advantages, grpo_loss
from fusedalign.models import load_model, load_tokenizer
from fusedalign.rewards import RewardError
from fusedalign.trainers import grpo as grpo_module
from fusedalign.trainers.grpo import GRPOTrainer
from tests.grpo_replay import token_sum_reward, uneven_replay

MODEL = "builtin:tiny-qwen2"
ROWS, G = 16, 4


@pytest.fixture(scope="module")
def prompts() -> Dataset:
    return load_dataset_any("builtin:zen", "standard_prompt_only").select(range(ROWS))


@pytest.fixture(scope="module")
def replay():
    return uneven_replay(ROWS, G, load_tokenizer(MODEL).eos_token_id)


def _args(tmp_path, **overrides) -> GRPOConfig:
    values = dict(
        output_dir=str(tmp_path), max_steps=1, learning_rate=0.1, optim="sgd", lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, max_grad_norm=0.0, per_device_train_batch_size=8, num_generations=G,
        max_completion_length=12, logging_steps=1, save_strategy="no", seed=0, report_to="none", disable_tqdm=True,
        shuffle_dataset=False,
    )
    values.update(overrides)
    return GRPOConfig(**values)


def _train(tmp_path, prompts, replay, reward=token_sum_reward, **overrides):
    torch.manual_seed(0)
    trainer = GRPOTrainer(load_model(MODEL), reward_funcs=reward, args=_args(tmp_path, **overrides),
                          train_dataset=prompts, generator=replay)
    trainer.train()
    logs = [e for e in trainer.state.log_history if "loss" in e]
    return trainer, logs, {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def test_dapo_loss_at_ratio_one_is_trls_formula_by_hand(tmp_path, prompts, replay):
    """First step, on-policy: r = 1, L_t = -A for each completion token; dapo divides by all tokens."""
    trainer, logs, _ = _train(tmp_path, prompts, replay, loss_type="dapo")
    keys = [(row, g) for row in range(2) for g in range(G)]  # the first generation batch: 2 prompts x G
    completions = [replay.records[k][0] for k in keys]
    rewards = torch.tensor([[r] for r in token_sum_reward(completions)])
    adv = group_advantages(rewards, torch.ones(1), G).advantages
    lengths = torch.tensor([len(c) for c in completions], dtype=torch.float64)
    want = float(-(adv.double() * lengths).sum() / lengths.sum())
    assert len(set(lengths.tolist())) > 2  # uneven lengths
    assert logs[0]["loss"] == pytest.approx(want, rel=1e-5, abs=1e-7)
    assert logs[0]["clip_ratio/region_mean"] == 0.0
    assert logs[0]["reward"] == pytest.approx(float(rewards.mean()), rel=1e-6)
    assert logs[0]["completions/clipped_ratio"] == pytest.approx(
        sum(replay.records[k][1] for k in keys) / len(keys))


LOSS_TYPES = ["grpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_one_step_is_the_same_however_it_is_split(tmp_path, prompts, replay, loss_type):
    """(accumulation 4 x batch 2) = (1 x 8): one optimizer step's update, uneven completion lengths."""
    whole = _train(tmp_path / "w", prompts, replay, loss_type=loss_type, beta=0.04)
    split = _train(tmp_path / "s", prompts, replay, loss_type=loss_type, beta=0.04, per_device_train_batch_size=2,
                   gradient_accumulation_steps=4)
    assert split[0].args.steps_per_generation == 4 and split[0].generation_step == 1
    torch.testing.assert_close(torch.tensor(split[1][0]["loss"]), torch.tensor(whole[1][0]["loss"]), rtol=1e-5,
                               atol=1e-7)
    moved = 0
    for key, value in whole[2].items():
        torch.testing.assert_close(split[2][key], value, rtol=1e-5, atol=1e-7, msg=key)
        moved += int(not torch.equal(value, load_model(MODEL).state_dict()[key])) if key.endswith("q_proj.weight") else 0
    assert moved  # the step did move the weights


def test_bnpo_depends_on_the_split_as_trl_defines_it(tmp_path, prompts, replay):
    whole = _train(tmp_path / "w", prompts, replay, loss_type="bnpo")
    split = _train(tmp_path / "s", prompts, replay, loss_type="bnpo", per_device_train_batch_size=2,
                   gradient_accumulation_steps=4)
    assert split[1][0]["loss"] != pytest.approx(whole[1][0]["loss"], rel=1e-4)


def test_generation_reuse_first_ratio_is_one_and_each_completion_used_num_iterations_times(
        tmp_path, prompts, replay, monkeypatch):
    calls, seen, logps = [], [], []

    class Counting:
        def generate(self, model, prompt_ids, row_keys, *, step=0):
            calls.append(list(row_keys))
            return replay.generate(model, prompt_ids, row_keys, step=step)

    def recorded_grpo_loss(new, mask, advantages, options, **kwargs):
        logps.append((new.detach().clone(), kwargs["old_logps"].clone(), mask.clone()))
        return grpo_loss(new, mask, advantages, options, **kwargs)

    monkeypatch.setattr(grpo_module, "grpo_loss", recorded_grpo_loss)
    torch.manual_seed(0)
    args = _args(tmp_path, max_steps=4, num_iterations=2, per_device_train_batch_size=4, loss_type="grpo")
    assert args.needs_old_logps
    trainer = GRPOTrainer(load_model(MODEL), reward_funcs=token_sum_reward, args=args, train_dataset=prompts,
                          generator=Counting())
    by_completion = {tuple(ids): key for key, (ids, _, _) in replay.records.items()}
    loss_and_metrics = trainer.loss_and_metrics

    def recorded_loss_and_metrics(model, inputs, mode):
        # Each row's completion tokens name its (dataset row, generation) key: replayed completions are distinct.
        # A row's labels on its loss tokens are its completion's tokens, in order.
        seen.extend(by_completion[tuple(labels[m].tolist())] for labels, m in zip(inputs.labels, inputs.loss_mask))
        return loss_and_metrics(model, inputs, mode)

    trainer.loss_and_metrics = recorded_loss_and_metrics
    trainer.train()
    logs = [e for e in trainer.state.log_history if "loss" in e]
    assert len(calls) == 2 and trainer.generation_step == 2  # 4 micro-steps / (spg 1 x mu 2)
    assert calls[0] != calls[1]
    # Every completion generated is seen by the loss exactly num_iterations times, and nothing else is.
    generated = [key for call in calls for key in call]
    assert len(set(generated)) == len(generated) == 8
    assert sorted(seen) == sorted(generated * 2)
    # The first use of each window: the old policy's log-probs are the policy's, bit for bit (r == 1
    # exactly); the second use comes after an update (lr 0.1), so they differ.
    assert len(logps) == 4
    for step, (new, old, mask) in enumerate(logps):
        assert torch.equal(new[mask], old[mask]) == (step % 2 == 0), step
    monkeypatch.undo()
    on_policy = _train(tmp_path / "one", prompts, replay, per_device_train_batch_size=4, loss_type="grpo")[1]
    # So step 1's loss is the on-policy run's (no old log-probs: r = exp(logp - logp.detach())), exactly.
    assert logs[0]["loss"] == on_policy[0]["loss"]
    assert logs[0]["clip_ratio/region_mean"] == 0.0
    # Step 2 reuses them after an update: the ratio moved and the loss with it.
    assert logs[1]["loss"] != pytest.approx(logs[0]["loss"], rel=1e-4)


def test_kl_with_a_reference_and_with_the_adapter_disabled(tmp_path, prompts, replay):
    from peft import LoraConfig

    _, logs, _ = _train(tmp_path / "ref", prompts, replay, beta=0.1, max_steps=2, per_device_train_batch_size=4)
    assert logs[0]["kl"] == 0.0 and logs[1]["kl"] > 0  # the policy starts as the reference, then moves
    lora = LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8, lora_dropout=0.0,
                      target_modules=["q_proj", "v_proj", "lm_head"], init_lora_weights=False)
    torch.manual_seed(0)
    trainer = GRPOTrainer(load_model(MODEL), reward_funcs=token_sum_reward, args=_args(tmp_path / "lora", beta=0.1),
                          train_dataset=prompts, generator=replay, peft_config=lora)
    assert trainer.ref_model is None and trainer.reference.mode == "adapter_disabled"
    trainer.train()
    kl = [e["kl"] for e in trainer.state.log_history if "kl" in e]
    assert kl and kl[0] > 0  # the adapter (lm_head included) is not zero-initialised: policy != reference


def test_all_completions_masked_gives_a_connected_zero_loss(tmp_path, prompts):
    eos = load_tokenizer(MODEL).eos_token_id
    truncated = uneven_replay(ROWS, G, eos, truncate_every=1)  # every completion truncated
    trainer, logs, weights = _train(tmp_path, prompts, truncated, mask_truncated_completions=True)
    assert logs[0]["loss"] == 0.0 and logs[0]["completions/clipped_ratio"] == 1.0
    initial = load_model(MODEL).state_dict()
    assert all(torch.equal(weights[k], initial[k]) for k in initial)


def test_fused_equals_unfused(tmp_path, prompts, replay):
    fused = _train(tmp_path / "f", prompts, replay, beta=0.04, max_steps=2, per_device_train_batch_size=4,
                   top_entropy_quantile=0.5, entropy_coef=0.01)
    unfused = _train(tmp_path / "u", prompts, replay, beta=0.04, max_steps=2, per_device_train_batch_size=4,
                     top_entropy_quantile=0.5, entropy_coef=0.01, fused_head=False)
    for a, b in zip(fused[1], unfused[1]):
        for key in ("loss", "kl", "entropy", "reward"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), key
    for key, value in unfused[2].items():
        torch.testing.assert_close(fused[2][key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_reward_errors_name_the_function_and_row(tmp_path, prompts, replay):
    def broken(completions, **kwargs):
        raise KeyError("score")

    trainer = GRPOTrainer(load_model(MODEL), reward_funcs=broken, args=_args(tmp_path), train_dataset=prompts,
                          generator=replay)
    with pytest.raises(RewardError, match=r"'broken' raised KeyError.*dataset row 0 \(from 0\), generation 0"):
        trainer.train()
    with pytest.raises(DataError, match="completions"):  # refused when the data is prepared
        GRPOTrainer(load_model(MODEL), reward_funcs=token_sum_reward, args=_args(tmp_path),
                    train_dataset=prompts.add_column("completions", ["x"] * ROWS), generator=replay)


# The built-in reward's learning test is the CLI demo's (tests/unit/test_cli.py): the same run, once.


def test_evaluation_generates_for_every_prompt_and_reports_its_rewards(tmp_path, prompts):
    eos = load_tokenizer(MODEL).eos_token_id
    test = load_dataset_any("builtin:zen", "standard_prompt_only", split="test")
    replay = uneven_replay(len(test), G, eos)
    trainer = GRPOTrainer(load_model(MODEL), reward_funcs=token_sum_reward, args=_args(tmp_path, per_device_eval_batch_size=8),
                          train_dataset=prompts, eval_dataset=test, generator=replay)
    metrics = trainer.evaluate()
    completions = [replay.records[(row, g)][0] for row in range(len(test)) for g in range(G)]
    assert len(test) % 2 == 0  # every prompt in a whole evaluation batch of 2 prompts x G
    assert metrics["eval_reward"] == pytest.approx(sum(token_sum_reward(completions)) / len(completions), rel=1e-6)
    lengths = [len(c) for c in completions]
    assert metrics["eval_completions/mean_length"] == pytest.approx(sum(lengths) / len(lengths), rel=1e-6)
    assert metrics["eval_completions/max_length"] == max(lengths)


def test_conversational_prompts_get_the_chat_template_and_columns_reach_the_reward(tmp_path, replay):
    """End to end: the generator receives the chat template's prompt ids (generation prompt
    included), and an extra dataset column reaches the reward function by name, one value per
    completion, in the generation batch's order."""
    tokenizer = load_tokenizer(MODEL)
    data = load_dataset_any("builtin:zen", "conversational_prompt_only").select(range(ROWS))
    data = data.add_column("answer", [f"answer {i}" for i in range(ROWS)])
    generated, scored = [], []

    class Recording:
        def generate(self, model, prompt_ids, row_keys, *, step=0):
            generated.append((list(row_keys), [list(p) for p in prompt_ids]))
            return replay.generate(model, prompt_ids, row_keys, step=step)

    def answer_reward(prompts, completions, completion_ids, answer, **kwargs):
        scored.append({"prompts": prompts, "completions": completions, "completion_ids": completion_ids,
                       "answer": answer, **kwargs})
        return token_sum_reward(completion_ids)

    trainer = GRPOTrainer(load_model(MODEL), reward_funcs=answer_reward, args=_args(tmp_path), train_dataset=data,
                          generator=Recording())
    trainer.train()
    assert len(generated) == len(scored) == 1
    keys, prompt_ids = generated[0]
    rows = [row for row, _ in keys]
    assert rows == [0] * G + [1] * G
    for row, ids in zip(rows, prompt_ids):
        text = tokenizer.apply_chat_template(data[row]["prompt"], tokenize=False, add_generation_prompt=True)
        assert text.endswith("<|im_start|>assistant\n") and data[row]["prompt"][0]["content"] in text
        assert ids == tokenizer(text, add_special_tokens=False).input_ids
    call = scored[0]
    assert call["answer"] == [f"answer {row}" for row in rows]
    assert call["prompts"] == [data[row]["prompt"] for row in rows]
    want = [replay.records[tuple(k)][0] for k in keys]
    assert call["completion_ids"] == want
    assert call["completions"] == [[{"role": "assistant", "content": tokenizer.decode(c, skip_special_tokens=True)}]
                                   for c in want]
    assert not {"prompt", "prompt_ids", "row_index"} & set(call)
