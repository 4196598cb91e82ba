"""The training commands: each one's config and trainer, as "module:attribute" (imported on use)."""

TRAINING_COMMANDS: dict[str, tuple[str, str]] = {
    "dpo": ("fusedalign.configs.dpo:DPOConfig", "fusedalign.trainers.dpo:DPOTrainer"),
    "kto": ("fusedalign.configs.kto:KTOConfig", "fusedalign.trainers.kto:KTOTrainer"),
    "sft": ("fusedalign.configs.sft:SFTConfig", "fusedalign.trainers.sft:SFTTrainer"),
    "grpo": ("fusedalign.configs.grpo:GRPOConfig", "fusedalign.trainers.grpo:GRPOTrainer"),
    "rloo": ("fusedalign.configs.rloo:RLOOConfig", "fusedalign.trainers.rloo:RLOOTrainer"),
    "distillation": ("fusedalign.configs.distillation:DistillationConfig",
                     "fusedalign.trainers.distillation:DistillationTrainer"),
}
# The commands whose trainer samples completions (GRPO's rollout): vLLM flags name what generates
# instead, and `fusedalign verify` keys their draws so every split of the batch samples alike.
GENERATING_COMMANDS = ("grpo", "rloo", "distillation")


def load(spec: str):
    """The attribute a "module:attribute" spec names."""
    import importlib

    module, attribute = spec.split(":")
    return getattr(importlib.import_module(module), attribute)
