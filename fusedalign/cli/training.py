"""`fusedalign dpo|kto|sft|grpo`: parse, check the output directory, load, train, save, plot."""

from __future__ import annotations

import os
import shlex
import sys
from typing import Any

from fusedalign.cli.commands import TRAINING_COMMANDS, load
from fusedalign.cli.interrupt import Interrupted, InterruptGuard
from fusedalign.cli.output_dir import (
    check_output_dir,
    check_resume,
    last_checkpoint,
    move_old_run_aside,
    move_past_checkpoint_aside,
    resolve_resume,
)
from fusedalign.errors import CLIError, flag_value


# Whether this process got past the checks into training: an error before it is the same on
# every rank, so only rank 0 reports it (fusedalign.cli.main, which lowers it as each command starts).
STATE = {"training": False}


def _is_main_process() -> bool:
    return os.environ.get("RANK", "0") == "0"


def peft_config_from(model_args: Any) -> Any:
    if not model_args.use_peft:
        return None
    from peft import LoraConfig

    if model_args.lora_r < 1:
        raise CLIError(f"--lora_r must be >= 1 (the adapter's rank); got {model_args.lora_r}.")
    if not 0 <= model_args.lora_dropout < 1:
        raise CLIError(f"--lora_dropout must be in [0, 1); got {model_args.lora_dropout:g}.")
    if model_args.lora_alpha == 0:
        raise CLIError("--lora_alpha 0 scales the adapter's output, and so its gradients, to zero: the run would "
                       "train nothing; give the usual 2 x --lora_r, for instance.")
    targets = model_args.lora_target_modules or ["all-linear"]
    if "all-linear" in targets:
        # PEFT's shorthand is a string, not a module name: a list holding it matches nothing.
        if len(targets) > 1:
            raise CLIError(f"--lora_target_modules {' '.join(targets)}: all-linear already names every linear "
                           "layer but lm_head; give it alone, or list the modules (add lm_head to adapt the head).")
        targets = "all-linear"
    return LoraConfig(
        task_type=model_args.lora_task_type, r=model_args.lora_r, lora_alpha=model_args.lora_alpha,
        lora_dropout=model_args.lora_dropout, target_modules=targets,
        modules_to_save=model_args.lora_modules_to_save, use_rslora=model_args.use_rslora,
        use_dora=model_args.use_dora,
    )


def check_adapter_on_head(model_args: Any, args: Any) -> None:
    """DoRA rescales each output row by a norm of the whole weight: not what the fused head computes."""
    on_head = "lm_head" in (model_args.lora_target_modules or [])
    if model_args.use_peft and model_args.use_dora and args.fused_head and on_head:
        raise CLIError("--use_dora with lm_head in --lora_target_modules: the fused head trains plain LoRA on the "
                       "output head; drop lm_head from the targets, or add --fused_head false.")


def _load_kwargs(model_args: Any) -> dict[str, Any]:
    """`from_pretrained` arguments the model flags ask for (the model's and its tokenizer's revision included)."""
    kwargs = {}
    if model_args.model_revision != "main":
        kwargs["revision"] = model_args.model_revision
    if model_args.trust_remote_code:
        kwargs["trust_remote_code"] = True
    return kwargs


def load_model_from(model_args: Any, args: Any = None) -> Any:
    """The policy as the flags ask: `--dtype` (float32 by default, as TRL's), revision, attention; the
    config's `model_init_kwargs`, when given, on top."""
    from fusedalign.models import load_model_with

    kwargs = _load_kwargs(model_args)
    if model_args.attn_implementation:
        kwargs["attn_implementation"] = model_args.attn_implementation
    kwargs["dtype"] = model_args.dtype
    return load_model_with(model_args.model_name_or_path, "model_init_kwargs", getattr(args, "model_init_kwargs", None),
                           **kwargs)


def load_tokenizer_from(model_args: Any) -> Any:
    """The tokenizer at the model's revision (None at `main`: the trainer loads it from the model's path)."""
    if model_args.model_revision == "main":
        return None
    from fusedalign.models import load_tokenizer

    return load_tokenizer(model_args.model_name_or_path, **_load_kwargs(model_args))


def _expected_kinds(command: str, args: Any) -> str:
    return "dpo" if command == "kto" and getattr(args, "unpair_preference", False) else command


def load_splits(command: str, script: Any, args: Any) -> tuple[Any, Any]:
    """The train split and, when evaluating, the test split, both checked row by row."""
    from fusedalign.data import load_dataset_any
    from fusedalign.data.builtin import is_single_file, located_error
    from fusedalign.data.formats import DataError, validate_dataset
    from fusedalign.data.splits import is_tokenised
    from fusedalign.data.text_field import with_text_field

    if script.dataset_name is None:
        raise CLIError("--dataset_name is required with --model_name_or_path (e.g. builtin:zen or a local file).")
    if args.eval_strategy != "no" and is_single_file(script.dataset_name):
        raise CLIError(
            f"--eval_strategy {flag_value(args.eval_strategy)}: {script.dataset_name} is a single file, so it has no test split "
            "to evaluate on (evaluating on the training file would measure nothing); use --eval_strategy no, or a "
            "directory with train and test files."
        )
    splits = [script.dataset_train_split] + ([script.dataset_test_split] if args.eval_strategy != "no" else [])
    loaded = []
    for split in splits:
        dataset = load_dataset_any(script.dataset_name, script.dataset_config, split=split)
        try:
            if not is_tokenised(dataset, command):  # token-id columns are the trainer's to check
                # SFT reads its text column as `text` (the trainer renames it again, from the original).
                shown = with_text_field(dataset, args.dataset_text_field) if command == "sft" else dataset
                validate_dataset(shown, _expected_kinds(command, args))
        except DataError as err:
            raise located_error(err, script.dataset_name, split) from None
        loaded.append(dataset)
    return loaded[0], (loaded[1] if len(loaded) > 1 else None)


