"""Loading models and tokenizers: `builtin:<name>` resources, local paths, hub ids.

The builtin models are real checkpoints under `fusedalign/resources/models/` (config,
safetensors weights and a copy of the builtin tokenizer), so they go through the same
`from_pretrained` path as any other model: DeepSpeed ZeRO-3's `zero.Init` and FSDP2
see a real load.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

BUILTIN_PREFIX = "builtin:"
RESOURCES = Path(__file__).resolve().parent / "resources"
MODELS_DIR = RESOURCES / "models"
TOKENIZER_DIR = RESOURCES / "tokenizer"

# "org/name" or "name", as the hub spells repository ids.
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")


class ModelNotFoundError(FileNotFoundError, ValueError):
    """A model or tokenizer name that resolves to nothing loadable."""


def list_builtin_models() -> list[str]:
    """Names of the packaged models, usable as `builtin:<name>`."""
    if not MODELS_DIR.is_dir():
        return []
    return sorted(p.name for p in MODELS_DIR.iterdir() if (p / "config.json").is_file())


def resolve_model_path(name_or_path: str | os.PathLike) -> str:
    """Turns a model reference into what `from_pretrained` accepts.

    Args:
        name_or_path: `builtin:<name>` (a packaged tiny model), `builtin:tokenizer`
            (the packaged tokenizer alone), a local directory, or a hub id.

    Returns:
        A local directory for builtin names and existing paths; a hub id unchanged.

    Raises:
        ModelNotFoundError: an unknown builtin name (the message lists the known ones), or a
            path that does not exist and cannot be a hub id. (A hub id is checked against the
            hub when it is loaded: `fusedalign.hub.require_hub`.)
    """
    name = os.fspath(name_or_path)
    if name.startswith(BUILTIN_PREFIX):
        short = name[len(BUILTIN_PREFIX):]
        if short == "tokenizer":
            return str(TOKENIZER_DIR)
        if short in list_builtin_models():
            return str(MODELS_DIR / short)
        available = ", ".join(BUILTIN_PREFIX + n for n in list_builtin_models())
        raise ModelNotFoundError(
            f"unknown builtin model {name!r}; available: {available} (and builtin:tokenizer)"
        )
    if os.path.exists(os.path.expanduser(name)):
        return os.path.expanduser(name)
    parent = name.split("/", 1)[0]
    if not _HUB_ID.match(name) or ("/" in name and os.path.isdir(parent)):
        raise ModelNotFoundError(
            f"model path {name!r} does not exist; expected an existing local directory, a hub id "
            f"('org/name') or one of: {', '.join(BUILTIN_PREFIX + n for n in list_builtin_models())}"
        )
    return name


def load_tokenizer(name_or_path: str | os.PathLike, **kwargs: Any):
    """Loads a tokenizer with `AutoTokenizer.from_pretrained`.

    A tokenizer without a pad token gets its eos token as pad token, since every collator
    pads (the pad positions are masked out, so the choice does not change any loss).

    Args:
        name_or_path: as for `resolve_model_path`.
        **kwargs: passed to `AutoTokenizer.from_pretrained`.

    Returns:
        The tokenizer.
    """
    from transformers import AutoTokenizer

    path = resolve_model_path(name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(path, **_hub_kwargs(path, kwargs))
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(name_or_path: str | os.PathLike, *, dtype: Any = None, **kwargs: Any):
    """Loads a causal LM with `AutoModelForCausalLM.from_pretrained`.

    Args:
        name_or_path: as for `resolve_model_path`.
        dtype: a `torch.dtype`, its name (`"bfloat16"`) or `"auto"`; None leaves
            `from_pretrained`'s default. The builtin models are stored in float32.
        **kwargs: passed to `from_pretrained` (`attn_implementation`, `device_map`...).

    Returns:
        The model.
    """
    from transformers import AutoModelForCausalLM

    if isinstance(dtype, str) and dtype != "auto":
        import torch

        dtype = getattr(torch, dtype)
    if dtype is not None:
        kwargs["dtype"] = dtype
    from fusedalign.attention.selection import ATTENTION_ASKED

    path = resolve_model_path(name_or_path)
    model = AutoModelForCausalLM.from_pretrained(path, **_hub_kwargs(path, kwargs))
    # Whether the implementation was asked for: padding-free rows on CUDA may move a default one
    # to flex attention (fusedalign.attention.selection), never one a caller chose.
    setattr(model, ATTENTION_ASKED, "attn_implementation" in kwargs)
    if os.fspath(name_or_path).startswith(BUILTIN_PREFIX):
        # What a LoRA adapter records as its base, and what the tokenizer is loaded from:
        # the name a user can pass again, not a path into the installed package.
        model.name_or_path = model.config.name_or_path = os.fspath(name_or_path)
    elif os.path.isdir(path):
        # A local directory as an absolute path: a relative one, recorded as an adapter's base, would
        # read as a hub id from anywhere else (`fusedalign merge` run in another directory).
        model.name_or_path = model.config.name_or_path = os.path.abspath(path)
    return model


def load_model_with(name_or_path: str | os.PathLike, field: str, init_kwargs: dict[str, Any] | None,
                    **kwargs: Any):
    """`load_model(name_or_path, **kwargs, **init_kwargs)`, where `init_kwargs` is the user's `field`
    (`model_init_kwargs`, `teacher_model_init_kwargs`): a key neither from_pretrained nor the model
    takes is one line naming the field (the model's __init__ raises a TypeError about it)."""
    init_kwargs = dict(init_kwargs or {})
    try:
        return load_model(name_or_path, **{**kwargs, **init_kwargs})
    except TypeError as error:
        bad = re.search(r"unexpected keyword argument '(\w+)'", str(error))
        if bad is None or bad.group(1) not in init_kwargs:
            raise
        raise ValueError(f"{field}: {bad.group(1)!r} is not an argument of from_pretrained or of the model of "
                         f"{name_or_path} ({error}); remove it.") from None


def _hub_kwargs(path: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """`from_pretrained` arguments for `path`: a hub id is checked first (fails in seconds when offline)."""
    if os.path.exists(path) or kwargs.get("local_files_only"):
        return kwargs
    from fusedalign.hub import require_hub

    if require_hub(path, "model"):  # unreachable hub, cached copy: no network retries
        return {**kwargs, "local_files_only": True}
    return kwargs
