"""Models under the running backend: the frozen reference, and the final whole-model save."""

from __future__ import annotations

import copy
from typing import Any

from torch import nn

from fusedalign.distributed.backend import is_fsdp2, is_zero3


def prepare_reference_model(model: nn.Module, accelerator: Any) -> nn.Module:
    """Makes a frozen reference model callable under the running backend.

    - ZeRO-3: the model was loaded partitioned (zero.Init); a DeepSpeed inference engine
      registers the hooks that gather each module's parameters for its forward.
    - FSDP2: sharded like the policy (`_fsdp2_sharded`), so each rank holds 1/world of it.
    - DDP, ZeRO-2, single: a whole frozen copy on the device; no gradients, no wrapper.
    """
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    if is_zero3(accelerator):
        return _deepspeed_inference_engine(model, accelerator)
    if is_fsdp2(accelerator):
        # accelerate's evaluation mode adds the mixed-precision autocast only: it shards nothing.
        return accelerator.prepare_model(_fsdp2_sharded(model, accelerator), evaluation_mode=True)
    return model.to(accelerator.device)


def _fsdp2_sharded(model: nn.Module, accelerator: Any) -> nn.Module:
    """A frozen model sharded by FSDP2 in place: each of its blocks, then the root.

    The blocks are the modules the plugin's `transformer_cls_names_to_wrap` or the model's own
    `_no_split_modules` name, as accelerate picks them for the policy. They are found in this
    model without touching the plugin: a teacher or reward model may be another architecture
    than the policy the plugin is set up for. The blocks reshard after their forward as the
    plugin says. The root is left to `fully_shard`'s default for a root, which keeps its
    parameters whole after its forward: a head called after the model's forward (the
    distillation teacher's, from inside the student's head) reads them whole within its call.
    Mixed precision, offloading and the mesh are the policy's.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    plugin = accelerator.state.fsdp_plugin
    mesh = getattr(accelerator, "torch_device_mesh", None)
    parallelism = getattr(accelerator, "parallelism_config", None)
    if mesh is not None and parallelism is not None:
        mesh = mesh[tuple(parallelism.fsdp_dim_names)]
    common = {"mesh": mesh, "mp_policy": plugin.mixed_precision_policy or MixedPrecisionPolicy(),
              "offload_policy": plugin.cpu_offload}
    names = set(plugin.transformer_cls_names_to_wrap or ()) | set(getattr(model, "_no_split_modules", None) or ())
    blocks = [m for m in model.modules() if m is not model and type(m).__name__ in names]
    for block in reversed(blocks):  # modules() lists a parent before its children; fully_shard wants them first
        fully_shard(block, reshard_after_forward=plugin.reshard_after_forward, **common)
    fully_shard(model, **common)
    return model


def _deepspeed_inference_engine(model: nn.Module, accelerator: Any) -> nn.Module:
    import deepspeed

    config = copy.deepcopy(accelerator.state.deepspeed_plugin.deepspeed_config)
    hidden = getattr(getattr(model, "config", None), "hidden_size", None)
    zero = config.setdefault("zero_optimization", {})
    # Values left "auto" for the policy are finalised by transformers at train time;
    # the reference never goes through that, so fill them the same way here.
    if hidden is not None:
        defaults = {
            "reduce_bucket_size": hidden * hidden,
            "stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
            "stage3_param_persistence_threshold": 10 * hidden,
        }
        for key, value in defaults.items():
            if zero.get(key) == "auto":
                zero[key] = value
    for key in list(config):
        if config[key] == "auto":
            del config[key]
    config.pop("optimizer", None)
    config.pop("scheduler", None)
    config["train_micro_batch_size_per_gpu"] = config.get("train_micro_batch_size_per_gpu", 1)
    config.pop("train_batch_size", None)
    engine, *_ = deepspeed.initialize(model=model, config=config)
    engine.eval()
    return engine


def prepare_final_save(trainer: Any) -> None:
    """Makes `trainer.save_model` write one whole safetensors model on every backend.

    ZeRO-3 consolidates through `zero3_save_16bit_model` (set in our configs, and here);
    FSDP2 saves sharded checkpoints during training but a full state dict at the end.
    """
    accelerator = trainer.accelerator
    if is_fsdp2(accelerator):
        accelerator.state.fsdp_plugin.set_state_dict_type("FULL_STATE_DICT")
    if is_zero3(accelerator):
        zero = accelerator.state.deepspeed_plugin.deepspeed_config.setdefault("zero_optimization", {})
        zero["stage3_gather_16bit_weights_on_model_save"] = True
