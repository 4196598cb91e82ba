"""Configuration shared by every command: script, model and common trainer arguments.

Flag names follow TRL where the meaning is the same, so a TRL command line carries over.
"""

from __future__ import annotations

import importlib.util
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
        default=None, metadata={"help": "Dataset configuration; for builtin:zen the format: standard_language_modeling "
                                        "(sft), standard_preference (dpo), standard_unpaired_preference (kto), "
                                        "standard_prompt_only (grpo, rloo, distillation), or conversational_*."}
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

    def __post_init__(self):
        check_attention_available(self.attn_implementation, "--attn_implementation")


TRUNCATION_MODES = ("keep_start", "keep_end")


def default_bf16(args: TrainingArguments) -> bool:
    """TRL's bf16=True where it can run: a CUDA device that supports it (bf16 autocast on a CPU is slow,
    and no CPU demo wants it), unless fp16 or the CPU is asked for."""
    return bool(not args.fp16 and not args.use_cpu and torch.cuda.is_available() and torch.cuda.is_bf16_supported())


def _init_kwargs(value: dict | str | None, name: str = "model_init_kwargs",
                 example: str = '{"dtype": "bfloat16"}', expected: str | None = None) -> dict | None:
    """A dict field (`model_init_kwargs`, `generation_kwargs`, ...) as a dict: JSON from a command line or a
    YAML string, or the dict a YAML mapping or the Python API gives. `expected` words what the field takes
    in the error (default: a JSON object, with `example`)."""
    if value is None or isinstance(value, dict):
        return value
    expected = expected or f"a JSON object, e.g. '{example}'"
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as err:
        raise ValueError(f"{name} must be {expected}; got {value!r} ({err.msg})") from None
    if not isinstance(parsed, dict):
        raise ValueError(f"{name} must be {expected}; got {value!r}")
    return parsed


# TrainingArguments' dict flags that take nothing but a JSON object on a command line, with an example each;
# and those that also take a file's path (a string not starting with "{").
JSON_ONLY_FLAGS = {"gradient_checkpointing_kwargs": '{"use_reentrant": false}',
                   "activation_checkpointing_kwargs": '{"use_reentrant": false}',
                   "lr_scheduler_kwargs": '{"min_lr": 1e-6}'}
JSON_OR_PATH_FLAGS = ("deepspeed", "fsdp_config", "accelerator_config")


def check_json_flags(args: TrainingArguments) -> None:
    """Refuses a TrainingArguments dict flag given as a string that is not a JSON object, naming the
    flag: transformers parses only strings that start with "{" (its JSON error names no flag) and
    passes any other on, where it was ignored or failed far from the flag. The strings themselves
    are left for transformers to parse, with its conversions of the values."""
    for name, example in JSON_ONLY_FLAGS.items():
        value = getattr(args, name, None)
        if isinstance(value, str):
            _init_kwargs(value, name, example)
    for name in JSON_OR_PATH_FLAGS:
        value = getattr(args, name, None)
        if isinstance(value, str) and value.startswith("{"):
            _init_kwargs(value, name, expected="a JSON object or a file's path")


def check_init_dtype(init_kwargs: dict | None, name: str) -> None:
    """Refuses a `dtype` in a from_pretrained kwargs dict that names no torch dtype (torch would raise an
    AttributeError when the model loads)."""
    dtype = (init_kwargs or {}).get("dtype")
    if isinstance(dtype, str) and dtype != "auto" and not isinstance(getattr(torch, dtype, None), torch.dtype):
        raise ValueError(f"{name} dtype {dtype!r}: expected auto or a torch dtype name (bfloat16, float16, float32).")


# Where transformers finds each FlashAttention: (its availability check, the module, the pip package).
FLASH_ATTENTION = {"flash_attention_2": ("is_flash_attn_2_available", "flash_attn", "flash-attn"),
                   "flash_attention_3": ("is_flash_attn_3_available", "flash_attn_interface", "flash-attn-3")}


