"""TRL 1.16 fields that fusedalign does not have: vLLM's, others of each trainer's config, and the
arguments every `trl` script parses beside it (ScriptArguments, ModelConfig's quantisation,
DatasetMixtureConfig).

A TRL user's command line or YAML may carry them. Given with the value that means what
fusedalign does anyway (TRL's default, mostly: `--use_vllm false`), a flag is dropped: the run
is the one asked for. Any other value is refused in one line that says what runs instead,
rather than an "unknown flag" whose closest-name hint points somewhere else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fusedalign.cli.commands import GENERATING_COMMANDS
from fusedalign.errors import CLIError

_GENERATION = ("samples with --generation_backend (auto: fusedalign's StaticDecode on CUDA, transformers' generate on "
               "the CPU)")
_NOT_BUILT = "is not implemented in fusedalign"
_NOT_BUILT_ALL = "are not implemented in fusedalign"
_QUANTISED = ("quantised loading (bitsandbytes) " + _NOT_BUILT + "; the model is loaded in --dtype")


@dataclass(frozen=True)
class Absent:
    same: tuple[str, ...]  # values (lower-case text) that ask for what fusedalign does
    line: str  # why any other value cannot run, and what to do


ABSENT: dict[str, Absent] = {
    "ds3_gather_for_generation": Absent(("true",), "fusedalign makes ZeRO-3 weights whole once per generation "
                                        "(TRL's default, true); generating from sharded weights is not supported"),
    "cast_lm_head_to_fp32": Absent(("false",), "fusedalign's head runs the logits GEMM in the weights' dtype (autocast's "
                                   "under --bf16/--fp16) and its softmax in float32, as TRL's default (false) does; a "
                                   "float32 copy of the head " + _NOT_BUILT + " (load float32 weights without --bf16 "
                                   "for a float32 GEMM)"),
    "pad_to_multiple_of": Absent(("auto", "none", "null"), "fusedalign does not pad sequences to a multiple of a "
                                 "length; its rows are padded to the longest or packed (--padding_free)"),
    "sync_ref_model": Absent(("false",), f"syncing the reference model to the policy {_NOT_BUILT}: the reference "
                             "stays the initial weights (TRL's default, false)"),
    "ref_model_mixup_alpha": Absent(("0.6",), "used only with --sync_ref_model, which " + _NOT_BUILT),
    "ref_model_sync_steps": Absent(("512",), "used only with --sync_ref_model, which " + _NOT_BUILT),
    "use_adaptive_entropy": Absent(("false",), f"the adaptive entropy coefficient {_NOT_BUILT}; "
                                   "--entropy_coef sets a fixed one"),
    "entropy_coef_min": Absent(("0.0", "0"), "used only with --use_adaptive_entropy, which " + _NOT_BUILT),
    "entropy_coef_max": Absent(("1.0", "1"), "used only with --use_adaptive_entropy, which " + _NOT_BUILT),
    "entropy_coef_delta": Absent(("0.005",), "used only with --use_adaptive_entropy, which " + _NOT_BUILT),
    "entropy_target": Absent(("0.2",), "used only with --use_adaptive_entropy, which " + _NOT_BUILT),
    "off_policy_mask_threshold": Absent(("none", "null"), f"masking sequences by their off-policy KL {_NOT_BUILT}"),
    "router_aux_loss_coef": Absent(("none", "null"), f"adding a mixture-of-experts router's auxiliary loss {_NOT_BUILT}"),
    "max_tool_calling_iterations": Absent(("none", "null"), f"tool calling during generation {_NOT_BUILT}"),
    "chat_template_kwargs": Absent(("none", "null", "{}"), "prompts are templated with the tokenizer's chat "
                                   "template and its defaults; passing it keyword arguments " + _NOT_BUILT
                                   + " (template the prompts yourself to change them)"),
    "log_multimodal": Absent(("true", "false"), "fusedalign trains text models only"),
    "log_unique_prompts": Absent(("false",), "logging each prompt once " + _NOT_BUILT + "; --log_completions "
                                 "prints the first --num_completions_to_print rows and writes every completion to "
                                 "OUTPUT_DIR/completions.jsonl"),
    "log_completions_hub_repo": Absent(("none", "null"), "completions are written to OUTPUT_DIR/completions.jsonl "
                                       "(--log_completions); nothing is pushed to the Hub"),
    "use_transformers_paged": Absent(("false",), f"fusedalign {_GENERATION}"),
    "use_transformers_continuous_batching": Absent(("false",), f"fusedalign {_GENERATION}"),
    "transformers_continuous_batching_config": Absent(("none", "null", "{}"), f"fusedalign {_GENERATION}"),
    # TRL's scripts: ScriptArguments, ModelConfig and DatasetMixtureConfig, parsed by every `trl` command.
    "dataset_streaming": Absent(("false",), "streaming the dataset " + _NOT_BUILT + "; it is loaded whole"),
    "ignore_bias_buffers": Absent(("false",), "leaving boolean buffers out of DDP's sync (TRL's DPO script's "
                                  "workaround) " + _NOT_BUILT),
    "datasets": Absent(("[]", "none", "null"), "a mixture of datasets " + _NOT_BUILT + "; give one with "
                       "--dataset_name (and --dataset_config)"),
    "streaming": Absent(("false",), "streaming the datasets " + _NOT_BUILT + "; they are loaded whole"),
    "test_split_size": Absent(("none", "null"), "splitting a test set off the training data " + _NOT_BUILT
                              + "; evaluation reads --dataset_test_split"),
    "load_in_4bit": Absent(("false",), _QUANTISED),
    "load_in_8bit": Absent(("false",), _QUANTISED),
    "bnb_4bit_quant_type": Absent(("nf4",), "used only with --load_in_4bit: " + _QUANTISED),
    "use_bnb_nested_quant": Absent(("false",), "used only with --load_in_4bit: " + _QUANTISED),
    "bnb_4bit_quant_storage": Absent(("none", "null"), "used only with --load_in_4bit: " + _QUANTISED),
    "lora_target_parameters": Absent(("none", "null", "[]"), "LoRA on parameters rather than modules (PEFT's "
                                     "target_parameters) " + _NOT_BUILT + "; --lora_target_modules names the "
                                     "modules to adapt"),
    # SFTConfig
    "loss_type": Absent(("nll", "chunked_nll"), "the DFT loss " + _NOT_BUILT + "; SFT's loss is the token mean "
                        "of the negative log-likelihood (TRL's default, nll; chunked_nll is its deprecated alias)"),
    "packing_strategy": Absent(("bfd",), "--packing packs best-fit decreasing, each sequence truncated to "
                               "--max_length first (TRL's default, bfd); bfd_split and wrapped " + _NOT_BUILT_ALL),
    "shuffle_dataset": Absent(("false",), "shuffling the dataset once before packing " + _NOT_BUILT + "; the "
                              "training sampler shuffles the rows (--train_sampling_strategy)"),
    "eos_token": Absent(("none", "null"), "each text ends with the tokenizer's own eos_token (TRL's default, None); "
                        "setting another " + _NOT_BUILT + " (save it in the tokenizer of --model_name_or_path)"),
    "pad_token": Absent(("none", "null"), "rows are padded with the tokenizer's pad_token, else its eos_token "
                        "(TRL's default, None; the flag is deprecated in TRL); setting another " + _NOT_BUILT),
    "chat_template_path": Absent(("none", "null"), "conversations are rendered with the chat template of the "
                                 "tokenizer at --model_name_or_path (TRL's default, None); loading another "
                                 + _NOT_BUILT + " (save it with the tokenizer)"),
    "dataset_kwargs": Absent(("none", "null", "{}", "{'skip_prepare_dataset': false}",
                              '{"skip_prepare_dataset": false}'), "skipping the dataset preparation (skip_prepare_dataset) "
                             + _NOT_BUILT + "; give tokenised rows (input_ids, optionally completion_mask) and "
                             "they are used as they are"),
    "activation_offloading": Absent(("false",), "offloading activations to the CPU " + _NOT_BUILT
                                    + "; --gradient_checkpointing saves activation memory"),
    # DPOConfig, KTOConfig
    "precompute_ref_batch_size": Absent(("none", "null"), "--precompute_ref_log_probs runs the reference over "
                                        "batches of --per_device_eval_batch_size rows; set that instead"),
}


_REFERENCE_SYNC = ("sync_ref_model", "ref_model_mixup_alpha", "ref_model_sync_steps")
_GENERATION_FIELDS = ("chat_template_kwargs", "ds3_gather_for_generation", "log_unique_prompts",
                      "use_transformers_paged", "use_transformers_continuous_batching",
                      "transformers_continuous_batching_config")
# Every `trl` command parses the script's, the model's and the dataset mixture's arguments.
_SCRIPT = ("dataset_streaming", "ignore_bias_buffers", "datasets", "streaming", "test_split_size", "load_in_4bit",
           "load_in_8bit", "bnb_4bit_quant_type", "use_bnb_nested_quant", "bnb_4bit_quant_storage",
           "lora_target_parameters")
_EVERY = _SCRIPT + ("pad_to_multiple_of", "router_aux_loss_coef")
_SFT = ("loss_type", "packing_strategy", "shuffle_dataset", "eos_token", "pad_token",
        "chat_template_path", "dataset_kwargs", "activation_offloading")
_DPO = ("precompute_ref_batch_size", "activation_offloading", "pad_token")
_GRPO = _EVERY + _REFERENCE_SYNC + _GENERATION_FIELDS + (
    "cast_lm_head_to_fp32", "use_adaptive_entropy", "entropy_coef_min", "entropy_coef_max", "entropy_coef_delta",
    "entropy_target", "off_policy_mask_threshold", "max_tool_calling_iterations", "log_multimodal",
    "log_completions_hub_repo")
# Which of them each TRL 1.16 command has (its config, or its script's arguments).
FIELDS: dict[str, frozenset[str]] = {
    "sft": frozenset(_EVERY + _SFT),
    "dpo": frozenset(_EVERY + _REFERENCE_SYNC + _DPO),
    "kto": frozenset(_EVERY + _REFERENCE_SYNC + ("precompute_ref_batch_size", "activation_offloading")),
    "grpo": frozenset(_GRPO),
    "rloo": frozenset(_EVERY + _REFERENCE_SYNC + _GENERATION_FIELDS + ("log_multimodal",)),
    "distillation": frozenset(_SCRIPT + ("pad_to_multiple_of", "chat_template_kwargs", "ds3_gather_for_generation",
                                         "log_unique_prompts", "max_tool_calling_iterations")),
}


def _text(value: Any) -> str:
    return "none" if value is None else str(value).strip().lower()


def _vllm_line(command: str, flag: str) -> str:
    if command in GENERATING_COMMANDS:
        return (f"{flag}: fusedalign does not use vLLM; completions are sampled in the training processes by "
                "--generation_backend (auto: fusedalign's StaticDecode, one CUDA graph a token, on CUDA; "
                "transformers' generate on the CPU) with the same sampling flags; drop the vLLM flags.")
    return (f"{flag}: `fusedalign {command}` generates nothing (TRL's {command.upper()} has no vLLM flags either) "
            "and fusedalign does not use vLLM; drop the flag.")


def _vllm(key: str) -> bool:
    return key == "use_vllm" or key.startswith("vllm_")


def _check_vllm(command: str, key: str, value: Any, where: str) -> None:
    """`use_vllm false` (TRL's default) is the run here; any other vLLM field is refused."""
    if key.startswith("vllm_") or _text(value) not in ("false", "0", "no"):
        raise CLIError(_vllm_line(command, where))


def drop_absent(command: str, argv: list[str], config_values: dict[str, Any], known: set[str]) -> list[str]:
    """Removes TRL-only fields given with a value that changes nothing; refuses any other value in one line.

    `known`: the fields the command's own parser has (never intercepted).
    """
    fields = FIELDS.get(command, frozenset()) - known
    for key in [k for k in config_values if k in fields or _vllm(k)]:
        value = config_values.pop(key)
        if _vllm(key):
            _check_vllm(command, key, value, f"--config key {key}")
        elif _text(value) not in ABSENT[key].same:
            raise CLIError(f"--config key {key}: {value!r}: {ABSENT[key].line}; drop it.")
    kept, i = [], 0
    while i < len(argv):
        name, eq, value = argv[i].partition("=")
        key = name[2:] if name.startswith("--") else ""
        if key not in fields and not _vllm(key):
            kept.append(argv[i])
            i += 1
            continue
        if not eq:
            has_value = i + 1 < len(argv) and not argv[i + 1].startswith("--")
            value, i = (argv[i + 1], i + 1) if has_value else ("true", i)  # a bare boolean flag means true
        if _vllm(key):
            _check_vllm(command, key, value, name)
        elif _text(value) not in ABSENT[key].same:
            raise CLIError(f"{name} {value}: {ABSENT[key].line}; drop the flag.")
        i += 1
    return kept
