"""Typed metrics: what a loss reports, and how each value reduces.

A loss returns `(loss, metrics)`; `metrics` is a `MetricSet`, a frozen dataclass whose
fields are statistics that say how they reduce over micro-batches, ranks and a logging
window:

    Mean(sum, count)        logged as sum / count (a mean over items, or over tokens)
    Total(sum)              logged as the sum per optimizer step (training: the window's
                            sum over its optimizer steps; evaluation: the whole sum)
    Std(sum, sum_sq, count) logged as the sample standard deviation of the values
    Min(value), Max(value)  logged as the smallest / largest value seen

Each value is a 0-dim tensor or a per-example tensor `[B]` (B = the micro-batch's items).
In evaluation every value must be per example: accelerate repeats rows to even out the
last batch across ranks, and only per-example values let `gather_for_metrics` drop them
(a scalar there is an error, never a silent fallback to a plain sum over ranks).

Nothing here waits for the device: values are reduced over ranks as they are recorded,
summed into buffers on the device, and read back to the host only when they are logged.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Union

import torch
from torch import Tensor


@dataclass(frozen=True)
class Mean:
    """Logged as sum / count; both add up over micro-batches, ranks and the window."""

    sum: Tensor
    count: Tensor


@dataclass(frozen=True)
class Total:
    """Logged as a sum per optimizer step (e.g. examples of a class); evaluation: the whole sum."""

    sum: Tensor


@dataclass(frozen=True)
class Std:
    """Logged as the sample standard deviation (as `torch.std`) of the values summed here."""

    sum: Tensor
    sum_sq: Tensor
    count: Tensor

    @classmethod
    def of(cls, values: Tensor, mask: Tensor | None = None) -> "Std":
        """The statistic of `values` [B] (where `mask` [B] is true), per example."""
        values = values.detach().double()
        keep = torch.ones_like(values) if mask is None else mask.double()
        values = torch.where(keep > 0, values, torch.zeros_like(values))
        return cls(values, values * values, keep)


@dataclass(frozen=True)
class Min:
    """Logged as the smallest value seen; +inf marks "nothing here" (e.g. a masked example)."""

    value: Tensor


@dataclass(frozen=True)
class Max:
    """Logged as the largest value seen; -inf marks "nothing here"."""

    value: Tensor


Stat = Union[Mean, Total, Std, Min, Max]


def logged_as(name: str) -> Any:
    """A `MetricSet` field logged under `name` (e.g. "rewards/chosen")."""
    return field(metadata={"name": name})


@dataclass(frozen=True)
class MetricSet:
    """Base of a loss's metrics. Subclasses declare `Stat` fields with `logged_as(name)`.

    A field may be None (not computed this time); the same fields must be None on every
    rank, since the values are reduced across ranks as they are recorded.

    Attributes:
        derived: logged name -> function of the logged values (a dict), for values that
            are functions of other means (KTO's margin of two class means, say); computed
            when every value it reads was logged.
        logged_when_empty: patterns (`fnmatch`) of names logged as None in a window where they
            have no value (a statistic over nothing), where the peer logs the key with None;
            other names are left out then.
    """

    derived: ClassVar[dict[str, Callable[[dict[str, float]], float]]] = {}
    logged_when_empty: ClassVar[tuple[str, ...]] = ()

    def logged(self) -> dict[str, float | None]:
        """What logging these metrics alone, on one process, gives (tests, notebooks)."""
        return logged_values(self)

    def stats(self) -> Iterator[tuple[str, Stat]]:
        """(logged name, statistic) of every field that is set."""
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None:
                yield f.metadata.get("name", f.name), value


Metrics = Union[MetricSet, Iterable[MetricSet]]

# Columns of each statistic in the recorder's buffers, and how they combine.
_SUM, _MIN, _MAX = "sum", "min", "max"
_LAYOUT: dict[type, tuple[tuple[str, str], ...]] = {
    Mean: (("sum", _SUM), ("count", _SUM)),
    Total: (("sum", _SUM),),
    Std: (("sum", _SUM), ("sum_sq", _SUM), ("count", _SUM)),
    Min: (("value", _MIN),),
    Max: (("value", _MAX),),
}
_NEUTRAL = {_SUM: 0.0, _MIN: math.inf, _MAX: -math.inf}


def _metric_sets(metrics: Metrics | None) -> list[MetricSet]:
    if metrics is None:
        return []
    if isinstance(metrics, MetricSet):
        return [metrics]
    sets = list(metrics)
    for m in sets:
        if not isinstance(m, MetricSet):
            raise TypeError(f"metrics must be MetricSet objects, got {type(m).__name__}")
    return sets


class _Buffer:
    """Reduced columns of one layout (names and kinds fixed), accumulated on the device."""

    def __init__(self, kinds: tuple[str, ...], values: Tensor):
        self.kinds = kinds
        self.values = values

    def add(self, values: Tensor) -> None:
        out = []
        for i, kind in enumerate(self.kinds):
            a, b = self.values[i], values[i]
            out.append(a + b if kind == _SUM else torch.minimum(a, b) if kind == _MIN else torch.maximum(a, b))
        self.values = torch.stack(out)


class MetricsRecorder:
    """Reduces typed metrics over ranks as they are recorded and logs them per window.

    Args:
        accelerator: the Trainer's accelerator (ranks, device, `gather_for_metrics`).
    """

    def __init__(self, accelerator: Any):
        self.accelerator = accelerator
        self._buffers: dict[str, dict[tuple[str, ...], _Buffer]] = {"train": {}, "eval": {}}
        self._types: dict[str, dict[type, None]] = {"train": {}, "eval": {}}

    def record(self, mode: str, metrics: Metrics | None) -> None:
        """Adds one micro-batch's metrics (all ranks) to the window of `mode`.

        Raises:
            ValueError: in evaluation, a value that is not per example `[B]`.
        """
        sets = _metric_sets(metrics)
        if not sets:
            return
        names, kinds, columns = [], [], []
        for metric_set in sets:
            self._types[mode][type(metric_set)] = None
            for name, stat in metric_set.stats():
                for attr, kind in _LAYOUT[type(stat)]:
                    names.append(f"{name}\0{type(stat).__name__}\0{attr}")
                    kinds.append(kind)
                    columns.append(torch.as_tensor(getattr(stat, attr)).detach())
        device = self.accelerator.device
        columns = [c.to(device=device, dtype=torch.float64) for c in columns]
        if mode == "eval":
            reduced = self._gather_per_example(names, kinds, columns)
        else:
            reduced = self._reduce(kinds, [self._local(kind, c) for kind, c in zip(kinds, columns)])
        key = tuple(names)
        buffers = self._buffers[mode]
        if key in buffers:
            buffers[key].add(reduced)
        else:
            buffers[key] = _Buffer(tuple(kinds), reduced)

    def read(self, mode: str, steps: int = 1) -> dict[str, float | None]:
        """The logged values of the window of `mode` (read back to the host), then clears it.

        Args:
            mode: "train" or "eval".
            steps: optimizer steps in the window, the divisor of `Total` statistics (1 in evaluation).
        """
        raw: dict[str, dict[str, float]] = {}
        for buffer_names, buffer in self._buffers[mode].items():
            values = buffer.values.tolist()
            for full, kind, value in zip(buffer_names, buffer.kinds, values):
                name, stat, attr = full.split("\0")
                slot = raw.setdefault(name, {"stat": stat})
                if attr in slot:
                    slot[attr] = value + slot[attr] if kind == _SUM else (
                        min(value, slot[attr]) if kind == _MIN else max(value, slot[attr]))
                else:
                    slot[attr] = value
        steps = max(steps, 1)
        empty = [p for metric_type in self._types[mode] for p in metric_type.logged_when_empty]
        logs = {}
        for name, slot in raw.items():
            value = _logged_value(slot, steps)
            if value is not None or any(fnmatch.fnmatchcase(name, p) for p in empty):
                logs[name] = value
        for metric_type in self._types[mode]:
            for name, fn in metric_type.derived.items():
                try:
                    logs[name] = fn(logs)
                except (KeyError, TypeError):
                    pass  # a value it reads was not logged (or logged as None) in this window
        self._buffers[mode].clear()
        self._types[mode].clear()
        return logs

    # ------------------------------------------------------------------ internals

    @staticmethod
    def _local(kind: str, column: Tensor) -> Tensor:
        if column.dim() == 0:
            return column
        if column.numel() == 0:
            return column.new_tensor(_NEUTRAL[kind])
        return column.sum() if kind == _SUM else column.min() if kind == _MIN else column.max()

    def _reduce(self, kinds: list[str], values: list[Tensor]) -> Tensor:
        stacked = torch.stack(values)
        if self.accelerator.num_processes == 1:
            return stacked
        import torch.distributed as dist

        out = stacked.clone()
        for kind, op in ((_SUM, dist.ReduceOp.SUM), (_MIN, dist.ReduceOp.MIN), (_MAX, dist.ReduceOp.MAX)):
            index = [i for i, k in enumerate(kinds) if k == kind]
            if index:
                part = stacked[index].clone()
                dist.all_reduce(part, op=op)
                out[index] = part
        return out

    def _gather_per_example(self, names: list[str], kinds: list[str], columns: list[Tensor]) -> Tensor:
        rows = {c.shape[0] if c.dim() == 1 else None for c in columns}
        if len(rows) != 1 or None in rows:
            shapes = sorted({tuple(c.shape) for c in columns})
            bad = [n.split("\0")[0] for n, c in zip(names, columns) if c.dim() != 1]
            raise ValueError(
                f"evaluation metrics must be per example, [B] each (so that the rows accelerate repeats to even "
                f"out ranks can be dropped); got shapes {shapes}" + (f", scalar: {sorted(set(bad))}" if bad else "")
            )
        gathered = self.accelerator.gather_for_metrics(torch.stack(columns, dim=-1))  # [rows, K]
        return torch.stack([self._local(kind, gathered[:, i]) for i, kind in enumerate(kinds)])


def _logged_value(slot: dict[str, Any], steps: int) -> float | None:
    stat = slot["stat"]
    if stat == "Mean":
        return slot["sum"] / slot["count"] if slot["count"] > 0 else None
    if stat == "Total":
        return slot["sum"] / steps
    if stat == "Std":
        n = slot["count"]
        if n < 1:
            return None
        if n < 2:
            return 0.0
        var = (slot["sum_sq"] - slot["sum"] ** 2 / n) / (n - 1)
        return math.sqrt(max(var, 0.0))
    value = slot["value"]
    return value if math.isfinite(value) else None


class _OneProcess:
    """The accelerator of a single CPU process, for `logged_values`."""

    device = torch.device("cpu")
    num_processes = 1

    @staticmethod
    def gather_for_metrics(x: Tensor) -> Tensor:
        return x


def logged_values(*metric_sets: MetricSet, mode: str = "train", steps: int = 1) -> dict[str, float | None]:
    """What one process would log for these metric sets, recorded one after another (tests, notebooks)."""
    recorder = MetricsRecorder(_OneProcess())
    for metric_set in metric_sets:
        recorder.record(mode, metric_set)
    return recorder.read(mode, steps)
