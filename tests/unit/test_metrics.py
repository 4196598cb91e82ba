"""Evaluation-time reduction of typed metrics: the rows accelerate repeats are dropped for
every statistic, and a value that is not per example is refused."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from torch import Tensor

from fusedalign.metrics import Max, Mean, MetricSet, MetricsRecorder, Min, Std, Total, logged_as


class RepeatsDropped:
    """One process whose `gather_for_metrics` drops the last `repeated[i]` rows of call i.

    Accelerate repeats rows at the end of the last evaluation batch so that every rank gets
    as many; its `gather_for_metrics` removes them again. Here they are the trailing rows.
    """

    device = torch.device("cpu")
    num_processes = 1

    def __init__(self, *repeated: int):
        self.repeated = list(repeated)
        self.shapes: list[tuple[int, ...]] = []

    def gather_for_metrics(self, x: Tensor) -> Tensor:  # x: [rows, K]
        self.shapes.append(tuple(x.shape))
        drop = self.repeated.pop(0)
        return x[: x.shape[0] - drop]


@dataclass(frozen=True)
class EveryKind(MetricSet):
    item_mean: Mean = logged_as("item_mean")
    token_mean: Mean = logged_as("token_mean")
    total: Total = logged_as("total")
    std: Std = logged_as("std")
    smallest: Min = logged_as("smallest")
    largest: Max = logged_as("largest")


def _double(values: list[float]) -> Tensor:
    return torch.tensor(values, dtype=torch.float64)


def _metrics(values, token_sums, token_counts, flags, low, high) -> EveryKind:
    """Every kind of statistic over one micro-batch, per example [B]."""
    values = _double(values)
    return EveryKind(
        item_mean=Mean(values, torch.ones_like(values)),
        token_mean=Mean(_double(token_sums), _double(token_counts)),
        total=Total(_double(flags)),
        std=Std.of(values),
        smallest=Min(_double(low)),
        largest=Max(_double(high)),
    )


# Three real rows, then one repeated row whose values would move every statistic if kept.
BATCH = dict(values=[1.0, 2.0, 4.0, 100.0], token_sums=[3.0, 4.0, 10.0, 1000.0], token_counts=[1.0, 2.0, 5.0, 1.0],
             flags=[1.0, 0.0, 1.0, 1.0], low=[3.0, 5.0, 7.0, -1.0], high=[3.0, 5.0, 7.0, 99.0])


def test_evaluation_drops_repeated_rows_from_every_statistic():
    accelerator = RepeatsDropped(1)
    recorder = MetricsRecorder(accelerator)
    recorder.record("eval", _metrics(**BATCH))
    got = recorder.read("eval")
    assert accelerator.shapes == [(4, 10)]  # one gather of every column, all rows
    # By hand over the rows 1, 2, 4 (mean 7/3): sample variance ((4/3)^2 + (1/3)^2 + (5/3)^2) / 2 = 7/3.
    want = {"item_mean": 7 / 3, "token_mean": (3 + 4 + 10) / (1 + 2 + 5), "total": 2.0, "std": math.sqrt(7 / 3),
            "smallest": 3.0, "largest": 7.0}
    assert got == pytest.approx(want, rel=1e-12)


def test_evaluation_sums_batches_and_drops_only_the_repeats_of_the_last():
    recorder = MetricsRecorder(RepeatsDropped(0, 1))
    first = dict(values=[6.0], token_sums=[1.0], token_counts=[3.0], flags=[0.0], low=[2.0], high=[8.0])
    recorder.record("eval", _metrics(**first))
    recorder.record("eval", _metrics(**BATCH))
    got = recorder.read("eval")
    # Rows 6, 1, 2, 4: mean 13/4, sample variance (7.5625 + 5.0625 + 1.5625 + 0.5625) / 3 = 14.75 / 3.
    want = {"item_mean": 13 / 4, "token_mean": (1 + 3 + 4 + 10) / (3 + 1 + 2 + 5), "total": 2.0,
            "std": math.sqrt(14.75 / 3), "smallest": 2.0, "largest": 8.0}
    assert got == pytest.approx(want, rel=1e-12)
    assert recorder.read("eval") == {}  # reading clears the window


@dataclass(frozen=True)
class OneMean(MetricSet):
    loss: Mean = logged_as("loss")


@dataclass(frozen=True)
class MeanAndTotal(MetricSet):
    loss: Mean = logged_as("loss")
    examples: Total = logged_as("examples")


def test_evaluation_refuses_a_scalar_value_and_names_it():
    recorder = MetricsRecorder(RepeatsDropped(0))
    with pytest.raises(ValueError, match=r"evaluation metrics must be per example, \[B\] each"):
        recorder.record("eval", OneMean(Mean(torch.tensor(3.0), torch.tensor(2.0))))
    mixed = MeanAndTotal(Mean(torch.ones(4), torch.ones(4)), Total(torch.tensor(4.0)))
    with pytest.raises(ValueError, match=r"scalar: \['examples'\]"):
        recorder.record("eval", mixed)
    # Training takes the same scalar: there no row is repeated.
    recorder.record("train", OneMean(Mean(torch.tensor(3.0), torch.tensor(2.0))))
    assert recorder.read("train") == {"loss": 1.5}


def test_evaluation_refuses_values_of_different_row_counts():
    recorder = MetricsRecorder(RepeatsDropped(0))
    uneven = MeanAndTotal(Mean(torch.ones(4), torch.ones(4)), Total(torch.ones(3)))
    with pytest.raises(ValueError, match=r"got shapes \[\(3,\), \(4,\)\]"):
        recorder.record("eval", uneven)