def check_attention_available(value: str | None, flag: str) -> None:
    """Refuses a FlashAttention implementation that cannot load here, before any model does (transformers
    would raise a long ImportError from inside from_pretrained).

    Without the package transformers falls back to the `kernels` library's build from the hub, on a
    CUDA device: that is left to it.
    """
    if value not in FLASH_ATTENTION:
        return
    from transformers.utils import import_utils

    check, module, package = FLASH_ATTENTION[value]
    if getattr(import_utils, check)():
        return
    way_out = "use sdpa (or eager, flex_attention)"
    if not torch.cuda.is_available():
        raise ValueError(f"{flag} {value}: FlashAttention runs on a CUDA device and none is visible here; {way_out}.")
    if not import_utils.is_kernels_available():
        installed = importlib.util.find_spec(module) is not None
        raise ValueError(f"{flag} {value}: the {package} package is "
                         f"{'too old for transformers' if installed else 'not installed'} (pip install -U {package}), "
                         f"or {way_out}.")


# The package each `report_to` integration needs, and transformers' check that it is there.
REPORT_TO_PACKAGES = {
    "wandb": ("is_wandb_available", "wandb"), "tensorboard": ("is_tensorboard_available", "tensorboard"),
    "trackio": ("is_trackio_available", "trackio"), "mlflow": ("is_mlflow_available", "mlflow"),
    "azure_ml": ("is_azureml_available", "azureml-sdk"), "neptune": ("is_neptune_available", "neptune"),
    "codecarbon": ("is_codecarbon_available", "codecarbon"), "clearml": ("is_clearml_available", "clearml"),
    "dagshub": ("is_dagshub_available", "dagshub mlflow"), "flyte": ("is_flytekit_available", "flytekit"),
    "dvclive": ("is_dvclive_available", "dvclive"), "swanlab": ("is_swanlab_available", "swanlab"),
}


def check_report_to(report_to: list[str]) -> None:
    """Refuses a `report_to` integration that is unknown or whose package is missing, before any model loads
    (the Trainer would raise when it builds the integration's callback, after the models have loaded)."""
    from transformers.integrations import integration_utils

    for name in report_to:
        if name not in integration_utils.INTEGRATION_TO_CALLBACK:
            raise ValueError(f"--report_to {name}: expected none, all or one of "
                             f"{', '.join(integration_utils.INTEGRATION_TO_CALLBACK)}.")
        if name == "comet_ml":  # its check also wants an API key; the callback only the package
            available = integration_utils._is_comet_installed and integration_utils._is_comet_recent_enough
            check, package = None, "comet-ml"
        else:
            check, package = REPORT_TO_PACKAGES.get(name, (None, None))
            available = check is None or getattr(integration_utils, check, lambda: True)()
        if not available:
            raise ValueError(f"--report_to {name}: the {package} package is not installed "
                             f"(pip install {package}, or --report_to none).")


def check_positive_sizes(args: TrainingArguments) -> None:
    """Refuses batch sizes, step counts and saving intervals that would train nothing, or not as asked."""
    for flag in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag} must be >= 1; got {getattr(args, flag)}.")
    if args.max_steps == 0 or args.max_steps < -1:
        raise ValueError(f"--max_steps must be > 0, or -1 to train --num_train_epochs epochs; got {args.max_steps}.")
    if args.save_strategy == "steps" and args.save_steps <= 0:
        raise ValueError(f"--save_steps must be > 0 when saving by steps (a value below 1 is a share of the "
                         f"training steps); got {args.save_steps:g}.")


def transformers_offloads_checkpoints() -> bool:
    """Whether this transformers moves what checkpointed layers save to host memory when asked
    (`gradient_checkpointing_kwargs={"offload": true}`): its checkpointing switch takes `offload`."""
    import inspect

    from transformers import PreTrainedModel

    switches = [getattr(PreTrainedModel, name, None)
                for name in ("activation_checkpointing_enable", "gradient_checkpointing_enable")]
    return any(s is not None and "offload" in inspect.signature(s).parameters for s in switches)


