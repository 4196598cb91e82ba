"""The embedded demo: what a training command fills in when no model is named.

The demo's settings are tuned for the tiny model on the embedded zen data. They fill
in only what the user did not give, a group at a time where values belong together:
a user's own dataset gets no test split evaluated (a single file has none) and keeps
the per-step logging of a short run; `--save_steps` alone means saving is wanted.
"""

from __future__ import annotations

from typing import Any

DEMO_MODEL = "builtin:tiny-qwen2"
DEMO_DATASET = "builtin:zen"
DEMO_CONFIGS = {"dpo": "standard_preference", "kto": "standard_unpaired_preference", "sft": "standard_language_modeling",
                "grpo": "standard_prompt_only", "rloo": "standard_prompt_only",
                "distillation": "standard_prompt_only"}

# Learning rate, schedule and length that train the tiny model visibly in a minute or two.
DEMO_TRAINING: dict[str, dict[str, Any]] = {
    "dpo": dict(learning_rate=5e-4, num_train_epochs=3, per_device_train_batch_size=8, lr_scheduler_type="constant",
                warmup_steps=0, beta=0.1),
    "kto": dict(learning_rate=1e-3, num_train_epochs=5, per_device_train_batch_size=8, lr_scheduler_type="constant",
                warmup_steps=0, beta=0.1),
    "sft": dict(learning_rate=1e-3, num_train_epochs=20, per_device_train_batch_size=8, lr_scheduler_type="constant",
                warmup_steps=0),
    # 8 prompts x 8 completions of 16 tokens a generation, each trained on twice (num_iterations=2:
    # the second update is off-policy, so the ratio leaves 1 and clipping shows), with a KL penalty
    # to the initial weights (beta=0.04, TRL's former default): 30 generations in 60 steps, in which
    # the zen_words reward rises about fivefold.
    "grpo": dict(learning_rate=3e-3, max_steps=60, per_device_train_batch_size=64, num_generations=8,
                 num_iterations=2, beta=0.04, max_completion_length=16, lr_scheduler_type="constant",
                 warmup_steps=0, reward_funcs=["zen_words"]),
    # GRPO's demo with RLOO's own loss and KL: the same 8 prompts x 8 completions, mu=2, a KL
    # penalty in the reward (beta=0.04) against the initial weights.
    "rloo": dict(learning_rate=3e-3, max_steps=60, per_device_train_batch_size=64, num_generations=8,
                 num_iterations=2, beta=0.04, max_completion_length=16, lr_scheduler_type="constant",
                 warmup_steps=0, reward_funcs=["zen_words"]),
    # The untrained student samples 16 tokens after each of 32 zen prompts a step and learns the teacher's
    # distribution over them; the teacher is tiny-llama's shape fine-tuned to recite the Zen of Python
    # (scripts/build_resources.py). Forward KL (beta 0): from a near-uniform student, TRL's default
    # reverse KL (beta 1) stays near 1 nat a token for 150 steps here, while the forward KL falls from
    # 1.9 to under 0.1 in 100 steps (about 20 s on 2 CPU cores) and the completions learn to end.
    "distillation": dict(teacher_model_name_or_path="builtin:tiny-zen-teacher", beta=0.0, learning_rate=3e-3,
                         max_steps=100, per_device_train_batch_size=32, max_completion_length=16,
                         lr_scheduler_type="constant", warmup_steps=0),
}
DEMO_LOGGING_STEPS = {"dpo": 5, "kto": 5, "sft": 6, "grpo": 1, "rloo": 1, "distillation": 1}
# Commands whose demo evaluates on the embedded test split (GRPO's and RLOO's demos only train).
DEMO_EVALUATES = {"dpo": True, "kto": True, "sft": True, "grpo": False, "rloo": False, "distillation": False}
# Flags that size a run: once one is given, the demo's logging interval may skip the whole run.
_RUN_SIZE = frozenset({"logging_steps", "max_steps", "num_train_epochs", "per_device_train_batch_size",
                       "gradient_accumulation_steps"})

# Every value the demo can fill in, for reference (and for `fusedalign.cli.DEMO_DEFAULTS` users).
DEMO_DEFAULTS: dict[str, dict[str, Any]] = {
    command: dict(model_name_or_path=DEMO_MODEL, dataset_name=DEMO_DATASET, dataset_config=DEMO_CONFIGS[command],
                  **DEMO_TRAINING[command], logging_steps=DEMO_LOGGING_STEPS[command], save_strategy="no",
                  eval_strategy="epoch" if DEMO_EVALUATES[command] else "no")
    for command in DEMO_CONFIGS
}


def demo_defaults(command: str, given: dict[str, Any]) -> dict[str, Any]:
    """The demo's values for what the user left out; {} when a model is named.

    Args:
        command: "dpo", "kto", "sft", "grpo", "rloo" or "distillation".
        given: the destinations the user set (flags or `--config` keys) and their values.
    """
    if "model_name_or_path" in given or command not in DEMO_CONFIGS:
        return {}
    out: dict[str, Any] = {"model_name_or_path": DEMO_MODEL}
    if "dataset_name" not in given:
        out["dataset_name"] = DEMO_DATASET
        if "dataset_config" not in given:
            out["dataset_config"] = DEMO_CONFIGS[command]
    builtin_data = str(given.get("dataset_name", DEMO_DATASET)).startswith("builtin:")
    out.update({k: v for k, v in DEMO_TRAINING[command].items() if k not in given})
    if not given.keys() & {"save_strategy", "save_steps"}:
        out["save_strategy"] = "no"
    # The embedded data has a test split; a user's file may have none.
    if builtin_data and not given.keys() & {"eval_strategy", "eval_steps"}:
        out["eval_strategy"] = "epoch" if DEMO_EVALUATES[command] else "no"
    # Logging every few steps suits the demo's length; a run the user sized logs every step.
    if builtin_data and not given.keys() & _RUN_SIZE:
        out["logging_steps"] = DEMO_LOGGING_STEPS[command]
    return out


def banner(command: str, filled: dict[str, Any], values: dict[str, Any]) -> str:
    """One line saying what really runs: the model and data in use, and which demo values apply."""
    data = values.get("dataset_name")
    if values.get("dataset_config"):
        data = f"{data}/{values['dataset_config']}"
    settings = ", ".join(f"{k}={getattr(values.get(k, v), 'value', values.get(k, v))}" for k, v in filled.items()
                         if k not in ("model_name_or_path", "dataset_name", "dataset_config"))
    return (f"[fusedalign] no --model_name_or_path: training {values.get('model_name_or_path')} on {data}"
            + (f" with the demo's {settings}" if settings else "")
            + "; any flag you give overrides these.")
