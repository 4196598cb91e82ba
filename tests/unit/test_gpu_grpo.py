"""GRPO on a GPU (skipped without CUDA): fused = unfused within bf16 tolerance on the Qwen2.5-0.5B
shape, and compiled static-cache decoding that sees the weights after an optimizer step."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset

from fusedalign.configs import GRPOConfig
from fusedalign.generation import HFGenerate
from fusedalign.models import load_tokenizer
from fusedalign.trainers.grpo import GRPOTrainer
from tests.grpo_replay import token_sum_reward, uneven_replay

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

QWEN05B = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
               intermediate_size=4864, vocab_size=151936, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
               tie_word_embeddings=True)


def _model(seed: int = 0):
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(Qwen2Config(**QWEN05B), dtype=torch.bfloat16)


def _prompts(rows: int) -> Dataset:
    return Dataset.from_list([{"prompt": f"Prompt number {i}: the zen of python says"} for i in range(rows)])


def test_fused_equals_unfused_in_bf16_on_the_05b_shape(tmp_path):
    tokenizer = load_tokenizer("builtin:tiny-qwen2")  # token ids < 512, valid for any vocabulary
    replay = uneven_replay(8, 8, tokenizer.eos_token_id, max_length=64)
    runs = {}
    for fused in (True, False):
        args = GRPOConfig(output_dir=str(tmp_path / str(fused)), max_steps=2, learning_rate=1e-5, bf16=True,
                          per_device_train_batch_size=16, num_generations=8, max_completion_length=64, beta=0.04,
                          logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, seed=0,
                          shuffle_dataset=False, fused_head=fused, loss_type="dapo")
        trainer = GRPOTrainer(_model(), reward_funcs=token_sum_reward, args=args, train_dataset=_prompts(8),
                              processing_class=tokenizer, generator=replay, ref_model=_model())
        trainer.train()
        runs[fused] = [e for e in trainer.state.log_history if "loss" in e]
    for a, b in zip(runs[True], runs[False]):
        assert a["reward"] == b["reward"]  # the same replayed completions
        for key in ("loss", "entropy"):
            assert a[key] == pytest.approx(b[key], rel=2e-2, abs=2e-3), (key, a[key], b[key])
        assert a["kl"] == pytest.approx(b["kl"], rel=0.1, abs=1e-3)


def test_compiled_static_decoding_sees_weights_updated_in_place():
    tokenizer = load_tokenizer("builtin:tiny-qwen2")
    model = _model().cuda().eval()
    prompts = [tokenizer("Beautiful is better than")["input_ids"], tokenizer("Now is better")["input_ids"]]
    keys = [(0, 0), (1, 0)]
    kw = dict(max_new_tokens=24, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
              do_sample=False)
    compiled = HFGenerate(**kw, compile_decoding=True)
    eager = HFGenerate(**kw)
    before = compiled.generate(model, prompts, keys).completion_ids
    assert before == eager.generate(model, prompts, keys).completion_ids
    with torch.no_grad():  # what an optimizer step does: new values in the same storage
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    after = compiled.generate(model, prompts, keys).completion_ids
    assert after == eager.generate(model, prompts, keys).completion_ids
    assert after != before
