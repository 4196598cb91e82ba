"""RLOOTrainer on the tiny model with replayed completions: the first update is TRL's REINFORCE
gradient with leave-one-out advantages computed by hand, the KL taken off the reward is the
summed log-ratio of policy and reference at generation, the loss after an off-policy step is
TRL's clipped formula, fused = unfused, one step is the same however it is split, a run resumed
inside a generation window equals the uninterrupted one, and GRPO's loss flags are refused."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset

from fusedalign.configs import RLOOConfig
from fusedalign.data import load_dataset_any
from fusedalign.models import load_model, load_tokenizer
from fusedalign.trainers.rloo import RLOOTrainer
from tests.grpo_replay import token_sum_reward, uneven_replay

MODEL = "builtin:tiny-qwen2"
ROWS, G = 16, 4


@pytest.fixture(scope="module")
def prompts() -> Dataset:
    return load_dataset_any("builtin:zen", "standard_prompt_only").select(range(ROWS))


@pytest.fixture(scope="module")
def replay():
    return uneven_replay(ROWS, G, load_tokenizer(MODEL).eos_token_id)


def _args(tmp_path, **overrides) -> RLOOConfig:
    values = dict(
        output_dir=str(tmp_path), max_steps=1, learning_rate=0.1, optim="sgd", lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, max_grad_norm=0.0, per_device_train_batch_size=8, num_generations=G,
        max_completion_length=12, logging_steps=1, save_strategy="no", seed=0, report_to="none", disable_tqdm=True,
        shuffle_dataset=False,
    )
    values.update(overrides)
    return RLOOConfig(**values)


def _train(tmp_path, prompts, replay, **overrides):
    torch.manual_seed(0)
    trainer = RLOOTrainer(load_model(MODEL), reward_funcs=token_sum_reward, args=_args(tmp_path, **overrides),
                          train_dataset=prompts, generator=replay)
    trainer.train()
    logs = [e for e in trainer.state.log_history if "loss" in e]
    return trainer, logs, {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def _sequence_logps(model, dataset, keys, replay) -> torch.Tensor:
    """[n] sum of the completion's log-probs, unfused (full logits), one completion at a time."""
    out = []
    for row, g in keys:
        prompt = list(dataset[row]["prompt_ids"])
        completion = replay.records[(row, g)][0]
        logits = model(input_ids=torch.tensor([prompt + completion])).logits[0, len(prompt) - 1:-1]
        logps = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(completion)[:, None])
        out.append(logps.sum())
    return torch.stack(out)


def _leave_one_out(rewards: list[float]) -> torch.Tensor:
    r = torch.tensor(rewards, dtype=torch.float64).view(-1, G)
    return (r - (r.sum(1, keepdim=True) - r) / (G - 1)).view(-1)


def test_first_update_is_the_reinforce_gradient_with_leave_one_out_advantages(tmp_path, prompts, replay):
    """On-policy (r = 1): loss = mean_i -A_i (0: leave-one-out advantages sum to 0 in a group), the
    gradient is -mean_i A_i grad(sum_t logp_it), and the KL to the initial reference is 0."""
    trainer, logs, weights = _train(tmp_path, prompts, replay)
    keys = [(row, g) for row in range(2) for g in range(G)]  # the first generation batch: 2 prompts x G
    adv = _leave_one_out(token_sum_reward([replay.records[k][0] for k in keys])).float()
    torch.manual_seed(0)
    model = load_model(MODEL)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    (-(adv * _sequence_logps(model, trainer.train_dataset, keys, replay)).mean()).backward()
    assert logs[0]["loss"] == pytest.approx(0.0, abs=1e-6) and logs[0]["kl"] == 0.0
    moved = 0
    for name, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(weights[name], initial[name] - 0.1 * p.grad, rtol=1e-4, atol=1e-6, msg=name)
            moved += int(not torch.equal(weights[name], initial[name]))
    assert moved > 0


