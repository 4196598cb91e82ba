"""Optional speed-ups of the backbone (never of the head, which is always ours).

- Liger's RMSNorm, SwiGLU and RoPE kernels on CUDA (`--use_liger_kernel`). Liger's own
  loss kernels are never applied, since they would replace the head's forward.
- `torch.compile` of each decoder layer's forward (`--compile_layers`, or
  `--torch_compile`). Only the layer's `forward` is compiled, not its `__call__`: the
  hooks a backend attaches to the layer (FSDP2's unshard/reshard) run eagerly around
  the compiled code, and the head, outside every layer, stays the fused op. Generation
  runs the layers' eager forward (`eager_layers`): its KV cache, its shapes that change
  token by token and each layer's own cache index would each make dynamo compile the
  layers' shared code again, until torch's recompile limit leaves training's forwards
  eager too.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from typing import Any, Callable, Iterator

import torch
from torch import nn
from transformers.utils import logging

from fusedalign.head import unwrap_model

logger = logging.get_logger(__name__)


def liger_available() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("liger_kernel") is not None


def apply_liger_kernels(model: nn.Module) -> bool:
    """Swaps the model's RMSNorm, SwiGLU MLP and RoPE for Liger's kernels, in place.

    Returns:
        Whether they were applied (False without liger-kernel or without CUDA).
    """
    if not liger_available():
        logger.info("Liger kernels not applied: they need liger-kernel installed and a CUDA device.")
        return False
    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    _apply_liger_kernel_to_instance(
        model=unwrap_model(model), rms_norm=True, swiglu=True, rope=True,
        cross_entropy=False, fused_linear_cross_entropy=False,
    )
    return True


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's decoder layers (transformers' `GradientCheckpointingLayer`s), in order."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in unwrap_model(model).modules() if isinstance(m, GradientCheckpointingLayer)]


# The recompute policies of `compile_decoder_layers`, as torch._functorch partitioner
# settings. "elementwise": torch's min-cut partitioner may recompute any element-wise op
# (norms, SiLU * up, RoPE, casts, residual adds) in the backward instead of saving its
# output, even far from its use or in long chains; matmuls and attention are never
# recomputed (they are not recomputable ops for it), so no FLOP is added. "default":
# torch's own runtime-first choice.
RECOMPUTE_POLICIES: dict[str, dict[str, bool]] = {
    "elementwise": {
        "ban_recompute_used_far_apart": False,
        "ban_recompute_long_fusible_chains": False,
        "ban_recompute_materialized_backward": False,
    },
    "default": {},
}


def _partitioner_settings(policy: str) -> dict[str, bool]:
    import torch._functorch.config as functorch_config

    wanted = RECOMPUTE_POLICIES[policy]
    settings = {k: v for k, v in wanted.items() if hasattr(functorch_config, k)}
    if len(settings) != len(wanted):
        logger.warning(
            "compile_recompute=%r: this torch (%s) lacks partitioner settings %s; they are not applied.",
            policy, torch.__version__, sorted(set(wanted) - set(settings)),
        )
    return settings


@functools.lru_cache(maxsize=None)
def _backend_with(backend: str, policy: str) -> Callable:
    """`backend` whose compilations (first call, recompiles) see the policy's partitioner settings.

    One object per (backend, policy): dynamo keeps compiled code per backend object, so
    every layer shares one graph, and two policies in one process never share a graph.
    """
    import torch._functorch.config as functorch_config

    settings = _partitioner_settings(policy)
    inner = torch._dynamo.lookup_backend(backend)

    def with_settings(graph: Any, example_inputs: Any) -> Any:
        with functorch_config.patch(settings):
            return inner(graph, example_inputs)

    return with_settings


COMPILE_UNDER_ZERO3 = (
    "compile_layers (--compile_layers / --torch_compile) is not supported under DeepSpeed ZeRO-3: its "
    "parameter hooks sit on every Linear inside a decoder layer, where compiled code would run them. "
    "Use it on one device, DDP, ZeRO-2 or FSDP2; under ZeRO-3 use gradient checkpointing instead."
)


def compile_decoder_layers(
    model: nn.Module,
    *,
    zero3: bool = False,
    recompute: str = "elementwise",
    backend: str = "inductor",
    mode: str | None = None,
) -> int:
    """Replaces each decoder layer's `forward` by its `torch.compile`d version, in place.

    Every layer of a model runs the same code, so dynamo compiles it once per input
    shape signature (and once more for no-grad forwards, such as the reference's).

    Args:
        model: The model (under PEFT or other wrappers is fine).
        zero3: Whether DeepSpeed ZeRO-3 is on (refused, see Raises).
        recompute: "elementwise" (default; saves only what matmuls and attention need,
            recomputing element-wise ops in the backward) or "default" (torch's choice).
        backend, mode: passed to `torch.compile`.

    Returns:
        How many layers were compiled.

    Raises:
        ValueError: under DeepSpeed ZeRO-3, whose per-module parameter hooks would have
            to run inside the compiled code; when no decoder layer is found; or for an
            unknown `recompute`.
    """
    if zero3:
        raise ValueError(COMPILE_UNDER_ZERO3)
    if recompute not in RECOMPUTE_POLICIES:
        raise ValueError(f"compile_recompute must be one of {sorted(RECOMPUTE_POLICIES)}, got {recompute!r}.")
    if recompute != "default" and mode is not None:
        raise ValueError(
            f"torch_compile_mode={mode!r} needs compile_recompute='default' (a mode brings its own inductor "
            "options); or leave the mode unset."
        )
    layers = decoder_layers(model)
    if not layers:
        raise ValueError(
            f"compile_layers: found no decoder layer (transformers GradientCheckpointingLayer) in "
            f"{type(unwrap_model(model)).__name__}; turn compile_layers off for this model."
        )
    for layer in layers:
        if not getattr(layer, "_fusedalign_compiled", False):
            eager = layer.forward
            if recompute == "default":
                compiled = torch.compile(eager, backend=backend, mode=mode)
            else:
                compiled = torch.compile(eager, backend=_backend_with(backend, recompute))
            layer.forward = compiled
            layer._fusedalign_forwards = (eager, compiled)
            layer._fusedalign_compiled = True
    return len(layers)


@contextlib.contextmanager
def eager_layers(model: nn.Module) -> Iterator[int]:
    """Inside the block, every decoder layer that `compile_decoder_layers` compiled runs its
    eager forward; the compiled one is put back on exit (also when the block raises).

    For generation: dynamo guards the layers' shared code on the KV cache's state and sizes,
    the query's length and each layer's `layer_idx`, so a rollout through the compiled
    forward would compile it again for prefill, for each decoding shape and for each layer,
    and once torch's recompile limit (8) is reached, every later call without a matching
    graph, training's included, runs eager. Generation has its own compiled path
    (StaticDecode's `compile_step`), which traces the eager forward.

    Yields:
        How many layers run eagerly in the block.
    """
    swapped = [(m, m._fusedalign_forwards) for m in unwrap_model(model).modules()
               if getattr(m, "_fusedalign_forwards", None) is not None]
    for layer, (eager, _) in swapped:
        layer.forward = eager
    try:
        yield len(swapped)
    finally:
        for layer, (_, compiled) in swapped:
            layer.forward = compiled
