"""What a run's input can be checked for in one process, before any weights load.

`fusedalign launch` runs these before it starts any process, `fusedalign verify` before its
first launch, and a training command after parsing, before the student loads: a mistake is
then one line and exit 2, not a failure found by every rank after the model loaded (a
missing teacher path was found only after the student's and the reference's weights, a
GPU config on a CPU machine only inside the ranks, 10-14 s later on the tiny models).

Only cheap checks, each the one the run itself makes later, by the same function:
- model names (the policy, the reference, the teacher, reward models): `resolve_model_path`,
  which knows `builtin:` names and local paths and takes any other `org/name` for a hub id;
- `--reward_funcs` built-in names and dotted paths: imported by `load_reward_function`, as
  the run imports them (a reward model among them: its path only);
- a local teacher against a local student: the tokenizers and the head sizes of config.json
  (`check_same_vocabulary`), no weights;
- the data, row by row (`load_splits`), and the adapter's flags (`peft_config_from`);
- `fusedalign launch`'s accelerate config against this machine (a GPU config without a GPU).
"""

from __future__ import annotations

import os
import shlex
from types import SimpleNamespace
from typing import Any

from fusedalign.errors import CLIError


def model_path(flag: str, name: str) -> str:
    """`resolve_model_path(name)`, its error naming the flag that gave the name."""
    from fusedalign.models import ModelNotFoundError, resolve_model_path

    try:
        return resolve_model_path(name)
    except ModelNotFoundError as err:
        raise CLIError(f"{flag}: {err}") from None


def _is_reward_model(name: str) -> bool:
    """A `--reward_funcs` name `load_reward_function` loads as a reward model (not a function)."""
    return os.path.isdir(os.path.expanduser(name)) or name.startswith("builtin:") or "/" in name


def check_rewards(args: Any) -> None:
    """The reward model's path and each `--reward_funcs` name: a path exists, a function imports."""
    from fusedalign.rewards.loading import load_reward_function

    if getattr(args, "reward_model_name_or_path", None):
        model_path("--reward_model_name_or_path", args.reward_model_name_or_path)
    for name in getattr(args, "reward_funcs", None) or ():
        if _is_reward_model(name):
            model_path("--reward_funcs", name)
        else:
            load_reward_function(name)  # a built-in name or a dotted path, imported as the run imports it


def check_teacher(args: Any, model_args: Any) -> None:
    """The teacher's path and, when both models are local, that it shares the student's tokenizer."""
    from fusedalign.models import load_tokenizer
    from fusedalign.trainers.teacher import _tokenizer_at, check_same_vocabulary

    if not hasattr(args, "teacher_model_name_or_path"):
        return
    if args.teacher_model_name_or_path is None:
        raise CLIError("distillation needs a teacher: --teacher_model_name_or_path (builtin:<name>, a local path "
                       "or a hub id).")
    teacher = model_path("--teacher_model_name_or_path", args.teacher_model_name_or_path)
    if model_args.model_name_or_path is None:
        return
    student = model_path("--model_name_or_path", model_args.model_name_or_path)
    on_hub = args.teacher_model_revision is not None or model_args.model_revision != "main"
    if on_hub or not (os.path.isdir(teacher) and os.path.isdir(student)):
        return  # a hub model is compared when it loads
    from transformers import AutoConfig

    try:
        configs = [AutoConfig.from_pretrained(path) for path in (student, teacher)]
        tokenizer = load_tokenizer(student)
    except (OSError, ValueError):
        return  # not loadable as it stands: the run's own load says why
    # check_same_vocabulary reads the head sizes from each model's config: the config alone does.
    check_same_vocabulary(SimpleNamespace(config=configs[0]), tokenizer, SimpleNamespace(config=configs[1]),
                          _tokenizer_at(teacher), args.beta, args.teacher_model_name_or_path)


