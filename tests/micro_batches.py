"""A test instrument: every micro-batch a trainer's loss reads, in order.

    seen = record_micro_batches(trainer)
    trainer.train()
    seen  # [the typed micro-batch of each loss call]
"""

from __future__ import annotations

from typing import Any


def record_micro_batches(trainer: Any) -> list:
    """Wraps `trainer.loss_and_metrics` to append each call's inputs to the returned list."""
    seen: list = []
    inner = trainer.loss_and_metrics

    def recording(model, inputs, mode):
        seen.append(inputs)
        return inner(model, inputs, mode)

    trainer.loss_and_metrics = recording
    return seen