def test_the_kl_is_taken_off_the_reward_per_sequence(tmp_path, prompts, replay):
    """Second generation (the policy has moved): the strategy receives, per completion, the sum over
    its tokens of policy minus reference log-probs (by hand, unfused), the advantages are the
    leave-one-out ones of reward - beta x that sum, and the logged kl is those sums' total over the
    generation batch's completion tokens."""
    seen = []
    torch.manual_seed(0)
    trainer = RLOOTrainer(load_model(MODEL), reward_funcs=token_sum_reward,
                          args=_args(tmp_path, max_steps=2, beta=0.5), train_dataset=prompts, generator=replay)
    strategy = trainer.rollout.advantages

    def capture(rewards, weights, g, sequence_kl):
        seen.append(({k: v.detach().clone() for k, v in trainer.model.state_dict().items()}, sequence_kl.clone(),
                     strategy(rewards, weights, g, sequence_kl)))
        return seen[-1][2]

    trainer.rollout.advantages = type("Capture", (), {"kl_in_reward": True, "__call__": staticmethod(capture)})()
    trainer.train()
    state, kl, adv = seen[1]
    keys = [(row, g) for row in range(2, 4) for g in range(G)]
    policy = load_model(MODEL)
    reference = load_model(MODEL)
    policy.load_state_dict(state)
    with torch.no_grad():
        want = (_sequence_logps(policy, trainer.train_dataset, keys, replay)
                - _sequence_logps(reference, trainer.train_dataset, keys, replay))
    assert want.abs().min() > 1e-4  # the policy has moved away from the reference
    torch.testing.assert_close(kl, want, rtol=1e-4, atol=1e-6)
    rewards = torch.tensor(token_sum_reward([replay.records[k][0] for k in keys]), dtype=torch.float64)
    torch.testing.assert_close(adv.advantages.double(), _leave_one_out((rewards - 0.5 * kl.double()).tolist()),
                               rtol=1e-5, atol=1e-6)
    # The logged kl is TRL 1.16's: the token mean of old - ref log-probs over the generation batch's
    # completion tokens (EOS included; none masked here), not the mean of the sequence sums.
    tokens = sum(len(replay.records[k][0]) for k in keys)
    logged = [e for e in trainer.state.log_history if "kl" in e]
    assert len(logged) == 2 and tokens != len(keys)
    assert logged[1]["kl"] == pytest.approx(float(want.sum()) / tokens, rel=1e-4, abs=1e-7)


def test_the_second_update_of_a_generation_is_off_policy_and_clips(tmp_path, prompts, replay):
    """num_iterations 2: the second update's whole-sequence ratio leaves 1 and some sequences clip
    (the formula itself: tests/unit/test_losses_rloo.py)."""
    trainer, logs, _ = _train(tmp_path, prompts, replay, max_steps=2, num_iterations=2, beta=0.0,
                              learning_rate=0.5)
    assert trainer.args.needs_old_logps
    assert logs[0]["clip_ratio/region_mean"] == 0.0 and logs[1]["clip_ratio/region_mean"] > 0
    assert logs[1]["loss"] != pytest.approx(logs[0]["loss"], abs=1e-4)


def test_fused_equals_unfused(tmp_path, prompts, replay):
    common = dict(beta=0.05, max_steps=2, learning_rate=0.5, per_device_train_batch_size=4, gradient_accumulation_steps=1,
                  steps_per_generation=2, num_iterations=2, epsilon_high=0.28, mask_truncated_completions=True)
    fused = _train(tmp_path / "f", prompts, replay, **common)
    unfused = _train(tmp_path / "u", prompts, replay, fused_head=False, **common)
    assert "kl" in unfused[1][0] and max(e["clip_ratio/region_mean"] for e in fused[1]) > 0  # both really ran
    for a, b in zip(fused[1], unfused[1]):
        assert set(a) == set(b)  # kl and reward are logged on the steps that generate
        for key in ("loss", "kl", "entropy", "reward", "clip_ratio/region_mean"):
            if key in b:
                assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), key
    for key, value in unfused[2].items():
        torch.testing.assert_close(fused[2][key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_one_step_is_the_same_however_it_is_split(tmp_path, prompts, replay):
    whole = _train(tmp_path / "w", prompts, replay, per_device_train_batch_size=8, beta=0.1)
    split = _train(tmp_path / "s", prompts, replay, per_device_train_batch_size=2, gradient_accumulation_steps=4,
                   beta=0.1)
    assert split[0].args.steps_per_generation == 4 and split[0].generation_step == 1
    torch.testing.assert_close(torch.tensor(split[1][0]["loss"]), torch.tensor(whole[1][0]["loss"]), rtol=1e-5,
                               atol=1e-6)
    for key, value in whole[2].items():
        torch.testing.assert_close(split[2][key], value, rtol=1e-5, atol=1e-7, msg=key)


def test_grpo_loss_flags_are_refused_naming_the_flag(tmp_path):
    for flag, value in (("loss_type", "grpo"), ("scale_rewards", "batch"), ("entropy_coef", 0.1)):
        with pytest.raises(ValueError, match=f"--{flag} is an option of GRPO's loss"):
            _args(tmp_path, **{flag: value})
    with pytest.raises(ValueError, match="reward_clip_range must be two numbers"):
        _args(tmp_path, reward_clip_range=[1.0, 0.0])
    args = RLOOConfig(output_dir=str(tmp_path))
    assert (args.beta, args.num_generations, args.learning_rate, args.epsilon, args.normalize_advantages,
            args.reward_clip_range, args.num_iterations) == (0.05, 2, 1e-6, 0.2, False, None, 1)
