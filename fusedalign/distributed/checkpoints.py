"""Checkpoints of the sharded backends made loadable with `from_pretrained`.

Under FSDP2 (SHARDED_STATE_DICT, as our configs ask), an intermediate checkpoint holds
the model as torch.distributed.checkpoint (DCP) shards, one file per rank, under
`checkpoint-N/pytorch_model_fsdp_0/` (accelerate's layout: a state dict `{"model":
model.state_dict()}`), and no config. Gathering a whole model at every save would cost
each save a full copy on one rank; instead:
- `CheckpointConfigCallback` writes the model's config and the tokenizer into every
  checkpoint that lacks them (a few kB);
- `consolidate_checkpoint` reads the shards in one process (no process group needed)
  into a model built from that config and saves it with `save_pretrained`.
A ZeRO-3 checkpoint already holds a whole 16-bit model (our configs set
`zero3_save_16bit_model`), DDP and ZeRO-2 ones a whole model too.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from transformers import TrainerCallback

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "tokenizer.model", "vocab.json", "merges.txt", "generation_config.json")
WHOLE_MODEL_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


class CheckpointConfigCallback(TrainerCallback):
    """Writes config.json and the tokenizer into each checkpoint that has none (FSDP2's sharded ones)."""

    def on_save(self, args, state, control, model=None, processing_class=None, **kwargs):
        if not state.is_world_process_zero or model is None:
            return
        checkpoint = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        if not os.path.isdir(checkpoint) or os.path.isfile(os.path.join(checkpoint, "config.json")):
            return
        config = getattr(model, "config", None)
        if config is not None:
            config.save_pretrained(checkpoint)
        if processing_class is not None and hasattr(processing_class, "save_pretrained"):
            processing_class.save_pretrained(checkpoint)


def sharded_model_dir(checkpoint_dir: str | os.PathLike) -> Path | None:
    """The DCP directory of the trained model in a checkpoint (accelerate numbers models from 0)."""
    path = Path(checkpoint_dir) / "pytorch_model_fsdp_0"
    return path if (path / ".metadata").is_file() else None


def consolidate_checkpoint(checkpoint_dir: str | os.PathLike, output_dir: str | os.PathLike) -> str:
    """Writes the whole model of a sharded checkpoint to `output_dir` (config, safetensors, tokenizer).

    Args:
        checkpoint_dir: a `checkpoint-N` directory of an FSDP2 run.
        output_dir: where to write; may be `checkpoint_dir` itself.

    Returns:
        The path of the written weights.

    Raises:
        FileNotFoundError: `checkpoint_dir` does not exist.
        ValueError: it holds no sharded model, or there is no config to build the model from.
        NotImplementedError: it is a LoRA adapter checkpoint.
    """
    import torch
    import torch.distributed.checkpoint as dcp
    from transformers import AutoConfig, AutoModelForCausalLM

    checkpoint = Path(checkpoint_dir)
    if not checkpoint.is_dir():
        raise FileNotFoundError(f"{checkpoint}: no such checkpoint directory")
    shards = sharded_model_dir(checkpoint)
    if shards is None:
        whole = next((checkpoint / f for f in WHOLE_MODEL_FILES if (checkpoint / f).is_file()), None)
        if whole is not None:
            raise ValueError(f"{checkpoint} already holds a whole model ({whole.name}); from_pretrained loads it as it is")
        raise ValueError(f"{checkpoint}: no sharded model (pytorch_model_fsdp_0/.metadata) and no model weights; "
                         "expected a checkpoint-N directory of an FSDP2 run")
    if (checkpoint / "adapter_config.json").is_file():
        raise NotImplementedError(f"{checkpoint} is a LoRA adapter checkpoint; consolidating adapters is not supported")
    source = next((d for d in (checkpoint, checkpoint.parent) if (d / "config.json").is_file()), None)
    if source is None:
        raise ValueError(f"{checkpoint}: no config.json here or in {checkpoint.parent} to build the model from "
                         "(checkpoints written by `fusedalign` carry one)")
    metadata = dcp.FileSystemReader(str(shards)).read_metadata().state_dict_metadata
    dtype = next(iter(metadata.values())).properties.dtype
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(source), dtype=dtype)
    weights = model.state_dict()
    missing = [k for k in weights if f"model.{k}" not in metadata]
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    if any(k not in tied for k in missing):
        raise ValueError(f"{checkpoint}: the shards lack {missing[:3]} of the model built from {source}/config.json")
    state = {"model": {k: v for k, v in weights.items() if k not in missing}}
    dcp.load(state, checkpoint_id=str(shards), no_dist=True)  # fills the model's tensors in place
    with torch.no_grad():
        model.load_state_dict(state["model"], strict=False)
    model.tie_weights()
    out = Path(output_dir)
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        for directory in (checkpoint, checkpoint.parent):
            if (directory / name).is_file():
                if directory.resolve() != out.resolve() and not (out / name).exists():
                    shutil.copy2(directory / name, out / name)
                break
    return str(out / "model.safetensors")
