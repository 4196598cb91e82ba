"""`fusedalign verify`'s own flags, and the runs they ask for, grouped into launches.

    fusedalign verify TRAINER [the trainer's flags] [--backends ddp zero2 zero3 fsdp2 | --config_file A.yaml ...]
                      [--num_processes N] [--verify_steps K] [--verify_learning_rate LR] [--keep_outputs]

Every flag verify does not know goes to the trainer, parsed as `fusedalign TRAINER` parses
it. The runs, each K optimizer steps over the same global batches in the same order:
- `oracle`: one process, unfused, float32 (the reference);
- `1 process fused`: one process, fused head, the user's dtype;
- per backend: N processes, fused and unfused, the user's dtype.
One process sees the global batch of N processes in one micro-batch (per-device batch x N),
so a loss normalised per micro-batch shows as a difference.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fusedalign.cli.commands import GENERATING_COMMANDS, TRAINING_COMMANDS
from fusedalign.errors import CLIError
from fusedalign.launch import REPO_CPU_CONFIGS

BACKENDS = ("ddp", "zero2", "zero3", "fsdp2")
TRAINERS = ", ".join(TRAINING_COMMANDS)

USAGE = ("usage: fusedalign verify TRAINER [the trainer's flags] [--backends ddp zero2 zero3 fsdp2 | "
         "--config_file ACCELERATE.yaml ...] [--num_processes N]\n       fusedalign verify --self_test")
HELP = f"""{USAGE}

