"""`fusedalign sft|dpo|kto|plot|merge ...`: the command line.

Each training command parses its dataclasses (HfArgumentParser, plus `--config
file.yaml` whose values act as defaults under the command-line flags), builds the
trainer, trains, saves the model, tokenizer and metrics to `--output_dir`, and draws
the training curves. With no `--model_name_or_path`, the embedded demo runs: the tiny
model on the embedded zen data, on whatever device is present.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable

import yaml

USAGE = """usage: fusedalign <command> [flags]

commands:
  dpo     Direct Preference Optimization on preference data
  kto     Kahneman-Tversky Optimization on unpaired preference data
  sft     supervised fine-tuning (language modeling / prompt-completion)
  plot    draw the training curves of an output dir: fusedalign plot OUTPUT_DIR
  merge   merge a LoRA adapter into its base model: fusedalign merge ADAPTER_DIR OUTPUT_DIR

`fusedalign <command> --help` lists a command's flags. With no --model_name_or_path,
a training command runs the embedded demo (builtin:tiny-qwen2 on builtin:zen).
Distributed: accelerate launch --config_file configs/accelerate/zero3.yaml -m fusedalign dpo ...
"""

# The embedded demo: used when no model is named. Every value can still be overridden.
DEMO_DEFAULTS: dict[str, dict[str, Any]] = {
    "dpo": dict(
        model_name_or_path="builtin:tiny-qwen2", dataset_name="builtin:zen", dataset_config="standard_preference",
        output_dir="outputs/dpo", learning_rate=5e-4, num_train_epochs=3, per_device_train_batch_size=8,
        lr_scheduler_type="constant", warmup_steps=0, logging_steps=5, save_strategy="no", beta=0.1,
        eval_strategy="epoch",
    ),
    "kto": dict(
        model_name_or_path="builtin:tiny-qwen2", dataset_name="builtin:zen",
        dataset_config="standard_unpaired_preference", output_dir="outputs/kto", learning_rate=1e-3,
        num_train_epochs=5, per_device_train_batch_size=8, lr_scheduler_type="constant", warmup_steps=0,
        logging_steps=5, save_strategy="no", beta=0.1, eval_strategy="epoch",
    ),
    "sft": dict(
        model_name_or_path="builtin:tiny-qwen2", dataset_name="builtin:zen",
        dataset_config="standard_language_modeling", output_dir="outputs/sft", learning_rate=1e-3,
        num_train_epochs=20, per_device_train_batch_size=8, lr_scheduler_type="constant", warmup_steps=0,
        logging_steps=6, save_strategy="no", eval_strategy="epoch",
    ),
}


class CLIError(Exception):
    """A user error on the command line: printed without a traceback."""


def _load_yaml(argv: list[str]) -> tuple[dict[str, Any], list[str]]:
    if "--config" not in argv:
        return {}, argv
    i = argv.index("--config")
    if i + 1 >= len(argv):
        raise CLIError("--config needs a YAML file path.")
    path = argv[i + 1]
    if not os.path.isfile(path):
        raise CLIError(f"--config {path}: no such file.")
    with open(path) as f:
        values = yaml.safe_load(f) or {}
    if not isinstance(values, dict):
        raise CLIError(f"--config {path}: expected a mapping of flag names to values, got {type(values).__name__}.")
    return values, argv[:i] + argv[i + 2 :]


def parse(command: str, dataclass_types: tuple, argv: list[str]) -> tuple:
    """Parses flags (and `--config` YAML defaults) into the given dataclasses."""
    from transformers import HfArgumentParser

    parser = HfArgumentParser(dataclass_types, prog=f"fusedalign {command}")
    # TRL's name for the fused head switch; Trainer has its own field of that name.
    argv = ["--fused_head" if a == "--use_liger_kernel" else a for a in argv]
    defaults, argv = _load_yaml(argv)
    known = {action.dest for action in parser._actions}
    unknown = sorted(set(defaults) - known)
    if unknown:
        raise CLIError(f"--config: unknown keys {unknown} for `fusedalign {command}`.")
    if "model_name_or_path" not in defaults and not any(a.startswith("--model_name_or_path") for a in argv):
        defaults = {**DEMO_DEFAULTS.get(command, {}), **defaults}
        print(f"[fusedalign] no --model_name_or_path: running the embedded demo ({defaults.get('model_name_or_path')} "
              f"on {defaults.get('dataset_name')}/{defaults.get('dataset_config')}).", file=sys.stderr)
    parser.set_defaults(**defaults)
    return parser.parse_args_into_dataclasses(args=argv)


def peft_config_from(model_args: Any) -> Any:
    if not model_args.use_peft:
        return None
    from peft import LoraConfig

    return LoraConfig(
        task_type="CAUSAL_LM", r=model_args.lora_r, lora_alpha=model_args.lora_alpha,
        lora_dropout=model_args.lora_dropout, target_modules=model_args.lora_target_modules or "all-linear",
        modules_to_save=model_args.lora_modules_to_save,
    )


def load_model_from(model_args: Any) -> Any:
    from fusedalign.models import load_model

    kwargs = {}
    if model_args.attn_implementation:
        kwargs["attn_implementation"] = model_args.attn_implementation
    if model_args.trust_remote_code:
        kwargs["trust_remote_code"] = True
    return load_model(model_args.model_name_or_path, dtype=model_args.dtype, **kwargs)


def load_splits(script: Any, args: Any) -> tuple[Any, Any]:
    from fusedalign.data import load_dataset_any

    if script.dataset_name is None:
        raise CLIError("--dataset_name is required with --model_name_or_path (e.g. builtin:zen or a local file).")
    train = load_dataset_any(script.dataset_name, script.dataset_config, split=script.dataset_train_split)
    evaluate = None
    if args.eval_strategy != "no":
        evaluate = load_dataset_any(script.dataset_name, script.dataset_config, split=script.dataset_test_split)
    return train, evaluate


def train_and_save(trainer: Any, args: Any) -> None:
    """Trains, then saves model, tokenizer and the curves; nothing in output_dir is removed."""
    from fusedalign.distributed import prepare_final_save
    from fusedalign.plot import plot_run

    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    prepare_final_save(trainer)
    trainer.save_model(args.output_dir)
    if trainer.is_world_process_zero():
        try:
            print(f"[fusedalign] training curves: {plot_run(args.output_dir)}", file=sys.stderr)
        except (ValueError, FileNotFoundError) as err:
            print(f"[fusedalign] no plot drawn: {err}", file=sys.stderr)
        print(f"[fusedalign] model, tokenizer and metrics.jsonl saved in {args.output_dir}", file=sys.stderr)


# command -> (config class, trainer class), as "module:attribute" so that `--help` of one
# command does not import every trainer.
TRAINING_COMMANDS: dict[str, tuple[str, str]] = {
    "dpo": ("fusedalign.configs.dpo:DPOConfig", "fusedalign.trainers.dpo:DPOTrainer"),
    "kto": ("fusedalign.configs.kto:KTOConfig", "fusedalign.trainers.kto:KTOTrainer"),
    "sft": ("fusedalign.configs.sft:SFTConfig", "fusedalign.trainers.sft:SFTTrainer"),
}


def _import(spec: str) -> Any:
    import importlib

    module, attribute = spec.split(":")
    return getattr(importlib.import_module(module), attribute)


def run_training(command: str, argv: list[str]) -> None:
    """`fusedalign dpo|kto|sft`: parse, load, train, save, plot."""
    from fusedalign.configs import ModelArguments, ScriptArguments
    from fusedalign.distributed import setup_distributed, teardown_distributed

    config_spec, trainer_spec = TRAINING_COMMANDS[command]
    setup_distributed()  # before any argument or model is built (DeepSpeed on CPU)
    script, args, model_args = parse(command, (ScriptArguments, _import(config_spec), ModelArguments), argv)
    trainer_cls = _import(trainer_spec)
    train, evaluate = load_splits(script, args)
    trainer = trainer_cls(
        model=load_model_from(model_args), args=args, train_dataset=train, eval_dataset=evaluate,
        peft_config=peft_config_from(model_args),
    )
    train_and_save(trainer, args)
    teardown_distributed()


def run_plot(argv: list[str]) -> None:
    from fusedalign.plot import plot_run

    if len(argv) != 1 or argv[0].startswith("-"):
        raise CLIError("usage: fusedalign plot OUTPUT_DIR")
    print(plot_run(argv[0]))


def run_merge(argv: list[str]) -> None:
    """`fusedalign merge ADAPTER_DIR OUTPUT_DIR [--base_model NAME]`: a LoRA adapter folded into its base."""
    usage = "usage: fusedalign merge ADAPTER_DIR OUTPUT_DIR [--base_model NAME_OR_PATH]"
    base = None
    if "--base_model" in argv:
        i = argv.index("--base_model")
        if i + 1 >= len(argv):
            raise CLIError(usage)
        base, argv = argv[i + 1], argv[:i] + argv[i + 2 :]
    if len(argv) != 2 or any(a.startswith("-") for a in argv):
        raise CLIError(usage)
    adapter_dir, output_dir = argv
    if not os.path.isfile(os.path.join(adapter_dir, "adapter_config.json")):
        raise CLIError(f"{adapter_dir} is not a PEFT adapter directory (no adapter_config.json); "
                       "expected the output_dir of a run with --use_peft.")
    from peft import PeftConfig, PeftModel

    from fusedalign.models import load_model, load_tokenizer

    base = base or PeftConfig.from_pretrained(adapter_dir).base_model_name_or_path
    model = PeftModel.from_pretrained(load_model(base), adapter_dir).merge_and_unload()
    has_tokenizer = any(os.path.isfile(os.path.join(adapter_dir, f)) for f in ("tokenizer.json", "tokenizer_config.json"))
    tokenizer = load_tokenizer(adapter_dir if has_tokenizer else base)
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    print(f"[fusedalign] {adapter_dir} merged into {base}; full model and tokenizer saved in {output_dir}", file=sys.stderr)


COMMANDS: dict[str, Callable[[list[str]], None]] = {
    **{name: (lambda argv, name=name: run_training(name, argv)) for name in TRAINING_COMMANDS},
    "plot": run_plot,
    "merge": run_merge,
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"fusedalign: unknown command {command!r}.\n\n{USAGE}", file=sys.stderr)
        return 2
    from fusedalign.errors import USER_ERRORS

    try:
        COMMANDS[command](rest)
    except (CLIError, *USER_ERRORS) as err:
        print(f"fusedalign {command}: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
