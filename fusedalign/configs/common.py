"""Configuration shared by every command: script, model and common trainer arguments.

Flag names follow TRL where the meaning is the same, so a TRL command line carries over.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch
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
    model_revision: str = field(default="main", metadata={"help": "The model's branch, tag or commit on the hub."})
    dtype: str = field(
        default="float32",
        metadata={"help": "The dtype the weights are loaded in (TRL's default, float32: with --bf16, mixed precision "
                  "over float32 weights); auto keeps the checkpoint's.",
                  "choices": ["auto", "bfloat16", "float16", "float32"], "aliases": ["--torch_dtype"]},
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
    lora_task_type: str = field(default="CAUSAL_LM", metadata={"help": "PEFT task type; only CAUSAL_LM trains here.",
                                                              "choices": ["CAUSAL_LM"]})
    use_rslora: bool = field(default=False, metadata={"help": "Rank-stabilised LoRA: scale adapters by "
                                                              "lora_alpha / sqrt(r)."})
    use_dora: bool = field(default=False, metadata={"help": "Weight-decomposed LoRA (DoRA); not on lm_head with the "
                                                            "fused head."})


TRUNCATION_MODES = ("keep_start", "keep_end")


def default_bf16(args: TrainingArguments) -> bool:
    """TRL's bf16=True where it can run: a CUDA device that supports it (bf16 autocast on a CPU is slow,
    and no CPU demo wants it), unless fp16 or the CPU is asked for."""
    return bool(not args.fp16 and not args.use_cpu and torch.cuda.is_available() and torch.cuda.is_bf16_supported())


def _init_kwargs(value: dict | str | None) -> dict | None:
    """`model_init_kwargs` as a dict (JSON from a command line or a YAML string)."""
    if value is None or isinstance(value, dict):
        return value
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as err:
        raise ValueError(f"model_init_kwargs must be a JSON object, e.g. '{{\"dtype\": \"bfloat16\"}}'; got {value!r} "
                         f"({err.msg})") from None
    if not isinstance(parsed, dict):
        raise ValueError(f"model_init_kwargs must be a JSON object, e.g. '{{\"dtype\": \"bfloat16\"}}'; got {value!r}")
    return parsed


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
    bf16: bool | None = field(default=None, metadata={"help": "bfloat16 mixed precision; default: on where a CUDA "
                                                              "device supports it (TRL: always on)."})
    remove_unused_columns: bool = field(
        default=True, metadata={"help": "Accepted as in TRL; either value trains the same: each trainer reads "
                                        "the columns of its data format itself."})
    model_init_kwargs: dict | str | None = field(
        default=None, metadata={"help": "from_pretrained's keyword arguments for a model given to the trainer by "
                                        "name (a dict, or its JSON); dtype defaults to float32, as in TRL. The CLI "
                                        "adds them to what --dtype and the other model flags ask for."})
    disable_dropout: bool = field(
        default=True, metadata={"help": "Set dropout to 0 in the policy and reference (as TRL does for DPO)."}
    )

    def __post_init__(self):
        if self.bf16 is None:
            self.bf16 = default_bf16(self)
        self.model_init_kwargs = _init_kwargs(self.model_init_kwargs)
        if self.label_smoothing_factor:
            raise ValueError(
                f"label_smoothing_factor {self.label_smoothing_factor:g}: the fused head computes the label's "
                "log-probability, not the vocabulary mean that smoothing needs, so it would be ignored; leave it at 0"
                + (" (DPO's own --label_smoothing is supported)." if "DPO" in type(self).__name__ else "."))
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
