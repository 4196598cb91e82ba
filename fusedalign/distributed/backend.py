"""Which distributed backend is running, and the process set-up each one needs."""

from __future__ import annotations

import enum
import os
from typing import Any

import torch
from torch import nn


class DistributedBackend(str, enum.Enum):
    """The training backend a process runs under (what `accelerate launch` asked for)."""

    SINGLE = "single"
    DDP = "ddp"
    ZERO2 = "zero2"  # also stages 0 and 1: parameters are whole on every rank
    ZERO3 = "zero3"
    FSDP2 = "fsdp2"
    FSDP1 = "fsdp1"


def _env_true(name: str) -> bool:
    return os.environ.get(name, "false").lower() in ("1", "true", "yes")


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def backend_from_env() -> DistributedBackend:
    """The backend `accelerate launch` asked for, read from its environment."""
    if _env_true("ACCELERATE_USE_DEEPSPEED"):
        return DistributedBackend.ZERO3 if _deepspeed_stage_from_env() == 3 else DistributedBackend.ZERO2
    if _env_true("ACCELERATE_USE_FSDP"):
        return DistributedBackend.FSDP2 if os.environ.get("FSDP_VERSION", "1") == "2" else DistributedBackend.FSDP1
    return DistributedBackend.DDP if world_size_from_env() > 1 else DistributedBackend.SINGLE


def _deepspeed_stage_from_env() -> int:
    stage = os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE")
    if stage is not None:
        return int(stage)
    config_file = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    if config_file:
        import json

        with open(config_file) as f:
            return int(json.load(f).get("zero_optimization", {}).get("stage", 0))
    return 0


def use_cpu() -> bool:
    """Whether this process trains on the CPU (no accelerator present, or asked for)."""
    return _env_true("ACCELERATE_USE_CPU") or not torch.cuda.is_available()


def setup_distributed() -> DistributedBackend:
    """Prepares the process for its backend. Call before building arguments or models.

    DeepSpeed on CPU: `accelerate launch` starts the processes but nothing initialises
    DeepSpeed's communication layer with a CPU backend. Without it, DeepSpeed's config
    computes the world size as 1 (and asserts on the batch size) and `zero.Init`
    partitions nothing, so we initialise it over gloo here, before any model exists.
    """
    backend = backend_from_env()
    if backend is DistributedBackend.FSDP1:
        raise ValueError(
            "fusedalign supports FSDP version 2 (fully_shard); the accelerate config asks for FSDP "
            "version 1. Set `fsdp_version: 2` in its fsdp_config (see configs/accelerate/fsdp2.yaml)."
        )
    if _deepspeed_on_cpu(backend):
        # accelerate would take the CPU flag of the launch config and run plain DDP
        # (MULTI_CPU); without it, it keeps DeepSpeed and the device falls back to the
        # CPU because there is no GPU (see `configure_cpu_arguments`).
        os.environ["ACCELERATE_USE_CPU"] = "false"
        import deepspeed

        from fusedalign.distributed import extensions

        if not deepspeed.comm.is_initialized():
            with extensions.visible_build(is_main=os.environ.get("RANK", "0") == "0"):  # the first launch compiles
                deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    return backend


def _deepspeed_on_cpu(backend: DistributedBackend) -> bool:
    return (backend in (DistributedBackend.ZERO2, DistributedBackend.ZERO3) and not torch.cuda.is_available()
            and world_size_from_env() > 1)


def configure_cpu_arguments(args: Any) -> None:
    """Sets TrainingArguments' own fields so that each backend really runs without GPUs.

    accelerate, asked for the CPU, turns every multi-process run into plain DDP
    (MULTI_CPU), silently dropping DeepSpeed and FSDP. So:
    - DeepSpeed: not "cpu" but the gloo backend: accelerate then keeps DeepSpeed, and
      its device falls back to the CPU because no GPU exists (`setup_distributed` has
      cleared the launch's CPU flag for the same reason).
    - FSDP2 and DDP: "cpu" (gloo process group); FSDP is restored by
      `prepare_trainer_process`.
    Touches nothing but `args`.

    Raises:
        RuntimeError: DeepSpeed on CPU in a process that `setup_distributed` did not set up.
    """
    if torch.cuda.is_available():
        return
    if _deepspeed_on_cpu(backend_from_env()):
        if _env_true("ACCELERATE_USE_CPU"):
            raise RuntimeError(
                "DeepSpeed on CPU: call fusedalign.distributed.setup_distributed() at the start of the script, "
                "before building any config or model (it sets up DeepSpeed's gloo communication; the fusedalign "
                "command line does this itself)."
            )
        args.use_cpu = False
        args.ddp_backend = "gloo"
    else:
        args.use_cpu = True
    args.dataloader_pin_memory = False  # nothing to pin for: the DataLoader warns on every run otherwise


