"""TRL 1.16 config fields that fusedalign does not have: vLLM's, and others (most of them GRPO's,
RLOO's, distillation's).

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


@dataclass(frozen=True)
class Absent:
    same: tuple[str, ...]  # values (lower-case text) that ask for what fusedalign does
    line: str  # why any other value cannot run, and what to do


ABSENT: dict[str, Absent] = {
    "ds3_gather_for_generation": Absent(("true",), "fusedalign makes ZeRO-3 weights whole once per generation "
                                        "(TRL's default, true); generating from sharded weights is not supported"),
    "cast_lm_head_to_fp32": Absent(("true",), "fusedalign's head always computes logits in float32, chunk by chunk, "
                                   "whatever the weights' dtype (what true asks for)"),
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
    "model_init_kwargs": Absent(("none", "null", "{}"), "the model is loaded from --model_name_or_path with "
                                "--dtype, --attn_implementation and --trust_remote_code; give those"),
    "log_multimodal": Absent(("true", "false"), "fusedalign trains text models only"),
    "log_unique_prompts": Absent(("false",), "logging each prompt once " + _NOT_BUILT + "; --log_completions "
                                 "prints the first --num_completions_to_print rows and writes every completion to "
                                 "OUTPUT_DIR/completions.jsonl"),
    "log_completions_hub_repo": Absent(("none", "null"), "completions are written to OUTPUT_DIR/completions.jsonl "
                                       "(--log_completions); nothing is pushed to the Hub"),
    "use_transformers_paged": Absent(("false",), f"fusedalign {_GENERATION}"),
    "use_transformers_continuous_batching": Absent(("false",), f"fusedalign {_GENERATION}"),
    "transformers_continuous_batching_config": Absent(("none", "null", "{}"), f"fusedalign {_GENERATION}"),
}


_REFERENCE_SYNC = ("sync_ref_model", "ref_model_mixup_alpha", "ref_model_sync_steps")
_GENERATION_FIELDS = ("chat_template_kwargs", "ds3_gather_for_generation", "log_unique_prompts",
                      "use_transformers_paged", "use_transformers_continuous_batching",
                      "transformers_continuous_batching_config")
_EVERY = ("model_init_kwargs", "pad_to_multiple_of", "router_aux_loss_coef")
# Which of them each TRL 1.16 config has.
FIELDS: dict[str, frozenset[str]] = {
    "sft": frozenset(_EVERY),
    "dpo": frozenset(_EVERY + _REFERENCE_SYNC),
    "kto": frozenset(_EVERY + _REFERENCE_SYNC),
    "grpo": frozenset(ABSENT),
    "rloo": frozenset(_EVERY + _REFERENCE_SYNC + _GENERATION_FIELDS + ("log_multimodal",)),
    "distillation": frozenset(("model_init_kwargs", "pad_to_multiple_of", "chat_template_kwargs",
                               "ds3_gather_for_generation", "log_unique_prompts", "max_tool_calling_iterations")),
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
