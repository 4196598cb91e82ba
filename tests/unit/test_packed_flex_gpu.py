"""CUDA: a padding-free DPO run on a model loaded with no attention implementation asked for
runs its packed rows on flex attention (fusedalign.attention.selection), and trains as the
padded run on sdpa does: the same per-step losses and weights (fp32, no TF32)."""

from __future__ import annotations

import pytest
import torch

from fusedalign.configs import DPOConfig
from fusedalign.data import load_dataset_any
from fusedalign.trainers.dpo import DPOTrainer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


class CountedAttention:
    """Counts the calls of one registered attention function of transformers while active."""

    def __init__(self, name: str):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        self.name, self.registry, self.calls = name, ALL_ATTENTION_FUNCTIONS, 0

    def __enter__(self):
        self.original = self.registry[self.name]

        def counted(*args, **kwargs):
            self.calls += 1
            return self.original(*args, **kwargs)

        self.registry.register(self.name, counted)
        return self

    def __exit__(self, *exc):
        self.registry.register(self.name, self.original)


def _train(tmp_path, **layout):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    args = DPOConfig(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=8, learning_rate=1e-2,
                     optim="sgd", lr_scheduler_type="constant", warmup_steps=0, beta=0.1, max_length=256,
                     train_sampling_strategy="sequential", logging_steps=1, save_strategy="no", report_to="none",
                     disable_tqdm=True, seed=0, **layout)
    train = load_dataset_any("builtin:zen", "standard_preference", split="train")
    trainer = DPOTrainer(model="builtin:tiny-qwen2", args=args, train_dataset=train)
    with CountedAttention("flex_attention") as flex:
        trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    weights = torch.cat([p.detach().float().flatten() for p in trainer.model.parameters()])
    return trainer.model.config._attn_implementation, flex.calls, losses, weights


def test_padding_free_runs_on_flex_by_default_and_equals_padded(tmp_path):
    padded_attn, padded_flex, padded_losses, padded_weights = _train(tmp_path / "padded")
    attn, flex_calls, losses, weights = _train(tmp_path / "padding_free", padding_free=True)
    assert padded_attn == "sdpa" and padded_flex == 0  # padded rows keep the default
    assert attn == "flex_attention" and flex_calls > 0
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(padded_losses), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(weights, padded_weights, rtol=1e-4, atol=1e-5)
