"""RLOO's generation state across restarts: with num_iterations 2 and the KL in the reward, a run
resumed from a checkpoint inside a generation window (its completions, advantages and old-policy
log-probs from the checkpoint) or at its end logs exactly the uninterrupted run's steps and ends
on its weights."""

from __future__ import annotations

import pytest
import torch

from fusedalign.configs import RLOOConfig
from fusedalign.data import load_dataset_any
from fusedalign.models import load_model
from fusedalign.trainers.rloo import RLOOTrainer
from tests.grpo_replay import token_sum_reward

MODEL = "builtin:tiny-qwen2"
COMPARED = ("loss", "reward", "reward_std", "completions/mean_length", "entropy", "clip_ratio/region_mean", "kl")


def _train(out, *, resume=None, **overrides):
    values = dict(output_dir=str(out), max_steps=4, learning_rate=0.05, optim="sgd", lr_scheduler_type="constant",
                  warmup_steps=0, max_grad_norm=0.0, per_device_train_batch_size=4, num_generations=4,
                  max_completion_length=8, num_iterations=2, beta=0.1, keyed_sampling=True, logging_steps=1,
                  save_strategy="steps", save_steps=1, seed=0, report_to="none", disable_tqdm=True)
    values.update(overrides)
    torch.manual_seed(0)
    prompts = load_dataset_any("builtin:zen", "standard_prompt_only", split="train").select(range(16))
    trainer = RLOOTrainer(load_model(MODEL), reward_funcs=token_sum_reward, args=RLOOConfig(**values),
                          train_dataset=prompts)
    trainer.train(resume_from_checkpoint=resume)
    logs = {e["step"]: e for e in trainer.state.log_history if "loss" in e}
    return trainer, logs, {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


@pytest.mark.parametrize("checkpoint", [1, 2, 3])
def test_resumed_from_a_checkpoint_equals_the_uninterrupted_run(tmp_path, checkpoint):
    """Windows of steps (1, 2) and (3, 4): checkpoint-1 and -3 lie inside one, -2 at a window's end."""
    straight, want, weights = _train(tmp_path / "straight")
    assert straight.generation_step == 2 and want[3]["kl"] != 0.0  # the KL in the reward is really exercised
    out = tmp_path / f"from{checkpoint}"
    _train(out, max_steps=checkpoint)
    if checkpoint % 2:
        state = torch.load(out / f"checkpoint-{checkpoint}" / "fusedalign_rank0.pt", weights_only=False)
        batch = state["grpo_rollout"]["window"]["batches"][0]
        assert batch["old_logps"] is not None and batch["ref_logps"] is None  # RLOO's loss has no KL term
    resumed, got, got_weights = _train(out, resume=str(out / f"checkpoint-{checkpoint}"))
    assert resumed.generation_step == 2
    for step in range(checkpoint + 1, 5):
        assert set(got[step]) - {"train_runtime"} == set(want[step]) - {"train_runtime"}, step
        for key in COMPARED:
            if key in want[step]:  # rewards, lengths and kl are logged on the steps that generate
                assert got[step][key] == want[step][key], (step, key)
    for name, value in weights.items():
        assert torch.equal(got_weights[name], value), name