def check_checkpoint_offload(args: TrainingArguments) -> None:
    """Refuses checkpoint offload where it cannot work, before any model loads.

    transformers' offload keeps each checkpointed layer's saved input in pinned host memory. Pinning
    needs an accelerator: without one torch raises inside the first backward, after the models
    loaded (and on the CPU the activations are in host memory already). A transformers without
    offload hands `offload` on to torch's checkpoint, which passes it to each layer's forward,
    where it is ignored: the run would hold everything on the device while the user believes
    otherwise.
    """
    kwargs = args.gradient_checkpointing_kwargs
    if not (args.gradient_checkpointing and isinstance(kwargs, dict) and kwargs.get("offload")):
        return
    import transformers

    flag = "--gradient_checkpointing_kwargs offload"
    if not transformers_offloads_checkpoints():
        raise ValueError(f"{flag}: this transformers ({transformers.__version__}) has no checkpoint offload, so "
                         "the checkpointed activations would stay on the device; upgrade transformers, or leave "
                         "offload out.")
    available = getattr(getattr(torch, "accelerator", None), "is_available", torch.cuda.is_available)
    if not available():
        raise ValueError(f"{flag}: offload keeps what the checkpointed layers save in pinned host memory, "
                         "which needs a GPU (or another accelerator) and none is present; here the activations "
                         "are in host memory already: leave offload out.")


def check_optimizer_available(args: TrainingArguments) -> None:
    """Refuses an `--optim` whose package is not installed (bitsandbytes' 8-bit and paged optimizers,
    torchao's, schedule-free...), before any model loads: the Trainer finds it only when it builds the
    optimizer, after the models loaded, with a traceback. The Trainer's own lookup runs here, without
    the model; what it can only check with the model is left to it."""
    from transformers import Trainer

    try:
        Trainer.get_optimizer_cls_and_kwargs(args)
    except ImportError as err:
        raise ValueError(f"--optim {getattr(args.optim, 'value', args.optim)}: {err}") from None
    except Exception:  # noqa: BLE001 (needs the model, or the Trainer's later checks say it better)
        pass


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
    tiled_mlp_tokens: int = field(
        default=0,
        metadata={"help": "Run each decoder layer's MLP over tiles of this many tokens, each tile checkpointed, so "
                  "that only one tile's MLP activations exist at a time (policy, reference, teacher); the MLP "
                  "runs forward once more in the backward. For long rows; 0 (default) leaves the MLPs whole. "
                  "Dense MLPs only. Not in TRL."},
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
        check_json_flags(self)
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
        check_positive_sizes(self)
        check_checkpoint_offload(self)
        check_optimizer_available(self)
        check_report_to(self.report_to)
        check_init_dtype(self.model_init_kwargs, "model_init_kwargs")
        check_attention_available((self.model_init_kwargs or {}).get("attn_implementation"),
                                  "model_init_kwargs attn_implementation")
        if self.tiled_mlp_tokens < 0:
            raise ValueError(f"--tiled_mlp_tokens must be >= 0 (0 leaves the MLPs whole); got {self.tiled_mlp_tokens}.")
        if self.max_length is not None and self.max_length <= 0:
            raise ValueError(f"max_length must be positive, got {self.max_length}.")
        if self.compile_layers and self.gradient_checkpointing:
            logger.warning(
                "compile_layers with gradient_checkpointing: checkpointing already recomputes every activation, so "
                "the compiled layers save memory only in the one layer being recomputed (about half of what it "
                "saves: benchmarks/layer_saved_bytes.py), and on an H200 (DPO, 0.5B model, 8k-16k tokens) they "
                "ran at 0.55-0.74x the speed of TRL + Liger with checkpointing (docs/benchmarks.md). Consider "
                "--use_liger_kernel instead of --compile_layers there."
            )
