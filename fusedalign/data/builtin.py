"""The embedded datasets (``builtin:zen``) and a loader for any dataset reference."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .formats import DataError

BUILTIN_PREFIX = "builtin:"
DATASETS_DIR = Path(__file__).resolve().parents[1] / "resources" / "datasets"
_LOCAL_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


def list_builtin_datasets() -> dict[str, list[str]]:
    """``{name: [config, ...]}`` of the embedded datasets."""
    if not DATASETS_DIR.is_dir():
        return {}
    return {
        d.name: sorted(c.name for c in d.iterdir() if c.is_dir())
        for d in sorted(DATASETS_DIR.iterdir()) if d.is_dir()
    }


def load_builtin_dataset(name: str, config: str | None = None, split: str = "train"):
    """Loads an embedded dataset (JSONL in the package) as a ``datasets.Dataset``.

    Args:
        name: ``"zen"`` (a ``builtin:`` prefix is accepted).
        config: e.g. ``"standard_preference"``; required.
        split: ``"train"`` or ``"test"``.

    Raises:
        DataError: unknown name, config or split; the message lists what exists.
    """
    from datasets import Dataset

    name = name[len(BUILTIN_PREFIX):] if name.startswith(BUILTIN_PREFIX) else name
    available = list_builtin_datasets()
    if name not in available:
        names = ", ".join(BUILTIN_PREFIX + n for n in available)
        raise DataError(f"unknown builtin dataset {BUILTIN_PREFIX + name!r}; available: {names}")
    if config not in available[name]:
        what = "needs a config" if config is None else f"has no config {config!r}"
        raise DataError(
            f"builtin dataset {BUILTIN_PREFIX + name!r} {what}; available: {', '.join(available[name])}"
        )
    path = DATASETS_DIR / name / config / f"{split}.jsonl"
    if not path.is_file():
        splits = sorted(p.stem for p in path.parent.glob("*.jsonl"))
        raise DataError(
            f"builtin dataset {BUILTIN_PREFIX + name}/{config} has no split {split!r}; available: {splits}"
        )
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return Dataset.from_list(rows)


def load_dataset_any(name: str | os.PathLike, config: str | None = None, split: str = "train",
                     **kwargs: Any):
    """Loads a dataset from any reference the CLI accepts.

    Args:
        name: ``builtin:<name>`` (embedded), a local ``.json``/``.jsonl``/``.parquet``/``.csv``
            file, a local directory (``datasets.load_dataset`` infers its files and splits),
            or a hub id.
        config: the builtin config, or the hub/directory config name.
        split: the split to return.
        **kwargs: passed to ``datasets.load_dataset``.

    Returns:
        A ``datasets.Dataset``.

    Raises:
        DataError: unknown builtin name/config/split, or a local path that does not exist.
    """
    name = os.fspath(name)
    if name.startswith(BUILTIN_PREFIX):
        return load_builtin_dataset(name, config, split)

    from datasets import load_dataset

    path = os.path.expanduser(name)
    if os.path.isfile(path):
        builder = _LOCAL_BUILDERS.get(Path(path).suffix.lower())
        if builder is None:
            raise DataError(f"dataset file {name!r}: expected one of {sorted(_LOCAL_BUILDERS)} extensions")
        # A single file is the whole dataset, whatever split is asked for.
        return load_dataset(builder, data_files={split: path}, split=split, **kwargs)
    if os.path.isdir(path):
        return load_dataset(path, config, split=split, **kwargs)
    if _looks_local(name):
        builtin = ", ".join(BUILTIN_PREFIX + n for n in list_builtin_datasets())
        raise DataError(f"dataset path {name!r} does not exist (expected a file, a directory, "
                        f"a hub id or one of: {builtin})")
    return load_dataset(name, config, split=split, **kwargs)


def _looks_local(name: str) -> bool:
    """A name meant as a local path rather than a hub id ("org/name")."""
    head = name.split("/", 1)[0]
    return (Path(name).suffix.lower() in _LOCAL_BUILDERS or name.startswith((".", "/", "~"))
            or name.count("/") > 1 or ("/" in name and os.path.isdir(head)))
