"""`fusedalign sft|dpo|kto|grpo|rloo|plot|merge|consolidate ...`: the command line.

Each training command parses its dataclasses (`parsing.py`: HfArgumentParser, plus
`--config file.yaml` whose values act as defaults under the flags), checks the output
directory (`output_dir.py`), builds the trainer, trains, saves the model, tokenizer and
metrics to `--output_dir`, and draws the training curves (`training.py`). With no
`--model_name_or_path`, the embedded demo's defaults fill in what the user did not give
(`demo.py`). `--help` is answered without importing torch (`help.py`).

This module imports nothing heavy: `fusedalign --help` and `fusedalign dpo --help` stay fast.
"""

from __future__ import annotations

import difflib
import os
import sys
from typing import Callable

from fusedalign.cli.commands import TRAINING_COMMANDS
from fusedalign.cli.demo import DEMO_DEFAULTS
from fusedalign.errors import CLIError, LaunchError, one_line

USAGE = """usage: fusedalign <command> [flags]

commands:
  dpo          Direct Preference Optimization on preference data
  kto          Kahneman-Tversky Optimization on unpaired preference data
  sft          supervised fine-tuning (language modeling / prompt-completion)
  grpo         Group Relative Policy Optimization on prompts, with reward functions
  rloo         REINFORCE Leave-One-Out on prompts, with reward functions
  plot         draw the training curves of an output dir: fusedalign plot OUTPUT_DIR
  merge        merge a LoRA adapter into its base model: fusedalign merge ADAPTER_DIR OUTPUT_DIR
  consolidate  make a sharded (FSDP2) checkpoint loadable with from_pretrained:
               fusedalign consolidate CHECKPOINT_DIR [OUTPUT_DIR]

`fusedalign <command> --help` lists a command's own flags, `--help-all` every flag.
With no --model_name_or_path, a training command runs the embedded demo
(builtin:tiny-qwen2 on builtin:zen); any flag you give overrides the demo's settings.

Distributed (2 processes):
  with GPUs:    accelerate launch --config_file configs/accelerate/zero3.yaml -m fusedalign dpo ...
  without GPUs: accelerate launch --config_file configs/accelerate/cpu/zero3.yaml -m fusedalign dpo ...
(ddp, zero2, zero3, fsdp2; never add --cpu: accelerate would start one plain process)
"""

__all__ = ["COMMANDS", "CLIError", "DEMO_DEFAULTS", "TRAINING_COMMANDS", "USAGE", "main", "parse"]

HELP_FLAGS = ("-h", "--help", "--help-all")


def parse(command: str, dataclass_types: tuple, argv: list[str]) -> tuple:
    """Parses flags (and `--config` YAML defaults) into the given dataclasses; see `parsing.parse`."""
    from fusedalign.cli.parsing import parse as parse_flags

    return parse_flags(command, dataclass_types, argv)


def _training(command: str) -> Callable[[list[str]], int]:
    def run(argv: list[str]) -> int:
        if any(flag in argv for flag in HELP_FLAGS):
            from fusedalign.cli.help import help_text

            print(help_text(command, full="--help-all" in argv))
            return 0
        from fusedalign.cli.training import run_training

        return run_training(command, argv)

    return run


def _tool(name: str) -> Callable[[list[str]], int]:
    def run(argv: list[str]) -> int:
        from fusedalign.cli import tools

        return getattr(tools, f"run_{name}")(argv)

    return run


COMMANDS: dict[str, Callable[[list[str]], int]] = {
    **{name: _training(name) for name in TRAINING_COMMANDS},
    **{name: _tool(name) for name in ("plot", "merge", "consolidate")},
}


def _is_main_process() -> bool:
    return os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")) == "0"


def _exit_code(code: int) -> int:
    """Leaves at once from a multi-process run, whose process group aborts at exit otherwise."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        close = difflib.get_close_matches(command, COMMANDS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        print(f"fusedalign: unknown command {command!r}{hint}.\n\n{USAGE}", file=sys.stderr)
        return 2
    from fusedalign.cli.noise import quiet_known_noise
    from fusedalign.errors import USER_ERRORS

    quiet_known_noise()
    try:
        return COMMANDS[command](rest) or 0
    except LaunchError as err:  # every rank finds the same: one of them says it
        if _is_main_process():
            print(f"fusedalign {command}: error: {one_line(err)}", file=sys.stderr)
        return _exit_code(2)
    except (CLIError, *USER_ERRORS) as err:
        if os.environ.get("FUSEDALIGN_TRACEBACK"):
            raise
        rank = os.environ.get("RANK", "0")
        where = "" if rank == "0" else f" (rank {rank})"
        print(f"fusedalign {command}{where}: error: {one_line(err)}", file=sys.stderr)
        return _exit_code(2)


if __name__ == "__main__":
    sys.exit(main())
