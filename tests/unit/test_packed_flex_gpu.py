"""CUDA: flex attention on packed rows. A padding-free DPO run on a model loaded with no attention
implementation asked for runs its packed rows on flex attention (fusedalign.attention.selection),
and trains as the padded run on sdpa does: the same per-step losses and weights (fp32, no TF32).
Short shared-prompt rows without gradients attend on flex as on sdpa, whatever compiled first."""

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
    args = DPOConfig(output_dir=str(tmp_path), bf16=False, max_steps=3, per_device_train_batch_size=8,
                     learning_rate=1e-2, optim="sgd", lr_scheduler_type="constant", warmup_steps=0, beta=0.1,
                     max_length=256, train_sampling_strategy="sequential", logging_steps=1, save_strategy="no",
                     report_to="none", disable_tqdm=True, seed=0, **layout)
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


def _row(prompt: int, completions: list[int], seed: int):
    """A GRPO-style shared-prompt row: one prompt, its completions after one copy of it (token ids < 512)."""
    from fusedalign.data.grpo_packing import pack_completions

    g = torch.Generator().manual_seed(seed)
    ids = lambda n: torch.randint(3, 512, (n,), generator=g).tolist()  # noqa: E731
    p = ids(prompt)
    rows, positions = pack_completions([p] * len(completions), [ids(c) for c in completions], [0] * len(completions),
                                       [True] * len(completions), share_prompt=True)
    return rows, positions


def test_short_rows_without_gradients_attend_as_sdpa_after_a_longer_row_compiled_first(tmp_path):
    """The failure behind FLEX_KERNEL_OPTIONS (fusedalign.head): on the Qwen2.5-0.5B shape in bf16,
    a fresh compile of flex attention given a 166-token shared-prompt row and then a 108-token one,
    without gradients (GRPO's old-policy and reference passes), gave the short row log-probs up to 0.84
    nats off float32 sdpa's on an H100 (torch 2.11; bf16 sdpa: 0.015). Each row's flex log-probs, with
    and without gradients, must err against float32 sdpa no more than 4x bf16 sdpa's error + 0.02."""
    from benchmarks.builders.model import QWEN05B
    from fusedalign.head import token_logprobs
    from fusedalign.models import load_model
    from fusedalign.trainers.grpo_packed_batch import rows_to
    from tests.bf16_parity import no_tf32, save_shaped_model

    no_tf32()
    path = save_shaped_model(str(tmp_path / "qwen05b_2l"), QWEN05B, layers=2)
    flex = load_model(path, attn_implementation="flex_attention").cuda().train()
    sdpa = load_model(path, attn_implementation="sdpa").cuda().train()
    rows = [_row(20, [30, 1, 17, 22, 9, 25, 12, 23], seed=0), _row(12, [7, 13, 1, 20, 11, 16, 9, 12], seed=1)]
    assert [int(r.input_ids.shape[1]) for r, _ in rows] == [166, 108]
    torch._dynamo.reset()  # the order of first compiles is what is tested
    for grad in (False, True):
        for packed, positions in rows:
            packed, positions = rows_to(packed, "cuda"), positions.cuda()

            def logps(model, dtype):
                with torch.set_grad_enabled(grad), torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
                    out = token_logprobs(model, packed.model_inputs(model), targets=packed.labels).logps
                return out.detach().float().reshape(-1)[positions.clamp(min=0)][positions >= 0]

            truth = logps(sdpa, torch.float32)
            baseline = float((logps(sdpa, torch.bfloat16) - truth).abs().max())
            error = float((logps(flex, torch.bfloat16) - truth).abs().max())
            length = int(packed.input_ids.shape[1])
            assert error <= 4 * baseline + 0.02, (length, grad, error, baseline)
