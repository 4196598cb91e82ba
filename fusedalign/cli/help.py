"""`fusedalign <command> --help` (the command's own flags first) and `--help-all`.

The text is argparse's own rendering of the real parser, so it cannot drift from what
is parsed. Building that parser imports TrainingArguments, hence torch and peft (5-13 s
on a 2-core machine); the rendered text is therefore cached, and a cached `--help`
imports neither (`scripts/setup.sh` renders it once at install). Without a writable
cache it is rendered each time.

A cache entry is valid for the content of the sources it was rendered from, not their
modification times (a fresh checkout, a pull or a branch switch touches every file but
changes few): each entry records the SHA-256 of every fusedalign module that was
loaded when the parser was built (every line of code that shapes it lives in one of
those) and is used only while each of them still hashes the same. The file name adds
what the sources cannot show: the command, the Python version, and the installed
transformers version (TrainingArguments' flags depend on it).
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import importlib.metadata
import json
import os
import sys
from pathlib import Path

from fusedalign.cli.commands import TRAINING_COMMANDS, load

PACKAGE = Path(__file__).resolve().parents[1]


# TrainingArguments flags a run usually sets, listed by `--help` after the command's own.
COMMON_TRAINING_FLAGS = (
    "output_dir", "num_train_epochs", "max_steps", "per_device_train_batch_size", "per_device_eval_batch_size",
    "gradient_accumulation_steps", "learning_rate", "lr_scheduler_type", "warmup_steps", "logging_steps",
    "eval_strategy", "eval_steps", "save_strategy", "save_steps", "save_total_limit", "resume_from_checkpoint",
    "bf16", "gradient_checkpointing", "seed", "report_to",
)


def dataclass_types(command: str) -> tuple:
    """The dataclasses `fusedalign <command>` parses, in order (imports TrainingArguments)."""
    from fusedalign.cli.arguments import RunArguments
    from fusedalign.configs import ModelArguments, ScriptArguments

    return (ScriptArguments, load(TRAINING_COMMANDS[command][0]), ModelArguments, RunArguments)


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Lists each flag once: `--dataset_name`, not also its dashed twin `--dataset-name` (both parse)."""

    def _format_action_invocation(self, action: argparse.Action) -> str:
        options = action.option_strings
        shown = [s for s in options if not ("-" in s[2:] and "--" + s[2:].replace("-", "_") in options)]
        if shown != options:
            action = copy.copy(action)
            action.option_strings = shown
        return super()._format_action_invocation(action)


def _training_arguments_help(dest: str) -> str | None:
    from transformers import TrainingArguments

    field = TrainingArguments.__dataclass_fields__.get(dest)
    return field.metadata.get("help") if field is not None else None


def _declared_by_fusedalign(types: tuple) -> set[str]:
    """Fields that a fusedalign dataclass declares (or re-declares, as output_dir and learning_rate)."""
    own = set()
    for cls in types:
        for klass in cls.__mro__:
            if klass.__module__.startswith("fusedalign"):
                own.update(klass.__dict__.get("__annotations__", {}))
    return own