def check_models(args: Any, model_args: Any) -> None:
    """Every model and reward function the flags name, without loading any weights."""
    if model_args.model_name_or_path is not None:
        model_path("--model_name_or_path", model_args.model_name_or_path)
    if getattr(args, "ref_model_name_or_path", None):
        model_path("--ref_model_name_or_path", args.ref_model_name_or_path)
    check_teacher(args, model_args)
    check_rewards(args)


def check_inputs(command: str, script: Any, args: Any, model_args: Any) -> None:
    """Models, rewards, the adapter's flags and the data of parsed flags (what verify checks too)."""
    from fusedalign.cli.training import load_splits, peft_config_from

    check_models(args, model_args)
    peft_config_from(model_args)
    load_splits(command, script, args)


def check_run(command: str, argv: list[str]) -> str | None:
    """Everything a run checks before training that one process can check: flags, output dir, the
    checkpoint it resumes from, models, data.

    Returns:
        The line that says the run is already complete (a finished run resumed with flags that ask for
        no more steps: nothing is to be started), else None.
    """
    from fusedalign.cli.help import dataclass_types
    from fusedalign.cli.output_dir import check_output_dir, check_resume, resolve_resume
    from fusedalign.cli.parsing import parse

    script, args, model_args, run_args = parse(command, dataclass_types(command), argv, announce=False)
    resume = resolve_resume(args.resume_from_checkpoint, args.output_dir)
    check_output_dir(args.output_dir, resume=resume, overwrite=run_args.overwrite_output_dir)
    if resume is not None:
        complete = check_resume(resume, args)
        if complete is not None:
            return complete
    check_inputs(command, script, args, model_args)
    return None


def _without(launch_args: list[str], names: tuple[str, ...]) -> list[str]:
    """`launch_args` less the options `names`, with their values."""
    out, skip = [], False
    for token in launch_args:
        if skip:
            skip = False
            continue
        name, eq, _ = token.partition("=")
        if name in names:
            skip = not eq
            continue
        out.append(token)
    return out


def check_launch_config(launch_args: list[str], command: str, cuda_available: bool | None = None) -> None:
    """Refuses `fusedalign launch` options whose accelerate config this machine cannot run.

    Args:
        launch_args: the `accelerate launch` options given to `fusedalign launch`.
        command: the training command, for the command line the message suggests.
        cuda_available: whether a CUDA GPU is usable (default: asked of torch).

    Raises:
        CLIError: a config file that does not exist, or a GPU config (use_cpu: false) on a
            machine without a GPU; the message gives the `fusedalign launch` line to use.
    """
    import yaml

    from fusedalign.launch import accelerate_options, cpu_config_for

    options = accelerate_options(["accelerate", "launch", *launch_args, "-m", "fusedalign"])
    config_file = (options or {}).get("config_file")
    if not config_file:
        return  # accelerate's default config, or options accelerate itself refuses
    if not os.path.isfile(config_file):
        raise CLIError(f"--config_file {config_file}: no such file.")
    try:
        with open(config_file) as f:
            config = yaml.safe_load(f)
    except yaml.YAMLError:
        raise CLIError(f"--config_file {config_file}: not valid YAML.") from None
    if not isinstance(config, dict) or config.get("use_cpu") or options["cpu"]:
        return
    if cuda_available is None:
        import torch

        cuda_available = torch.cuda.is_available()
    if cuda_available:
        return
    twin = cpu_config_for(config_file)
    if twin is None:
        raise CLIError(f"--config_file {config_file} is a GPU config (use_cpu: false) and this machine has no CUDA "
                       "GPU; use a config with use_cpu: true and mixed_precision: 'no' (as configs/accelerate/cpu/).")
    rest = _without(launch_args, ("--config_file", "--mixed_precision"))
    right = shlex.join(["fusedalign", "launch", "--config_file", twin, *rest, command])
    raise CLIError(f"--config_file {config_file} is a GPU config (use_cpu: false, mixed_precision: "
                   f"{config.get('mixed_precision')}) and this machine has no CUDA GPU; use {twin}: {right} ...")
