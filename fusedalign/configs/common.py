"""Configuration shared by every command: script, model and common trainer arguments.

Flag names follow TRL where the meaning is the same, so a TRL command line carries over.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import TrainingArguments
from transformers.utils import logging

from fusedalign.distributed import configure_cpu_arguments

logger = logging.get_logger(__name__)


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


TRUNCATION_MODES = ("keep_start", "keep_end")


def check_choice(flag: str, value: object, choices: tuple) -> None:
    """Raises ValueError naming `flag` and the accepted values when `value` is not one of them."""
    if value not in choices:
        raise ValueError(f"{flag} must be one of {', '.join(map(repr, choices))}; got {value!r}.")


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
    liger_kernels: bool = field(
        default=False,
        metadata={"help": "Also use Liger's RMSNorm/SwiGLU/RoPE kernels (CUDA, liger-kernel installed); "
                  "set by --use_liger_kernel. The head is always fusedalign's."},
    )
    compile_layers: bool = field(
        default=False,
        metadata={"help": "torch.compile each decoder layer's forward (policy and reference); the head stays "
                  "the fused op. Not under DeepSpeed ZeRO-3. --torch_compile is accepted as an alias."},
    )
    compile_recompute: str = field(
        default="elementwise",
        metadata={"help": "With compile_layers: 'elementwise' recomputes element-wise ops (norms, activations, "
                  "RoPE) in the backward instead of saving them, never a matmul or attention (less memory, "
                  "same FLOPs); 'default' is torch's own choice.", "choices": ["elementwise", "default"]},
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
            self.liger_kernels = True
            self.use_liger_kernel = False
        # Trainer's own torch_compile compiles the whole model, head included; here it
        # means compiling the decoder layers, with the fused head left as it is.
        # Its backend and mode, when given, are used for the layers.
        self._layer_compile_options = {"backend": self.torch_compile_backend or "inductor",
                                       "mode": self.torch_compile_mode}
        if self.torch_compile_mode is not None and self.compile_recompute != "default":
            raise ValueError(
                f"--torch_compile_mode {self.torch_compile_mode} needs --compile_recompute default (a compile mode "
                f"brings its own inductor options), not {self.compile_recompute!r}; or leave the mode unset."
            )
        if self.torch_compile or self.torch_compile_backend is not None or self.torch_compile_mode is not None:
            self.compile_layers = True
            self.torch_compile, self.torch_compile_backend, self.torch_compile_mode = False, None, None
        # No accelerator present: train on the CPU, also under DeepSpeed and FSDP2
        # (fusedalign.distributed knows how each backend is brought up there). This sets
        # fields of these arguments only; the process itself is set up by
        # `setup_distributed()` (before any config) and by the trainer.
        configure_cpu_arguments(self)
        super().__post_init__()
        if self.max_length is not None and self.max_length <= 0:
            raise ValueError(f"max_length must be positive, got {self.max_length}.")
        if self.compile_layers and self.gradient_checkpointing:
            logger.warning(
                "compile_layers with gradient_checkpointing: checkpointing already recomputes every activation, so "
                "the compiled layers' memory saving is gone, and on an H200 (DPO, 0.5B model, 8k-16k tokens) they "
                "ran at 0.55-0.74x the speed of TRL + Liger with checkpointing (docs/benchmarks.md). Consider "
                "--use_liger_kernel instead of --compile_layers there."
            )
