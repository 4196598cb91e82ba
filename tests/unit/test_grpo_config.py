"""GRPOConfig: TRL 1.16's defaults, the derived generation batch, and every check (one line naming the flag)."""

from __future__ import annotations

import pytest

from fusedalign.configs.grpo import GRPOConfig


def make(**kw):
    return GRPOConfig(**{"output_dir": "/tmp/grpo-config-test", "report_to": "none", "per_device_train_batch_size": 8,
                         **kw})


def test_trl_defaults():
    a = make()
    want = dict(learning_rate=1e-6, beta=0.0, loss_type="dapo", num_generations=8, max_completion_length=512,
                temperature=1.0, top_p=1.0, top_k=0, min_p=None, repetition_penalty=1.0, epsilon=0.2,
                epsilon_high=None, delta=None, num_iterations=1, importance_sampling_level="token",
                scale_rewards="group", multi_objective_aggregation="sum_then_normalize", top_entropy_quantile=1.0,
                mask_truncated_completions=False, use_bias_correction_kl=True, entropy_coef=0.0,
                disable_dropout=False, max_prompt_length=None, sapo_temperature_pos=1.0, sapo_temperature_neg=1.05)
    assert {k: getattr(a, k) for k in want} == want
    assert GRPOConfig.__dataclass_fields__["output_dir"].default == "outputs/grpo"
    # On this CPU machine: no bf16, no checkpointing, a log line every step (see the module docstring).
    assert a.bf16 is False and a.gradient_checkpointing is False and a.logging_steps == 1
    assert a.steps_per_generation == a.gradient_accumulation_steps == 1 and a.generation_batch_size == 8
    assert a.needs_old_logps is False


def test_generation_batch_and_old_logps():
    a = make(per_device_train_batch_size=4, gradient_accumulation_steps=2)
    assert (a.steps_per_generation, a.generation_batch_size, a.needs_old_logps) == (2, 8, False)
    a = make(per_device_train_batch_size=4, steps_per_generation=4, gradient_accumulation_steps=2)
    assert (a.generation_batch_size, a.needs_old_logps) == (16, True)
    a = make(per_device_train_batch_size=4, generation_batch_size=16)
    assert a.steps_per_generation == 4 and a.needs_old_logps is True
    assert make(num_iterations=2).needs_old_logps is True
    assert make(num_iterations=2, gradient_accumulation_steps=2).needs_old_logps is True  # spg = 2: 4 micro-batches
    assert make(num_iterations=2, gradient_accumulation_steps=2, steps_per_generation=1).needs_old_logps is False  # both passes in one step
    assert make(scale_rewards=False).scale_rewards == "none" and make(scale_rewards=True).scale_rewards == "group"


@pytest.mark.parametrize("kw,match", [
    (dict(loss_type="ppo"), r"loss_type must be one of 'grpo'"),
    (dict(importance_sampling_level="seq"), r"importance_sampling_level must be one of 'token', 'sequence'"),
    (dict(scale_rewards="std"), r"scale_rewards must be one of 'group', 'batch', 'none'"),
    (dict(multi_objective_aggregation="mean"), r"multi_objective_aggregation must be one of"),
    (dict(num_generations=1), r"num_generations must be >= 2"),
    (dict(num_generations=3), r"num_generations \(3\) must divide generation_batch_size \(8"),
    (dict(generation_batch_size=12), r"generation_batch_size \(12\) must be a multiple of per_device_train_batch_size"),
    (dict(generation_batch_size=16, steps_per_generation=2), r"set generation_batch_size or steps_per_generation"),
    (dict(steps_per_generation=0), r"steps_per_generation must be >= 1"),
    (dict(max_completion_length=0), r"max_completion_length must be >= 1"),
    (dict(max_prompt_length=0), r"max_prompt_length must be >= 1 or None"),
    (dict(temperature=0.0), r"temperature must be > 0"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_k=-1), r"top_k must be >= 0"),
    (dict(min_p=1.5), r"min_p must be in \[0, 1\]"),
    (dict(repetition_penalty=0.0), r"repetition_penalty must be > 0"),
    (dict(beta=-0.1), r"beta must be >= 0"),
    (dict(epsilon=-0.1), r"epsilon must be >= 0"),
    (dict(epsilon_high=-0.1), r"epsilon_high must be >= 0 or None"),
    (dict(delta=0.9), r"delta must be > 1 or None"),
    (dict(num_iterations=0), r"num_iterations must be >= 1"),
    (dict(generation_max_rows=-1), r"generation_max_rows must be >= 0 \(0: the whole generation batch"),
    (dict(top_entropy_quantile=1.2), r"top_entropy_quantile must be in \[0, 1\]"),
    (dict(sapo_temperature_neg=0.0), r"sapo_temperature_pos/neg must be > 0"),
    (dict(reward_funcs=["zen_words", "vowels"], reward_weights=[1.0]), r"reward_weights has 1 values for 2 reward"),
    (dict(reward_model_name_or_path="rm", reward_funcs=["zen_words"], reward_weights=[1.0]), r"for 2 reward functions"),
    (dict(auto_find_batch_size=True), r"auto_find_batch_size is not supported by GRPO"),
    (dict(num_generations_eval=0), r"num_generations_eval must be >= 1"),
    (dict(do_eval=True, eval_strategy="steps", per_device_eval_batch_size=6), r"num_generations_eval \(8\) must divide"),
    (dict(keyed_sampling=True, replay_completions="c.jsonl"), r"--replay_completions .* cannot be combined"),
])
def test_every_check_names_its_flag(kw, match):
    with pytest.raises(ValueError, match=match):
        make(**kw)


