"""Whole weights for generation, once per generation, on every backend.

Generation runs the model's ordinary forward (the fused head is not installed) for every
decoded token. Under ZeRO-3 and FSDP2 each module call would gather its parameters and
free them again, so a 256-token completion would gather the whole model 256 times. Here the
weights are made whole once for the whole generation, and every backend's state is put back
on exit (also when generation raises), so that the next training forward runs as before:

- DDP, ZeRO-2, one process: the weights are whole; generate on the unwrapped model.
- ZeRO-3: every parameter gathered at once (`deepspeed.zero.GatheredParameters`), DeepSpeed's
  module hooks taken off for the generation (they would release parameters after each
  module) and registered again after, with the parameter coordinator's trace invalidated:
  a trace recorded before generation no longer matches the module order, and reusing it is
  TRL #4693's "pop from an empty deque".
- FSDP2: `reshard_after_forward` off on every FSDP module, so the prefill all-gathers each
  module once and the decoding steps reuse the unsharded weights; then every module is
  resharded and its previous setting restored.

Common: `torch.no_grad()`, eval mode (no dropout), gradient checkpointing off,
`use_cache=True` and compiled decoder layers eager (`backbone.eager_layers`: generation
would otherwise spend torch's recompile limit, leaving training's layers eager), each
restored exactly as it was.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import nn

from fusedalign.backbone import eager_layers
from fusedalign.distributed.backend import is_fsdp2, is_zero3


@contextlib.contextmanager
def generation_weights(model: nn.Module, accelerator: Any) -> Iterator[nn.Module]:
    """Yields the model to call `generate` on, with whole weights for the whole block.

    Args:
        model: the model as the backend prepared it (the Trainer's `model_wrapped`: a DDP
            module, a DeepSpeed engine, an FSDP2 module) or the unwrapped model.
        accelerator: the Trainer's accelerator.
    """
    unwrapped = accelerator.unwrap_model(model)
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.no_grad())
        stack.enter_context(_inference_mode_flags(unwrapped))
        stack.enter_context(eager_layers(unwrapped))
        if is_zero3(accelerator):
            stack.enter_context(_zero3_gathered(_deepspeed_engine(model, accelerator)))
        elif is_fsdp2(accelerator):
            stack.enter_context(_fsdp2_unsharded(unwrapped))
        yield unwrapped


@contextlib.contextmanager
def _inference_mode_flags(model: nn.Module) -> Iterator[None]:
    """Eval mode, no gradient checkpointing, use_cache=True; each module's own state restored after."""
    training = [(m, m.training) for m in model.modules()]
    checkpointing = [(m, m.gradient_checkpointing) for m in model.modules()
                     if isinstance(getattr(m, "gradient_checkpointing", None), bool)]
    config = getattr(model, "config", None)
    use_cache = getattr(config, "use_cache", None)
    model.eval()
    for m, _ in checkpointing:
        m.gradient_checkpointing = False
    if config is not None:
        config.use_cache = True
    try:
        yield
    finally:
        for m, flag in training:
            m.training = flag
        for m, flag in checkpointing:
            m.gradient_checkpointing = flag
        if config is not None:
            config.use_cache = use_cache


def _deepspeed_engine(model: nn.Module, accelerator: Any) -> nn.Module:
    from deepspeed import DeepSpeedEngine

    if isinstance(model, DeepSpeedEngine):
        return model
    for candidate in getattr(accelerator, "_models", []):
        if isinstance(candidate, DeepSpeedEngine) and candidate.module is model:
            return candidate
    raise ValueError("generation_weights under ZeRO-3 needs the DeepSpeed engine (the Trainer's model_wrapped) or a "
                     "model the accelerator prepared; got an unprepared module")


def _parameter_offload(engine: nn.Module) -> Any | None:
    """The object that owns ZeRO-3's module hooks (None before an optimizer exists)."""
    optimizer = getattr(engine, "optimizer", None)
    if optimizer is None:
        return None
    return getattr(optimizer, "parameter_offload", optimizer)


@contextlib.contextmanager
def _zero3_gathered(engine: nn.Module) -> Iterator[None]:
    import deepspeed

    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params):
        offload = _parameter_offload(engine)
        removed = offload is not None and hasattr(offload, "forward_hooks")
        if removed:
            for p in params:
                # A parameter still marked in use by a module cannot be released on exit.
                p.ds_active_sub_modules.clear()
            for hook in [*offload.forward_hooks, *offload.backward_hooks]:
                hook.remove()
            offload.forward_hooks, offload.backward_hooks = [], []
        try:
            yield
        finally:
            if removed:
                coordinator = offload.get_param_coordinator()
                if not coordinator.is_invalid_trace():
                    coordinator._invalidate_trace()
                # count=[0]: the same module ids as when DeepSpeed registered them first.
                offload._register_deepspeed_module(offload.module, count=[0])


def _fsdp_states(model: nn.Module) -> list[Any]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def _fsdp2_unsharded(model: nn.Module) -> Iterator[None]:
    modules = _fsdp_states(model)
    saved = []
    for m in modules:
        state = m._get_fsdp_state()
        saved.append((state, state._auto_reshard_after_forward,
                      [(g, g.post_forward_mesh_info) for g in state._fsdp_param_groups]))
        m.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for m in modules:
            m.reshard()
        for state, auto, groups in saved:
            state._auto_reshard_after_forward = auto
            for group, info in groups:
                group.post_forward_mesh_info = info
