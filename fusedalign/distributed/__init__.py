"""The only package that knows which distributed backend is running.

Trainers ask it to set up the process before any model is built (`setup_distributed`),
to make a frozen reference model usable under the running backend
(`prepare_reference_model`), and to save one whole model at the end
(`prepare_final_save`). Everything else — the fused head included — works unchanged on
every backend because it runs inside ordinary module calls.
"""

from fusedalign.distributed.backend import (
    DistributedBackend,
    backend_from_env,
    check_compile_generation_supported,
    check_compile_layers_supported,
    configure_cpu_arguments,
    gather_once_per_call,
    is_fsdp2,
    is_zero3,
    prepare_trainer_process,
    setup_distributed,
    teardown_distributed,
    use_cpu,
    world_size_from_env,
    zero3_enabled,
)
from fusedalign.distributed.generation import generation_weights
from fusedalign.distributed.models import prepare_final_save, prepare_reference_model

__all__ = [
    "DistributedBackend", "backend_from_env", "check_compile_generation_supported", "check_compile_layers_supported",
    "configure_cpu_arguments", "gather_once_per_call",
    "is_fsdp2", "is_zero3",
    "prepare_final_save", "prepare_trainer_process", "prepare_reference_model", "setup_distributed", "teardown_distributed", "use_cpu",
    "world_size_from_env", "zero3_enabled",
    "generation_weights",
]