def test_loss_options_follow_the_config():
    o = make(loss_type="dr_grpo", epsilon_high=0.28, delta=1.5, beta=0.04, max_completion_length=64).loss_options()
    assert (o.loss_type, o.eps_high, o.delta, o.beta, o.max_completion_length) == ("dr_grpo", 0.28, 1.5, 0.04, 64)


def test_compiled_generation_is_refused_where_the_weights_are_gathered_anew(tmp_path, monkeypatch):
    """generate's compiled decoding keeps the weights' storage: refused under FSDP2 (and ZeRO-3),
    with the way out; StaticDecode's compiled step takes them as inputs: allowed, and asked for."""
    from fusedalign.generation import StaticDecode
    from fusedalign.models import load_tokenizer

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    with pytest.raises(ValueError, match="compile_generation with transformers' generate under fsdp2.*"
                                         "--generation_backend static"):
        GRPOConfig(output_dir=str(tmp_path), compile_generation=True, generation_backend="generate")
    args = GRPOConfig(output_dir=str(tmp_path), compile_generation=True, generation_backend="static")
    assert args.resolved_generation_backend == "static"
    assert StaticDecode.from_args(args, load_tokenizer("builtin:tiny-qwen2")).compile_step is True
    monkeypatch.delenv("ACCELERATE_USE_FSDP")
    GRPOConfig(output_dir=str(tmp_path), compile_generation=True, generation_backend="generate")  # one device


def test_static_loop_options_reach_the_loop_and_are_refused_where_generate_samples():
    """--fused_sampling, --decode_kernel and --fuse_projections are options of the static loop: given to StaticDecode
    with --generation_backend static, refused in one line naming the flag where generate samples
    (asked for, or picked by auto on this CPU machine), a kernel not in the list refused too."""
    from fusedalign.generation import StaticDecode
    from fusedalign.models import load_tokenizer

    assert make().fused_sampling is False and make().decode_kernel == "auto" and make().fuse_projections is False
    tok = load_tokenizer("builtin:tiny-qwen2")
    assert StaticDecode.from_args(make(generation_backend="static"), tok).decode_kernel == "auto"
    args = make(generation_backend="static", fused_sampling=True, decode_kernel="triton", fuse_projections=True)
    decode = StaticDecode.from_args(args, load_tokenizer("builtin:tiny-qwen2"))
    assert decode.fused_sampling is True and decode.decode_kernel == "triton" and decode.fuse_projections is True
    with pytest.raises(ValueError, match=r"^--fuse_projections is an option of the static decoding loop; "):
        make(generation_backend="generate", fuse_projections=True)
    with pytest.raises(ValueError, match=r"^--fused_sampling is an option of the static decoding loop; "
                                         r"--generation_backend generate does not use it"):
        make(generation_backend="generate", fused_sampling=True)
    for kernel in ("triton", "sdpa"):  # named, not left to auto, where generate samples: refused
        with pytest.raises(ValueError, match=r"^--decode_kernel .*auto, which picks generate here"):
            make(decode_kernel=kernel)
    with pytest.raises(ValueError, match=r"^decode_kernel must be one of 'auto', 'sdpa', 'triton'; got 'flash'"):
        make(generation_backend="static", decode_kernel="flash")