def render_help(command: str, full: bool) -> str:
    """The help text, rendered by argparse from the command's real parser."""
    from fusedalign.cli.parsing import build_parser, escape_help

    types = dataclass_types(command)
    parser = build_parser(command, types)
    own = _declared_by_fusedalign(types)
    groups = {
        "own": parser.add_argument_group(f"fusedalign {command} flags"),
        "common": parser.add_argument_group("TrainingArguments flags most runs set"),
        "rest": parser.add_argument_group("every other TrainingArguments flag"),
    }
    parser.formatter_class = _Formatter
    hidden = 0
    for action in parser._actions:
        if not action.option_strings:
            continue
        if not action.help:  # a field we re-declare (output_dir, learning_rate) keeps Trainer's help
            action.help = escape_help(_training_arguments_help(action.dest))
        if action.option_strings[0].startswith("--no_"):
            action.help = argparse.SUPPRESS  # the negation of a boolean flag, documented once below
        if action.dest in own or action.dest == "help":
            key = "own"
        elif action.dest in COMMON_TRAINING_FLAGS:
            key = "common"
        else:
            key = "rest"
            hidden += action.help is not argparse.SUPPRESS and not full
        if key != "rest" or full:
            groups[key]._group_actions.append(action)
    parser.add_argument("--help-all", action="store_true", help="List every flag, TrainingArguments' included.")
    groups["own"]._group_actions.append(parser._actions[-1])
    parser._action_groups = [groups["own"], groups["common"]] + ([groups["rest"]] if full else [])
    config = types[1]
    parser.description = (
        f"{(config.__doc__ or '').strip().splitlines()[0]} Flags follow TRL's names; `--config run.yaml` sets "
        "defaults under the flags. Boolean flags take true/false (alone: true; --no_NAME: false). With no "
        "--model_name_or_path, the embedded demo fills in what is not given: " + _demo_values(command) + "."
    )
    if not full:
        parser.epilog = f"... and {hidden} more TrainingArguments flags: fusedalign {command} --help-all"
    return parser.format_help()


def _demo_values(command: str) -> str:
    """The demo's settings as flags (`--learning_rate 0.003 ...`), for the command's help."""
    from fusedalign.cli.demo import DEMO_DEFAULTS

    def shown(value: object) -> str:
        return " ".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)

    return " ".join(f"--{name} {shown(value)}" for name, value in DEMO_DEFAULTS.get(command, {}).items())


def cache_dir() -> Path:
    root = os.environ.get("FUSEDALIGN_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "fusedalign")
    return Path(root) / "help"


def _cache_prefix(command: str, full: bool) -> str:
    """What names a cache entry: the command and the versions outside the fusedalign sources."""
    digest = hashlib.sha256(f"{command}:{full}:{sys.version_info[:2]}".encode())
    for dist in ("transformers", "fusedalign"):
        try:
            digest.update(f"{dist}={importlib.metadata.version(dist)}".encode())
        except importlib.metadata.PackageNotFoundError:
            digest.update(dist.encode())
    return f"{command}-{'all' if full else 'own'}-{digest.hexdigest()[:16]}"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def loaded_sources() -> dict[str, str]:
    """SHA-256 of each loaded fusedalign module's file, by path relative to the package."""
    sources = {}
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if not path:
            continue
        path = Path(path).resolve()
        if path.suffix == ".py" and path.is_relative_to(PACKAGE):
            sources[path.relative_to(PACKAGE).as_posix()] = _sha256(path)
    return dict(sorted(sources.items()))


def _unchanged(sources: dict[str, str]) -> bool:
    try:
        return bool(sources) and all(_sha256(PACKAGE / name) == digest for name, digest in sources.items())
    except OSError:  # a module removed or renamed since
        return False


def _cached(prefix: str) -> str | None:
    """The text of a cache entry whose sources all hash as they did when it was rendered."""
    for path in sorted(cache_dir().glob(f"{prefix}-*.txt")):
        try:
            header, _, text = path.read_text().partition("\n")
            sources = json.loads(header)
        except (OSError, ValueError):
            continue
        if isinstance(sources, dict) and _unchanged(sources):
            return text
    return None


def help_text(command: str, full: bool = False) -> str:
    """The help of a training command, from the cache when its sources are unchanged."""
    prefix = _cache_prefix(command, full)
    text = _cached(prefix)
    if text is not None:
        return text
    text = render_help(command, full)
    header = json.dumps(loaded_sources(), separators=(",", ":"))
    path = cache_dir() / f"{prefix}-{hashlib.sha256(header.encode()).hexdigest()[:16]}.txt"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(f"{header}\n{text}")
        os.replace(tmp, path)
    except OSError:
        pass  # no writable cache: rendered each time
    return text


def warm() -> None:
    """Renders every command's help into the cache (scripts/setup.sh runs it once)."""
    for command in TRAINING_COMMANDS:
        for full in (False, True):
            help_text(command, full)


if __name__ == "__main__":
    warm()
