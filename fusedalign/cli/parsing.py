"""Flags to dataclasses: `--config` YAML defaults, the demo's defaults, one-line errors.

argparse is used as HfArgumentParser builds it, with three changes a new user notices:
help strings are %-escaped (a literal `%`, as in `{% generation %}`, made argparse's
help formatting crash), an error is one line instead of the usage of ~700 flags
followed by the message, and an unknown flag gets the closest known ones as a hint.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import sys
from typing import Any

from fusedalign.cli.demo import banner, demo_defaults
from fusedalign.cli.trl_absent import drop_absent
from fusedalign.errors import CLIError

# A `%(name)s` placeholder is argparse's; any other `%` is text.
_PERCENT = re.compile(r"%\(\w+\)[a-z]|%")

# Help of TrainingArguments flags whose meaning the command line extends.
HELP_OVERRIDES = {
    "resume_from_checkpoint": "A checkpoint directory to continue from, or `last` (also `true`): the latest "
                              "complete checkpoint-N in --output_dir. metrics.jsonl keeps the records up to the "
                              "checkpoint's step and continues from there; what --output_dir holds past that step "
                              "(later checkpoints, records, the final model) is moved to "
                              "OUTPUT_DIR.previous-<date>-<time>.",
}

# TRL's name for the fused head switch; Trainer has its own field of that name.
FLAG_ALIASES = {"--use_liger_kernel": "--fused_head"}


def escape_help(text: str | None) -> str | None:
    """A help string safe for argparse's %-formatting: a lone `%` becomes `%%`."""
    if not isinstance(text, str) or text is argparse.SUPPRESS:
        return text
    return _PERCENT.sub(lambda m: m.group(0) if len(m.group(0)) > 1 else "%%", text)


def escape_percent(parser: argparse.ArgumentParser) -> None:
    """Makes every help string of a parser safe for argparse's %-formatting, whatever text it holds."""
    for action in parser._actions:
        action.help = escape_help(action.help)


def build_parser(command: str, dataclass_types: tuple) -> Any:
    """The HfArgumentParser of a command, with safe help strings and one-line errors."""
    from transformers import HfArgumentParser

    parser = HfArgumentParser(dataclass_types, prog=f"fusedalign {command}", usage=f"fusedalign {command} [flags]")
    for action in parser._actions:
        if action.dest in HELP_OVERRIDES and action.option_strings:
            action.help = HELP_OVERRIDES[action.dest]
    escape_percent(parser)

    def error(message: str) -> None:
        raise CLIError(f"{message} (`fusedalign {command} --help` lists the flags)")

    parser.error = error  # argparse would print the usage of every flag before the message
    return parser


def load_yaml(argv: list[str]) -> tuple[dict[str, Any], list[str]]:
    """Splits `--config FILE` off argv and returns the file's values."""
    import yaml

    if "--config" not in argv:
        return {}, argv
    i = argv.index("--config")
    if i + 1 >= len(argv):
        raise CLIError("--config needs a YAML file path.")
    path = argv[i + 1]
    if not os.path.isfile(path):
        raise CLIError(f"--config {path}: no such file.")
    with open(path) as f:
        try:
            values = yaml.safe_load(f) or {}
        except yaml.YAMLError as err:
            raise CLIError(f"--config {path}: not valid YAML ({one_line_yaml(err)}).") from None
    if not isinstance(values, dict):
        raise CLIError(f"--config {path}: expected a mapping of flag names to values, got {type(values).__name__}.")
    return values, argv[:i] + argv[i + 2 :]


def one_line_yaml(err: Exception) -> str:
    mark = getattr(err, "problem_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return where + str(getattr(err, "problem", None) or err).strip()


def _suggest(name: str, known: list[str]) -> str:
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
    return f"; did you mean {' or '.join(close)}?" if close else ""


def check_unknown(command: str, parser: Any, argv: list[str], config_keys: dict[str, Any]) -> None:
    """Refuses flags and `--config` keys no dataclass declares, naming the closest known ones."""
    known_dests = sorted({a.dest for a in parser._actions if a.option_strings})
    unknown_keys = sorted(set(config_keys) - set(known_dests))
    if unknown_keys:
        hints = "".join(_suggest(k, known_dests) for k in unknown_keys[:1])
        raise CLIError(f"--config: unknown keys {unknown_keys} for `fusedalign {command}`{hints}")
    _, rest = parser.parse_known_args(argv)
    # The underscore spelling of each flag (argparse also accepts --dashed-twins; suggest one of each).
    options = sorted(s for a in parser._actions for s in a.option_strings if s.startswith("--") and "-" not in s[2:])
    for token in rest:
        if token.startswith("-"):
            flag = token.split("=", 1)[0]
            hint = _suggest(flag, options) or f"; `fusedalign {command} --help-all` lists every flag"
            raise CLIError(f"unknown flag {flag} for `fusedalign {command}`{hint}")
    if rest:
        raise CLIError(f"unexpected argument {rest[0]!r} for `fusedalign {command}`: flags take the form --name value")


def _from_config(error: CLIError, config_values: dict[str, Any], on_line: dict[str, Any]) -> CLIError:
    """argparse's "argument --beta: invalid float value" about a value the --config file gave, said so."""
    found = re.match(r"argument --(\w+)[^:]*: (.*?)(?: \(`fusedalign \w+ --help` lists the flags\))?$", str(error))
    if not found or found.group(1) not in config_values or found.group(1) in on_line:
        return error
    return CLIError(f"--config key {found.group(1)}: {found.group(2)}.")


def given_flags(parser: Any, argv: list[str]) -> dict[str, Any]:
    """The destinations the command line sets, with their parsed values (defaults excluded)."""
    saved = [(action, action.default) for action in parser._actions]
    saved_defaults = dict(parser._defaults)
    try:
        for action in parser._actions:
            action.default = argparse.SUPPRESS
        parser._defaults.clear()
        namespace, _ = parser.parse_known_args(argv)
    finally:
        for action, default in saved:
            action.default = default
        parser._defaults.update(saved_defaults)
    return vars(namespace)


def _alias(token: str) -> str:
    name, eq, value = token.partition("=")
    return FLAG_ALIASES.get(name, name) + eq + value


def parse(command: str, dataclass_types: tuple, argv: list[str], *, announce: bool = True) -> tuple:
    """Parses flags (and `--config` YAML defaults) into the given dataclasses.

    Precedence, highest first: a flag on the command line, a `--config` value, the demo's
    value (only with no model named, only for what is not given), the dataclass default.
    """
    argv = [_alias(a) for a in argv]
    config_values, argv = load_yaml(argv)
    parser = build_parser(command, dataclass_types)
    argv = drop_absent(command, argv, config_values, {action.dest for action in parser._actions})
    check_unknown(command, parser, argv, config_values)
    on_line = given_flags(parser, argv)
    given = {**config_values, **on_line}
    filled = demo_defaults(command, given)
    parser.set_defaults(**{**filled, **config_values})
    try:
        outputs = parser.parse_args_into_dataclasses(args=argv)
    except CLIError as error:
        raise _from_config(error, config_values, on_line) from None
    if filled and announce and os.environ.get("RANK", "0") == "0":
        values = {k: v for out in outputs for k, v in vars(out).items()}
        print(banner(command, filled, values), file=sys.stderr)
    return outputs