def build_trainer(command: str, script: Any, args: Any, model_args: Any, train: Any, evaluate: Any) -> Any:
    """The trainer `fusedalign COMMAND` trains, from its parsed flags (also what `fusedalign verify` runs)."""
    from fusedalign.data.builtin import located_error
    from fusedalign.data.formats import DataError

    trainer_cls = load(TRAINING_COMMANDS[command][1])
    try:
        check_adapter_on_head(model_args, args)
        return trainer_cls(model=load_model_from(model_args, args), args=args, train_dataset=train,
                           eval_dataset=evaluate, peft_config=peft_config_from(model_args),
                           processing_class=load_tokenizer_from(model_args))
    except DataError as err:
        raise located_error(err, script.dataset_name, None) from None


def _train_and_save(trainer: Any, args: Any, resume: str | None, guard: InterruptGuard) -> None:
    """Trains, then saves model, tokenizer and the curves; checkpoints are never removed here."""
    from fusedalign.distributed import prepare_final_save
    from fusedalign.distributed.checkpoints import CheckpointConfigCallback
    from fusedalign.plot import plot_run

    trainer.add_callback(guard)
    trainer.add_callback(CheckpointConfigCallback())  # a sharded checkpoint can then be consolidated alone
    trainer.train(resume_from_checkpoint=resume)
    with guard.protect():
        prepare_final_save(trainer)
        trainer.save_model(args.output_dir)
    if trainer.is_world_process_zero():
        try:
            print(f"[fusedalign] training curves: {plot_run(args.output_dir)}", file=sys.stderr)
        except (ValueError, FileNotFoundError) as err:
            print(f"[fusedalign] no plot drawn: {err}", file=sys.stderr)
        saved = ("the LoRA adapter (fusedalign merge folds it into its base)" if hasattr(trainer.model, "peft_config")
                 else "model")
        print(f"[fusedalign] {saved}, tokenizer and metrics.jsonl saved in {args.output_dir}", file=sys.stderr)


def run_training(command: str, argv: list[str]) -> int:
    """`fusedalign dpo|kto|sft|grpo`: returns the exit code (128 + signal number when interrupted)."""
    from fusedalign.launch import check_launch

    check_launch()
    guard = InterruptGuard()
    guard.install()
    run: dict[str, Any] = {}
    try:
        return _run(command, argv, guard, run)
    except Interrupted as stop:
        if _is_main_process():
            args = run.get("args") if run.get("training") else None
            print(interrupt_report(command, argv, args, stop.signum), file=sys.stderr)
        from fusedalign.cli import _exit_code

        return _exit_code(128 + stop.signum)


def _run(command: str, argv: list[str], guard: InterruptGuard, run: dict[str, Any]) -> int:
    from fusedalign.cli.help import dataclass_types
    from fusedalign.cli.parsing import parse
    from fusedalign.distributed import setup_distributed, teardown_distributed

    types = dataclass_types(command)
    setup_distributed()  # before any argument or model is built (DeepSpeed on CPU)
    script, args, model_args, run_args = parse(command, types, argv)
    run["args"] = args
    resume = resolve_resume(args.resume_from_checkpoint, args.output_dir)
    # Refused before the slow part; an old run (or what lies past the checkpoint resumed from) is moved
    # aside only once the new one is ready to write.
    move_aside = check_output_dir(args.output_dir, resume=resume, overwrite=run_args.overwrite_output_dir)
    complete = check_resume(resume, args) if resume is not None else None
    if complete is not None:  # a requeued job of a finished run: the Trainer would take one more step
        if _is_main_process():
            print(complete, file=sys.stderr)
        teardown_distributed()
        return 0
    load("fusedalign.cli.precheck:check_models")(args, model_args)  # teacher, reference, rewards: before any weights
    train, evaluate = load_splits(command, script, args)
    trainer = build_trainer(command, script, args, model_args, train, evaluate)
    if move_aside:
        move_old_run_aside(args)
    elif resume is not None:
        move_past_checkpoint_aside(args, resume)
    run["training"] = STATE["training"] = True
    _train_and_save(trainer, args, resume, guard)
    teardown_distributed()
    return 0


def resume_command(command: str, argv: list[str]) -> str:
    """The command line that continues this run from its last checkpoint."""
    from fusedalign.launch import launcher_prefix

    kept, skip = [], False
    for i, token in enumerate(argv):
        if skip:
            skip = False
            continue
        name = token.split("=", 1)[0]
        if name in ("--resume_from_checkpoint", "--overwrite_output_dir"):
            has_value = "=" not in token and i + 1 < len(argv) and not argv[i + 1].startswith("--")
            skip = has_value
            continue
        kept.append(token)
    prefix = launcher_prefix() or ["fusedalign"]
    return shlex.join([*prefix, command, *kept, "--resume_from_checkpoint", "last"])


def interrupt_report(command: str, argv: list[str], args: Any, signum: int) -> str:
    """What an interrupted run tells its user: where the last checkpoint is and how to resume."""
    import signal

    name = signal.Signals(signum).name
    if args is None:
        return f"[fusedalign] interrupted ({name}) before training started; nothing was written or moved."
    last = last_checkpoint(args.output_dir)
    if last is None:
        why = "save_strategy is 'no'" if args.save_strategy == "no" else "none was due yet"
        return (f"[fusedalign] interrupted ({name}): no checkpoint was saved in {args.output_dir} ({why}), "
                "so there is nothing to resume from.")
    return (f"[fusedalign] interrupted ({name}); every checkpoint is complete, the last one is {last}.\n"
            f"[fusedalign] resume with: {resume_command(command, argv)}")
