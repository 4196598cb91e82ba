"""Replay: completions recorded once and replayed, keyed by (row key, generation index).

For exact distributed parity of the training maths: one process records the completions of
a run (`Recorder` around any generator, then `save`), and every backend replays the same
file, so that rewards, advantages, losses and weights can be compared to 1e-5 while the
model's sampling stays out of the comparison. A key seen twice (several epochs) replays the
first recording.
"""

from __future__ import annotations

import json
import os
from typing import Any, Sequence

from .base import GenerationError, GenerationOutput, Generator, RowKey


class Replay:
    """A generator that returns recorded completions.

    Args:
        records: (row, generation) -> (completion_ids, truncated, logprobs or None).
    """

    def __init__(self, records: dict[RowKey, tuple[list[int], bool, list[float] | None]], source: str = "records"):
        self.records = {tuple(k): v for k, v in records.items()}
        self.source = source

    def generate(self, model: Any, prompt_ids: Sequence[Sequence[int]], row_keys: Sequence[RowKey], *,
                 step: int = 0) -> GenerationOutput:
        missing = [tuple(k) for k in row_keys if tuple(k) not in self.records]
        if missing:
            row, gen = missing[0]
            raise GenerationError(f"replay {self.source}: no recorded completion for dataset row {row}, generation "
                                  f"{gen} ({len(missing)} of {len(row_keys)} rows missing; it holds "
                                  f"{len(self.records)} completions)")
        got = [self.records[tuple(k)] for k in row_keys]
        logprobs = [g[2] for g in got]
        return GenerationOutput([list(g[0]) for g in got], [bool(g[1]) for g in got],
                                logprobs if all(lp is not None for lp in logprobs) else None)

    def save(self, path: str | os.PathLike) -> None:
        """One JSON line per completion: row, generation, completion_ids, truncated[, logprobs]."""
        with open(path, "w") as f:
            for (row, gen), (ids, truncated, logprobs) in sorted(self.records.items()):
                line = {"row": row, "generation": gen, "completion_ids": list(ids), "truncated": bool(truncated)}
                if logprobs is not None:
                    line["logprobs"] = list(logprobs)
                f.write(json.dumps(line) + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Replay":
        records = {}
        with open(path) as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    r = json.loads(line)
                    records[(int(r["row"]), int(r["generation"]))] = (
                        list(r["completion_ids"]), bool(r["truncated"]), r.get("logprobs"))
                except (ValueError, KeyError, TypeError) as error:
                    raise GenerationError(f"{path}, line {n}: expected a JSON object with row, generation, "
                                          f"completion_ids and truncated ({error})") from None
        return cls(records, source=str(path))


class Recorder:
    """Wraps a generator and records what it returns, first recording of each key kept."""

    def __init__(self, inner: Generator):
        self.inner = inner
        self.records: dict[RowKey, tuple[list[int], bool, list[float] | None]] = {}

    def generate(self, model: Any, prompt_ids: Sequence[Sequence[int]], row_keys: Sequence[RowKey], *,
                 step: int = 0) -> GenerationOutput:
        out = self.inner.generate(model, prompt_ids, row_keys, step=step)
        for i, key in enumerate(row_keys):
            lp = out.logprobs[i] if out.logprobs is not None else None
            self.records.setdefault(tuple(key), (list(out.completion_ids[i]), bool(out.truncated[i]), lp))
        return out

    def replay(self) -> Replay:
        return Replay(dict(self.records))
