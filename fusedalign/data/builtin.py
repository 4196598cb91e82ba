"""The embedded datasets (`builtin:zen`) and a loader for any dataset reference."""

from __future__ import annotations

import contextlib
import json
import logging
import os
from pathlib import Path
from typing import Any, Iterator

from .formats import DataError

BUILTIN_PREFIX = "builtin:"
DATASETS_DIR = Path(__file__).resolve().parents[1] / "resources" / "datasets"
_LOCAL_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


def list_builtin_datasets() -> dict[str, list[str]]:
    """`{name: [config, ...]}` of the embedded datasets."""
    if not DATASETS_DIR.is_dir():
        return {}
    return {
        d.name: sorted(c.name for c in d.iterdir() if c.is_dir())
        for d in sorted(DATASETS_DIR.iterdir()) if d.is_dir()
    }


def load_builtin_dataset(name: str, config: str | None = None, split: str = "train"):
    """Loads an embedded dataset (JSONL in the package) as a `datasets.Dataset`.

    Args:
        name: `"zen"` (a `builtin:` prefix is accepted).
        config: e.g. `"standard_preference"`; required.
        split: `"train"` or `"test"`.

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
        name: `builtin:<name>` (embedded), a local `.json`/`.jsonl`/`.parquet`/`.csv`
            file, a local directory (`datasets.load_dataset` infers its files and splits),
            or a hub id.
        config: the builtin config, or the hub/directory config name.
        split: the split to return.
        **kwargs: passed to `datasets.load_dataset`.

    Returns:
        A `datasets.Dataset`.

    Raises:
        DataError: unknown builtin name/config/split, a local path that does not exist, or a
            local file that is empty or malformed (naming its line).
        HubUnreachableError: a hub name while the hub cannot be reached (and it is not cached).
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
        return _load_file(load_dataset, builder, path, split, **kwargs)
    if os.path.isdir(path):
        return load_dataset(path, config, split=split, **kwargs)
    if _looks_local(name):
        builtin = ", ".join(BUILTIN_PREFIX + n for n in list_builtin_datasets())
        raise DataError(f"dataset path {name!r} does not exist (expected a file, a directory, "
                        f"a hub id or one of: {builtin})")
    from fusedalign.hub import require_hub

    require_hub(name, "dataset")
    return load_dataset(name, config, split=split, **kwargs)


def _load_file(load_dataset: Any, builder: str, path: str, split: str, **kwargs: Any):
    """Loads one local file; a file that cannot be read is a DataError naming its line."""
    if os.path.getsize(path) == 0:
        raise DataError(f"{path} is empty: {_EXPECTED[builder]}")
    try:
        with _quiet_json_failure():
            return load_dataset(builder, data_files={split: path}, split=split, **kwargs)
    except Exception as err:  # datasets reports a byte offset, or a bare StopIteration for blank files
        problem = json_problem(path) if builder == "json" else None
        if problem is None:
            raise DataError(f"{path}: could not be read as {builder} ({type(err).__name__}: {err})") from err
        raise DataError(problem) from None


class _DropPrefix(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Failed to load JSON from file")


@contextlib.contextmanager
def _quiet_json_failure() -> Iterator[None]:
    """datasets logs its own parse error before raising; the one we raise names the line instead."""
    logger, drop = logging.getLogger("datasets.packaged_modules.json.json"), _DropPrefix()
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


_EXPECTED = {
    "json": "expected JSON Lines (one JSON object per line, a row each) or a JSON array of objects",
    "parquet": "expected a parquet table",
    "csv": "expected a CSV table with a header line",
}


def json_problem(path: str) -> str | None:
    """The first problem in a JSON / JSON Lines file, naming its line (from 1), or None."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if not text.strip():
        return f"{path} holds no rows (only whitespace): {_EXPECTED['json']}"
    if text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as err:
            return f"{path}, line {err.lineno}, column {err.colno}: not valid JSON ({err.msg})"
        bad = next((i for i, row in enumerate(rows) if not isinstance(row, dict)), None)
        if bad is not None:
            return f"{path}: array element {bad} (from 0) is a {type(rows[bad]).__name__}; expected an object (a row)"
        return None
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            return (f"{path}, line {number}, column {err.colno}: not valid JSON ({err.msg}); "
                    "expected one JSON object per line")
        if not isinstance(row, dict):
            return f"{path}, line {number}: a JSON {type(row).__name__}; expected an object (one row per line)"
    return None


def is_single_file(name: str | os.PathLike) -> bool:
    """Whether a dataset reference is one local file (which holds a single split)."""
    name = os.fspath(name)
    return not name.startswith(BUILTIN_PREFIX) and os.path.isfile(os.path.expanduser(name))


def line_of_row(path: str, row: int) -> int | None:
    """The line (from 1) of a JSON Lines file that holds dataset row `row` (from 0); blank lines hold none."""
    if Path(path).suffix.lower() not in (".jsonl", ".json"):
        return None
    with open(path, encoding="utf-8") as f:
        if f.read(1) == "[":
            return None  # a JSON array: rows are not lines
        f.seek(0)
        seen = -1
        for number, line in enumerate(f, 1):
            if line.strip():
                seen += 1
                if seen == row:
                    return number
    return None


def located_error(err: DataError, name: str | os.PathLike, split: str | None) -> DataError:
    """`err` with where it is: the file and line for a local JSON Lines file, else the dataset and split."""
    name = os.fspath(name)
    line = line_of_row(os.path.expanduser(name), err.row) if err.row is not None and is_single_file(name) else None
    if line is not None:
        where = f"{name}, line {line}"
    else:
        where = f"dataset {name}" + (f" ({split} split)" if split else "")
    return DataError(f"{where}: {err}", row=err.row)


def _looks_local(name: str) -> bool:
    """A name meant as a local path rather than a hub id ("org/name")."""
    head = name.split("/", 1)[0]
    return (Path(name).suffix.lower() in _LOCAL_BUILDERS or name.startswith((".", "/", "~"))
            or name.count("/") > 1 or ("/" in name and os.path.isdir(head)))
