"""Checks that an `accelerate launch` starts the run its config file describes.

What a process started by `accelerate launch` can see (accelerate 1.16,
`commands/launch.py` and `utils/launch.py`): `ACCELERATE_*` variables (mixed
precision, `ACCELERATE_USE_CPU`, `ACCELERATE_USE_DEEPSPEED`/`_FSDP`), and `WORLD_SIZE`
when torchrun started it. The config file path is not passed on; it is read from the
launcher's own command line (the launcher is the parent process, both for the plain
subprocess launcher and for torchrun's agent, which runs inside it).

Two launches that do something else than the user meant are refused before any model
loads:
- `--cpu` (what our configs' comments once advised for CPU machines): accelerate then
  ignores the config's distributed type and starts one plain process, so a "DeepSpeed"
  or "FSDP2" run trains as a single process and exits 0;
- a GPU config (`use_cpu: false`) on a machine without a GPU, which would fail later on
  bf16 with no word about the CPU configs in `configs/accelerate/cpu/`.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Any, Mapping, Sequence

from fusedalign.errors import LaunchError

# In a source checkout: the CPU configs next to the package.
REPO_CPU_CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "accelerate" / "cpu"


def parent_argv() -> list[str]:
    """The command line of this process's parent, or [] when it cannot be read."""
    try:
        import psutil

        return psutil.Process(os.getppid()).cmdline()
    except Exception:  # no psutil, no permission, or the parent already gone
        return []


def _parent_cwd() -> str:
    try:
        import psutil

        return psutil.Process(os.getppid()).cwd()
    except Exception:
        return os.getcwd()


def accelerate_options(argv: Sequence[str]) -> dict[str, Any] | None:
    """`accelerate launch`'s own options, parsed by accelerate's parser; None if argv is not a launch.

    Returns:
        {"config_file", "cpu", "num_processes" (None unless given), "launch_args" (the
        tokens between `launch` and the training script or module)}.
    """
    tokens = list(argv)
    start = None
    for i, token in enumerate(tokens):
        if token == "accelerate.commands.launch" or os.path.basename(token) == "accelerate-launch":
            start = i + 1
        elif os.path.basename(token) == "accelerate" and i + 1 < len(tokens) and tokens[i + 1] == "launch":
            start = i + 2
        if start is not None:
            break
    if start is None:
        return None
    from accelerate.commands.launch import launch_command_parser

    try:
        args, _ = launch_command_parser().parse_known_args(tokens[start:])
    except SystemExit:
        return None
    end = tokens.index(args.training_script, start) if args.training_script in tokens[start:] else len(tokens)
    if args.module and end > start and tokens[end - 1] in ("-m", "--module"):
        end -= 1
    return {"config_file": args.config_file, "cpu": bool(args.cpu), "num_processes": args.num_processes,
            "launch_args": tokens[start:end]}


def cpu_config_for(config_file: str) -> str | None:
    """The CPU twin of one of our GPU configs (configs/accelerate/X.yaml -> configs/accelerate/cpu/X.yaml)."""
    path = Path(config_file)
    twin = path.parent / "cpu" / path.name
    return str(twin) if twin.is_file() else None


def _command_with(options: dict[str, Any], config: str) -> str:
    """The launch command with `config` as its config file and no --cpu / --mixed_precision override."""
    args, skip = [], False
    for token in options["launch_args"]:
        if skip:
            skip = False
            continue
        name = token.split("=", 1)[0]
        if name in ("--cpu", "--mixed_precision", "--config_file"):
            skip = "=" not in token and name != "--cpu"
            continue
        args.append(token)
    return shlex.join(["accelerate", "launch", "--config_file", config, *args]) + " -m fusedalign ..."


def check_launch(env: Mapping[str, str] | None = None, argv: Sequence[str] | None = None,
                 cuda_available: bool | None = None) -> None:
    """Refuses an `accelerate launch` that would not run what its config file asks for.

    Args:
        env: the process environment (default: os.environ).
        argv: the launcher's command line (default: the parent process's).
        cuda_available: whether a CUDA GPU is usable (default: asked of torch).

    Raises:
        LaunchError: fewer processes than the config asks for (e.g. `--cpu`), or a GPU
            config on a machine without a GPU; the message names the command to use.
    """
    env = os.environ if env is None else env
    options = accelerate_options(parent_argv() if argv is None else argv)
    if options is None:
        return
    config_file = options.get("config_file")
    if not config_file:
        return  # accelerate's default config or flags only: nothing to compare with
    config_path = config_file if os.path.isabs(config_file) else os.path.join(_parent_cwd(), config_file)
    config = _read_config(config_path)
    if config is None:
        return
    asked = int(options["num_processes"] or config.get("num_processes") or 1)
    started = int(env.get("WORLD_SIZE", "1"))
    kind = config.get("distributed_type", "?")
    twin = cpu_config_for(config_path) if not config.get("use_cpu") else None
    if kind == "MULTI_CPU" and (REPO_CPU_CONFIGS / "ddp.yaml").is_file():
        twin = str(REPO_CPU_CONFIGS / "ddp.yaml")  # MULTI_CPU starts one process; DDP on CPU is MULTI_GPU + use_cpu
    right = _command_with(options, os.path.relpath(twin) if twin else config_file)
    if options.get("cpu") and asked > 1:
        raise LaunchError(
            f"accelerate launch --cpu started {started} plain process, but {config_file} asks for {asked} "
            f"({kind}): --cpu makes accelerate ignore the config's distributed type, so nothing would be "
            f"distributed. Without GPUs use a CPU config instead: {right}"
        )
    if started < asked and options["num_processes"] is None:
        raise LaunchError(f"accelerate launch started {started} process(es) but {config_file} asks for {asked} "
                          f"({kind}); launch it as: {right}")
    if not config.get("use_cpu") and not options.get("cpu") and not _cuda(cuda_available):
        where = f"use {os.path.relpath(twin)}" if twin else "use a config with use_cpu: true and mixed_precision: 'no'"
        raise LaunchError(
            f"{config_file} is a GPU config (use_cpu: false, mixed_precision: {config.get('mixed_precision')}) "
            f"and this machine has no CUDA GPU; {where}: {right}"
        )


def _cuda(known: bool | None) -> bool:
    if known is not None:
        return known
    import torch

    return torch.cuda.is_available()


def _read_config(path: str) -> dict[str, Any] | None:
    import yaml

    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except (OSError, yaml.YAMLError):
        return None
    return data if isinstance(data, dict) else None


def launcher_prefix() -> list[str] | None:
    """The launch command of this process up to its module (`accelerate launch ... -m fusedalign`), if launched."""
    options = accelerate_options(parent_argv())
    if options is None:
        return None
    if os.environ.get("FUSEDALIGN_LAUNCHED"):  # started by `fusedalign launch`: say it the same way
        return ["fusedalign", "launch", *options["launch_args"]]
    return ["accelerate", "launch", *options["launch_args"], "-m", "fusedalign"]
