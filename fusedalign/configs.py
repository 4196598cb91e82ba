"""Configuration dataclasses: script, model and per-trainer arguments.

Flag names follow TRL where the meaning is the same, so a TRL command line carries over.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import TrainingArguments

from fusedalign.distributed import use_cpu


@dataclass
class ScriptArguments:
    """Which data to train on."""

    dataset_name: str | None = field(
        default=None,
        metadata={"help": "`builtin:zen`, a local file/directory (json, jsonl, parquet) or a hub dataset name."},
    )
    dataset_config: str | None = field(
        default=None, metadata={"help": "Dataset configuration, e.g. `standard_preference` for builtin:zen."}
    )
    dataset_train_split: str = field(default="train", metadata={"help": "Split to train on."})
    dataset_test_split: str = field(default="test", metadata={"help": "Split to evaluate on, when evaluating."})


@dataclass
class ModelArguments:
    """Which model to train, and how to adapt it."""

    model_name_or_path: str | None = field(
        default=None, metadata={"help": "`builtin:tiny-qwen2` (tiny-llama, tiny-gemma2), a local path or a hub id."}
    )
    dtype: str | None = field(
        default=None, metadata={"help": "Weights dtype: float32, bfloat16, float16 or auto.", "aliases": ["--torch_dtype"]}
    )
    attn_implementation: str | None = field(default=None, metadata={"help": "eager, sdpa, flash_attention_2, ..."})
    trust_remote_code: bool = field(default=False)
    use_peft: bool = field(default=False, metadata={"help": "Train a LoRA adapter instead of the full model."})
    lora_r: int = field(default=16)
    lora_alpha: int = field(default=32)
    lora_dropout: float = field(default=0.05)
    lora_target_modules: list[str] | None = field(
        default=None, metadata={"help": "Modules to adapt; default all linear layers except lm_head. Add lm_head to adapt the head."}
    )
    lora_modules_to_save: list[str] | None = field(default=None)


@dataclass
class FusedAlignConfig(TrainingArguments):
    """Arguments shared by every fusedalign trainer."""

    fused_head: bool = field(
        default=True,
        metadata={
            "help": "Compute log-probs inside the output head without materialising the logits. "
            "False runs the unfused computation (the same function, from full logits). "
            "--use_liger_kernel is accepted as an alias (it turns the fused head on).",
        },
    )
    max_length: int | None = field(default=1024, metadata={"help": "Maximum tokens of prompt + completion."})
    dataset_num_proc: int | None = field(default=None)
    logging_steps: float = field(default=1)
    remove_unused_columns: bool = field(default=False)
    disable_dropout: bool = field(
        default=True, metadata={"help": "Set dropout to 0 in the policy and reference (as TRL does for DPO)."}
    )

    def __post_init__(self):
        # TRL's switch for its fused losses means "fused head" here. Trainer would
        # otherwise patch the model with Liger's own loss forward.
        if self.use_liger_kernel:
            self.fused_head = True
            self.use_liger_kernel = False
        # No accelerator present: train on the CPU, also under DeepSpeed and FSDP2.
        if use_cpu() and not torch.cuda.is_available():
            self.use_cpu = True
        super().__post_init__()
        if self.max_length is not None and self.max_length <= 0:
            raise ValueError(f"max_length must be positive, got {self.max_length}.")


@dataclass
class DPOConfig(FusedAlignConfig):
    """Direct Preference Optimization (Rafailov et al., 2023) and its variants."""

    output_dir: str | None = field(default="outputs/dpo")
    learning_rate: float = field(default=1e-6)
    beta: float = field(default=0.1, metadata={"help": "Temperature of the implicit reward; > 0."})
    loss_type: list[str] = field(
        default_factory=lambda: ["sigmoid"],
        metadata={"help": "One or more of: " + "sigmoid, robust, hinge, ipo, exo_pair, nca_pair, bco_pair, "
                  "sppo_hard, aot, aot_pair, apo_zero, apo_down, discopop, sft."},
    )
    loss_weights: list[float] | None = field(default=None, metadata={"help": "Weight of each loss_type."})
    label_smoothing: float = field(default=0.0)
    discopop_tau: float = field(default=0.05)
    max_prompt_length: int | None = field(default=512)
    truncation_mode: str = field(default="keep_end", metadata={"help": "keep_end or keep_start (for completions)."})
    precompute_ref_log_probs: bool = field(default=False)
    reference_free: bool = field(default=False)
    ref_model_name_or_path: str | None = field(default=None, metadata={"help": "Default: the policy's own path."})

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.loss_type, str):
            self.loss_type = [self.loss_type]
        if self.beta <= 0:
            raise ValueError(f"beta must be > 0 (the scale of the implicit reward), got {self.beta}.")
        if self.truncation_mode not in ("keep_end", "keep_start"):
            raise ValueError(f"truncation_mode must be 'keep_end' or 'keep_start', got {self.truncation_mode!r}.")
        if self.loss_weights is not None and len(self.loss_weights) != len(self.loss_type):
            raise ValueError(
                f"loss_weights has {len(self.loss_weights)} values but loss_type has {len(self.loss_type)} "
                f"({self.loss_type}); give one weight per loss type."
            )