Trains a few steps of TRAINER ({TRAINERS})
with your flags, model and data, and compares with a one-process, unfused, float32 oracle
over the same global batches: one process fused, then N processes fused and unfused under
each backend, launched with `accelerate launch` and the backend's config. Prints, per run,
the largest relative difference from the oracle in per-step loss, gradient norm, logged
metrics and final weights, and a verdict; exits 0 when every run agrees, 1 when one
disagrees or crashes. Your flags, models, reward functions and data are checked first, in
this process, as `fusedalign launch` checks them: bad input is one line and exit 2, before
any run starts. Nothing is written outside a temporary directory, removed at the end.
  --backends NAME ...         our configs (configs/accelerate/, or its cpu/ twins without a GPU)
  --config_file FILE ...      your accelerate configs
  --num_processes N           processes per launch (default: each config's num_processes)
  --verify_steps K            optimizer steps per run (default 3)
  --verify_learning_rate LR   SGD learning rate of every run (default 0.1)
  --keep_outputs              keep the runs' directory (its path is printed)
  --self_test                 inject known bugs and show that each is caught"""
DEFAULT_STEPS = 3
# SGD: an update is lr x gradient, large enough in 3 steps to show a wrong gradient in the
# weights, small enough (with the gradient clipped at max_grad_norm) not to diverge.
DEFAULT_LEARNING_RATE = 0.1

# What a run under test must really be (accelerate falls back to DDP silently in some set-ups).
DISTRIBUTED_TYPES = {"DEEPSPEED": "DistributedType.DEEPSPEED", "FSDP": "DistributedType.FSDP"}


@dataclass
class VerifyOptions:
    trainer: str
    argv: list[str]  # the trainer's flags
    configs: list[tuple[str, str]] = field(default_factory=list)  # (label, accelerate config path)
    num_processes: int | None = None
    steps: int = DEFAULT_STEPS
    learning_rate: float = DEFAULT_LEARNING_RATE
    keep_outputs: bool = False


@dataclass
class Launch:
    """One process (config None) or one `accelerate launch`, running `runs` one after another."""

    label: str
    config: str | None
    num_processes: int
    runs: list[dict[str, Any]] = field(default_factory=list)
    launch_args: list[str] = field(default_factory=list)  # more `accelerate launch` options


def _values(argv: list[str], i: int) -> list[str]:
    out = []
    for token in argv[i + 1:]:
        if token.startswith("--"):
            break
        out.append(token)
    return out


def _number(flag: str, text: str, kind: type) -> Any:
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None or value <= 0:
        raise CLIError(f"{flag} {text}: expected a positive {kind.__name__}.")
    return value


def parse_options(argv: list[str]) -> VerifyOptions:
    """Splits verify's own flags from the trainer's; one-line errors for bad input."""
    if not argv or argv[0].startswith("-"):
        raise CLIError(f"expected a trainer first: fusedalign verify {{{','.join(TRAINING_COMMANDS)}}} [flags]")
    if argv[0] not in TRAINING_COMMANDS:
        raise CLIError(f"unknown trainer {argv[0]!r}; expected one of {TRAINERS}.")
    options = VerifyOptions(trainer=argv[0], argv=[])
    rest, i = argv[1:], 0
    while i < len(rest):
        name, _, inline = rest[i].partition("=")
        values = [inline] if inline else _values(rest, i)
        taken = 1 + (0 if inline else len(values))
        if name == "--backends":
            options.configs += [(b, backend_config(b)) for b in _need(name, values)]
        elif name == "--config_file":
            options.configs += [(Path(p).stem, checked_config(p)) for p in _need(name, values)]
        elif name in ("--num_processes", "--verify_steps", "--verify_learning_rate"):
            if len(values) != 1:
                raise CLIError(f"{name} takes one value.")
            taken = 1 + (0 if inline else 1)
            if name == "--num_processes":
                options.num_processes = _number(name, values[0], int)
            elif name == "--verify_steps":
                options.steps = _number(name, values[0], int)
            else:
                options.learning_rate = _number(name, values[0], float)
        elif name == "--keep_outputs":
            options.keep_outputs, taken = True, 1
        else:
            options.argv.append(rest[i])
            taken = 1
        i += taken
    return options


def _need(flag: str, values: list[str]) -> list[str]:
    if not values:
        raise CLIError(f"{flag} needs at least one value.")
    return values


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def backend_config(name: str) -> str:
    """Our accelerate config of a backend: the GPU one with GPUs, the CPU twin without."""
    if name not in BACKENDS:
        raise CLIError(f"--backends {name}: unknown backend; expected some of {', '.join(BACKENDS)} "
                       "(or --config_file YOUR.yaml).")
    path = (REPO_CPU_CONFIGS.parent if _cuda() else REPO_CPU_CONFIGS) / f"{name}.yaml"
    if not path.is_file():
        raise CLIError(f"--backends {name}: no accelerate config at {path} (an installed package has no "
                       "configs/ folder); give yours with --config_file.")
    return str(path)


def read_config(path: str) -> dict[str, Any]:
    import yaml

    with open(path) as f:
        data = yaml.safe_load(f)
    return data if isinstance(data, dict) else {}


def checked_config(path: str) -> str:
    """An accelerate config that this machine can run, else a one-line error naming the way out."""
    import yaml

    from fusedalign.launch import cpu_config_for

    if not os.path.isfile(path):
        raise CLIError(f"--config_file {path}: no such file.")
    try:
        config = read_config(path)
    except yaml.YAMLError:
        raise CLIError(f"--config_file {path}: not valid YAML.") from None
    if "distributed_type" not in config:
        raise CLIError(f"--config_file {path}: not an accelerate config (no distributed_type).")
    if int(config.get("num_machines") or 1) > 1:
        raise CLIError(f"--config_file {path}: {config['num_machines']} machines; verify launches on this machine "
                       "only: check one node's config (set num_machines: 1).")
    if not config.get("use_cpu") and not _cuda():
        twin = cpu_config_for(path)
        raise CLIError(f"--config_file {path} is a GPU config and this machine has no CUDA GPU; "
                       + (f"use {twin}." if twin else "use a config with use_cpu: true."))
    return os.path.abspath(path)


def _world(options: VerifyOptions) -> int:
    sizes = {options.num_processes or int(read_config(path).get("num_processes") or 1) for _, path in options.configs}
    if len(sizes) > 1:
        raise CLIError(f"the configs ask for different numbers of processes ({sorted(sizes)}); "
                       "give --num_processes N, or verify them one at a time.")
    return sizes.pop() if sizes else (options.num_processes or 1)


def trainer_args(options: VerifyOptions) -> tuple:
    """The user's flags parsed as `fusedalign TRAINER` parses them (a bad flag: one-line error)."""
    from fusedalign.cli.help import dataclass_types
    from fusedalign.cli.parsing import parse

    return parse(options.trainer, dataclass_types(options.trainer), options.argv, announce=False)


def overrides(options: VerifyOptions, args: Any, model_args: Any) -> list[str]:
    """Flags every run adds after the user's: K steps of SGD, data in order, nothing saved or evaluated."""
    out = ["--max_steps", str(options.steps), "--learning_rate", str(options.learning_rate), "--optim", "sgd",
           "--lr_scheduler_type", "constant", "--warmup_steps", "0", "--weight_decay", "0", "--logging_steps", "1",
           "--save_strategy", "no", "--eval_strategy", "no", "--report_to", "none",
           "--train_sampling_strategy", "sequential", "--disable_dropout", "true",
           "--load_best_model_at_end", "false", "--push_to_hub", "false"]
    if model_args.use_peft:
        out += ["--lora_dropout", "0"]
    if options.trainer in GENERATING_COMMANDS:
        out += ["--shuffle_dataset", "false"]
        if args.replay_completions is None:  # the same completions in every run, however the batch is split
            out += ["--keyed_sampling", "true"]
    return out


def plan(options: VerifyOptions, prefix: str = "") -> list[Launch]:
    """The launches of one verification: one process (oracle, fused), then one per config."""
    _, args, model_args, _ = trainer_args(options)
    world = _world(options)
    batch, accumulation = args.per_device_train_batch_size, args.gradient_accumulation_steps
    base = {"trainer": options.trainer, "argv": options.argv, "rows": batch * world * accumulation * options.steps}
    common = overrides(options, args, model_args)
    whole_batch = ["--per_device_train_batch_size", str(batch * world)]
    oracle = f"{prefix}oracle"
    launches = [Launch("1 process", None, 1, [
        {**base, "name": oracle, "label": "oracle: 1 process, unfused, float32", "save_initial": True,
         "overrides": [*common, *whole_batch, "--fused_head", "false", "--dtype", "float32", "--bf16", "false",
                       "--fp16", "false"]},
        {**base, "name": f"{prefix}single_fused", "label": "1 process, fused", "oracle": oracle, "world": 1,
         "overrides": [*common, *whole_batch, "--fused_head", "true"]},
    ])]
    for label, path in options.configs:
        config = read_config(path)
        runs = [{**base, "name": f"{prefix}{label}_{kind}", "label": f"{label}, {world} processes, {kind}",
                 "oracle": oracle, "world": world,
                 "distributed_type": DISTRIBUTED_TYPES.get(config["distributed_type"]),
                 "overrides": [*common, "--fused_head", str(kind == "fused").lower()]}
                for kind in ("fused", "unfused")]
        launches.append(Launch(label, path, world, runs))
    return launches


def check_inputs(launches: list[Launch]) -> None:
    """The oracle's flags, models, reward functions and data, checked in this process as
    `fusedalign launch` checks them (`cli.precheck`): bad input is then one line and exit 2,
    not a crashed oracle and exit 1, which would read as a disagreement."""
    from fusedalign.cli.help import dataclass_types
    from fusedalign.cli.parsing import parse
    from fusedalign.cli.precheck import check_inputs as check

    oracle = launches[0].runs[0]
    command, argv = oracle["trainer"], [*oracle["argv"], *oracle["overrides"]]  # as the worker parses them
    script, args, model_args, _ = parse(command, dataclass_types(command), argv, announce=False)
    check(command, script, args, model_args)


def merged(plans: list[list[Launch]]) -> list[Launch]:
    """Launches of several verifications joined by config, so each config is launched once."""
    out: dict[tuple[str | None, int], Launch] = {}
    for launches in plans:
        for launch in launches:
            key = (launch.config, launch.num_processes)
            if key not in out:
                out[key] = Launch(launch.label, launch.config, launch.num_processes, [], launch.launch_args)
            out[key].runs += launch.runs
    return list(out.values())
