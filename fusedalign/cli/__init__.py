"""`fusedalign sft|dpo|kto|grpo|rloo|distillation|plot|merge|consolidate|verify|launch ...`: the command line.

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

USAGE = """usage: fusedalign <command> [flags]   (fusedalign --version: the versions in use)

commands:
  dpo          Direct Preference Optimization on preference data
  kto          Kahneman-Tversky Optimization on unpaired preference data
  sft          supervised fine-tuning (language modeling / prompt-completion)
  grpo         Group Relative Policy Optimization on prompts, with reward functions
  rloo         REINFORCE Leave-One-Out on prompts, with reward functions
  distillation on-policy distillation from a teacher model, on prompts
  plot         draw the training curves of an output dir: fusedalign plot OUTPUT_DIR
  merge        merge a LoRA adapter into its base model: fusedalign merge ADAPTER_DIR OUTPUT_DIR
  consolidate  make a sharded (FSDP2) checkpoint loadable with from_pretrained:
               fusedalign consolidate CHECKPOINT_DIR [OUTPUT_DIR]
  verify       check your setup: fused = unfused and N processes = 1, on your model and data:
               fusedalign verify dpo [dpo's flags] --backends ddp zero3  (--self_test: it catches known bugs)
  launch       check flags, data and model once, then run accelerate launch:
               fusedalign launch --config_file CONFIG [accelerate options] dpo [flags]

`fusedalign <command> --help` lists a command's own flags, `--help-all` every flag.
With no --model_name_or_path, a training command runs the embedded demo
(builtin:tiny-qwen2 on builtin:zen); any flag you give overrides the demo's settings.

Distributed (2 processes):
  with GPUs:    fusedalign launch --config_file configs/accelerate/zero3.yaml dpo ...
  without GPUs: fusedalign launch --config_file configs/accelerate/cpu/zero3.yaml dpo ...
  (or accelerate launch --config_file ... -m fusedalign dpo ..., without the checks first)
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


def _verify(argv: list[str]) -> int:
    from fusedalign.verify.command import run_verify

    return run_verify(argv)


def _launch(argv: list[str]) -> int:
    from fusedalign.cli.launcher import run_launch

    return run_launch(argv)


COMMANDS: dict[str, Callable[[list[str]], int]] = {
    **{name: _training(name) for name in TRAINING_COMMANDS},
    **{name: _tool(name) for name in ("plot", "merge", "consolidate")},
    "verify": _verify,
    "launch": _launch,
}


def _is_main_process() -> bool:
    return os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")) == "0"


def _training_started() -> bool:
    training = sys.modules.get("fusedalign.cli.training")
    return bool(training is not None and training.STATE["training"])


# How long a rank other than the main one waits, after an error found before training, before it
# exits. The launcher stops every rank as soon as one exits; the main rank, which finds the same
# error, must have said it by then. Leaving at once lost the line now and then under plain
# `accelerate launch` (rank 1 first, rank 0 stopped before it printed).
OTHER_RANKS_WAIT_S = 10.0


def _wait_for_the_main_process() -> None:
    import time

    time.sleep(OTHER_RANKS_WAIT_S)


def _exit_code(code: int) -> int:
    """Leaves at once from a multi-process run, whose process group aborts at exit otherwise."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _fresh_line() -> None:
    """Closes the progress bars an error interrupted, so that the error starts a line of its own
    and stays the last one (a bar left open redraws itself when it is collected, after it)."""
    tqdm = sys.modules.get("tqdm")
    for bar in list(getattr(getattr(tqdm, "tqdm", None), "_instances", ())):
        bar.close()  # ends the bar's line (or clears it)


def version_line() -> str:
    """`fusedalign --version`: ours and the versions that decide what a run does (no torch import)."""
    from importlib.metadata import PackageNotFoundError, version

    from fusedalign import __version__

    def of(dist: str) -> str:
        try:
            return version(dist)
        except PackageNotFoundError:
            return "not installed"

    deps = ", ".join(f"{dist} {of(dist)}" for dist in ("torch", "transformers", "accelerate", "peft", "deepspeed"))
    return f"fusedalign {__version__} ({deps}; python {sys.version.split()[0]})"


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except BrokenPipeError:  # `fusedalign dpo --help | head`: the reader left; nothing to report
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _main(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    command, rest = argv[0], argv[1:]
    if command in ("--version", "-V", "version"):
        print(version_line())
        return 0
    if command not in COMMANDS:
        close = difflib.get_close_matches(command, COMMANDS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        print(f"fusedalign: unknown command {command!r}{hint}.\n\n{USAGE}", file=sys.stderr)
        return 2
    from fusedalign.cli.noise import quiet_known_noise
    from fusedalign.errors import USER_ERRORS

    training = sys.modules.get("fusedalign.cli.training")
    if training is not None:  # a command run earlier in this process trained: this one has not yet
        training.STATE["training"] = False

    quiet_known_noise()
    try:
        return COMMANDS[command](rest) or 0
    except LaunchError as err:  # every rank finds the same: the main one says it
        if _is_main_process():
            _fresh_line()
            print(f"fusedalign {command}: error: {one_line(err)}", file=sys.stderr)
        else:
            _wait_for_the_main_process()
        return _exit_code(2)
    except (CLIError, *USER_ERRORS) as err:
        if os.environ.get("FUSEDALIGN_TRACEBACK"):
            raise
        rank = os.environ.get("RANK", "0")
        if rank != "0" and not _training_started():
            # Before training every rank checks the same flags, data and model: rank 0 says it. But
            # a rank that fails first has the launcher stop the others, rank 0 too, maybe before it
            # speaks: under `fusedalign launch`, which holds every error line back and prints one,
            # last, the other ranks say the same line too.
            if os.environ.get("FUSEDALIGN_LAUNCHED"):
                _fresh_line()
                print(f"fusedalign {command}: error: {one_line(err)}", file=sys.stderr)
            else:
                _wait_for_the_main_process()
            return _exit_code(2)
        where = "" if rank == "0" else f" (rank {rank})"
        _fresh_line()
        print(f"fusedalign {command}{where}: error: {one_line(err)}", file=sys.stderr)
        return _exit_code(2)


if __name__ == "__main__":
    sys.exit(main())
