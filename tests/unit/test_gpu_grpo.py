"""GRPO on a GPU (skipped without CUDA): fused = unfused within bf16 tolerance on the Qwen2.5-0.5B
shape, and compiled static-cache decoding that sees the weights after an optimizer step."""

from __future__ import annotations

import copy

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
    initial = _model()  # one random init (slow at this shape), copied for each policy and reference
    runs = {}
    for fused in (True, False):
        args = GRPOConfig(output_dir=str(tmp_path / str(fused)), max_steps=2, learning_rate=1e-5, bf16=True,
                          per_device_train_batch_size=16, num_generations=8, max_completion_length=64, beta=0.04,
                          logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, seed=0,
                          shuffle_dataset=False, fused_head=fused, loss_type="dapo")
        trainer = GRPOTrainer(copy.deepcopy(initial), reward_funcs=token_sum_reward, args=args,
                              train_dataset=_prompts(8), processing_class=tokenizer, generator=replay,
                              ref_model=copy.deepcopy(initial))
        trainer.train()
        runs[fused] = [e for e in trainer.state.log_history if "loss" in e]
    for a, b in zip(runs[True], runs[False]):
        assert a["reward"] == b["reward"]  # the same replayed completions
        for key in ("loss", "entropy"):
            assert a[key] == pytest.approx(b[key], rel=2e-2, abs=2e-3), (key, a[key], b[key])
        assert a["kl"] == pytest.approx(b["kl"], rel=0.1, abs=1e-3)


def _small_model(dtype: torch.dtype, seed: int = 0):
    """What compiled decoding proves does not need the 0.5B shape: 4 layers, its vocabulary."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(seed)
    config = Qwen2Config(**{**QWEN05B, "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
                            "intermediate_size": 512})
    return AutoModelForCausalLM.from_config(config, dtype=dtype).cuda().eval()


def _decoders(tokenizer):
    kw = dict(max_new_tokens=24, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
              do_sample=False)
    return HFGenerate(**kw, compile_decoding=True), HFGenerate(**kw)


def _perturb_in_place(model) -> None:
    with torch.no_grad():  # what an optimizer step does: new values in the same storage
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)


PROMPTS = ("Beautiful is better than", "Now is better")


def test_compiled_decoding_sees_weights_updated_in_place_fp32():
    """In float32 rounding cannot move a greedy argmax: compiled = eager before and after an in-place
    update, and the update changes the completions (so stale weights would be seen)."""
    tokenizer = load_tokenizer("builtin:tiny-qwen2")
    model = _small_model(torch.float32)
    prompts, keys = [tokenizer(p)["input_ids"] for p in PROMPTS], [(0, 0), (1, 0)]
    compiled, eager = _decoders(tokenizer)
    before = compiled.generate(model, prompts, keys).completion_ids
    assert before == eager.generate(model, prompts, keys).completion_ids
    _perturb_in_place(model)
    after = compiled.generate(model, prompts, keys).completion_ids
    assert after == eager.generate(model, prompts, keys).completion_ids
    assert after != before


def _argmax_gaps(model, prompt_ids, completion_ids) -> torch.Tensor:
    """max logit - the chosen token's logit at every completion position, teacher-forced, float32."""
    gaps = []
    for prompt, completion in zip(prompt_ids, completion_ids):
        ids = torch.tensor([list(prompt) + list(completion)], device="cuda")
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()  # [C, V]
        chosen = logits.gather(-1, torch.tensor(completion, device="cuda")[:, None])[:, 0]
        gaps.append(logits.max(-1).values - chosen)
    return torch.cat(gaps)


def test_compiled_decoding_after_an_in_place_update_follows_the_new_weights_in_bf16():
    """In bfloat16 compiled and eager decoding may part at a near tie; what must hold is that every
    token compiled decoding chose is (within bf16 rounding) the argmax of the NEW weights, and is
    not that of the old ones: the check is shown able to fail on stale weights."""
    tokenizer = load_tokenizer("builtin:tiny-qwen2")
    model, old = _small_model(torch.bfloat16), _small_model(torch.bfloat16)
    prompts, keys = [tokenizer(p)["input_ids"] for p in PROMPTS], [(0, 0), (1, 0)]
    compiled, _ = _decoders(tokenizer)
    compiled.generate(model, prompts, keys)  # compiled on the first weights
    _perturb_in_place(model)
    after = compiled.generate(model, prompts, keys).completion_ids
    new_gaps, stale_gaps = _argmax_gaps(model, prompts, after), _argmax_gaps(old, prompts, after)
    tolerance = 0.125  # a few bf16 ulps of logits of magnitude ~4
    assert new_gaps.max() <= tolerance, new_gaps
    assert stale_gaps.max() > 4 * tolerance, stale_gaps