def prepare_trainer_process(args: Any) -> None:
    """Before a Trainer builds its Accelerator: make accelerate see FSDP2 on a CPU-only machine.

    accelerate enables FSDP only for GPU-like distributed types; on CPU the state says
    MULTI_CPU and the model would be wrapped in DDP instead, training without sharding
    while claiming FSDP. Marking the (shared) process state as multi-device makes the
    Accelerator pick FSDP; the device stays the CPU and the process group gloo.
    """
    if (args is None or torch.cuda.is_available() or backend_from_env() is not DistributedBackend.FSDP2
            or world_size_from_env() < 2):
        return
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    _ = args.device  # creates the process state
    state = PartialState()
    if state.distributed_type == DistributedType.MULTI_CPU:
        state.distributed_type = DistributedType.MULTI_GPU


def zero3_enabled() -> bool:
    """Whether DeepSpeed ZeRO-3 is on for the models built from now (the arguments exist)."""
    from transformers.integrations import is_deepspeed_zero3_enabled

    return is_deepspeed_zero3_enabled()


def gather_once_per_call(module: nn.Module) -> None:
    """Under DeepSpeed ZeRO-3: `module`'s parameters, its children's included, gathered once a call of
    `module` (and once for its backward), not at each call of a child. Nothing on other backends.

    ZeRO-3 gathers a module's parameters with a collective at every call of the module that holds
    them. A module that calls its children a number of times that differs by rank (a tiled MLP: one
    call a tile, the tiles following each rank's own tokens) would have the ranks wait on each
    other's gathers forever. DeepSpeed's leaf-module flag moves the gather to the module itself.
    Call it before the model is prepared for the backend: DeepSpeed registers its hooks then.
    """
    if zero3_enabled():
        from deepspeed.utils import set_z3_leaf_module

        set_z3_leaf_module(module, True)


def check_compile_layers_supported() -> None:
    """Refuses compiled decoder layers (`--compile_layers`) under a backend they cannot run on.

    Call it after the arguments exist (they say whether ZeRO-3 is on), before compiling.

    Raises:
        ValueError: under DeepSpeed ZeRO-3, naming the backends where the option runs.
    """
    if zero3_enabled():
        from fusedalign.backbone import COMPILE_UNDER_ZERO3

        raise ValueError(COMPILE_UNDER_ZERO3)


def check_compile_generation_supported() -> None:
    """Refuses generate's compiled decoding (`--compile_generation` with `--generation_backend
    generate`) where the weights move.

    Raises:
        ValueError: under ZeRO-3 or FSDP2 (read from the launch environment), with the way out.
    """
    backend = backend_from_env()
    if backend in (DistributedBackend.ZERO3, DistributedBackend.FSDP2):
        raise ValueError(
            f"--compile_generation with transformers' generate under {backend.value}: its compiled decoding "
            "captures the parameters' storage, which ZeRO-3 and FSDP2 gather anew for every generation, so the "
            "compiled graphs would read released memory. Use --generation_backend static (its compiled step "
            "takes the weights as inputs, valid on every backend), or leave --compile_generation off."
        )


def is_zero3(accelerator: Any) -> bool:
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    return plugin is not None and plugin.zero_stage == 3


def is_fsdp2(accelerator: Any) -> bool:
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    return plugin is not None and getattr(plugin, "fsdp_version", 1) == 2


def teardown_distributed() -> None:
    """Ends a multi-process run: all ranks meet, then each process exits at once.

    Letting the interpreter shut down normally with a gloo process group alive (or
    after destroying it) intermittently aborts the process on CPU ("terminate called
    without an active exception", SIGABRT) from a C++ thread destroyed at exit, turning
    a finished run into a failed one. Everything is written by now, so once every rank
    has reached this point the process leaves without running those destructors.
    """
    import sys

    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
