"""A test instrument: every micro-batch a trainer's loss reads, in order.

    seen = record_micro_batches(trainer)
    trainer.train()
    seen  # [the typed micro-batch of each loss call]
"""

from __future__ import annotations

from typing import Any


class Seen(list):
    """The inputs of each loss call, in order; `steps[i]`: the optimizer steps done before call i."""

    def __init__(self):
        super().__init__()
        self.steps: list[int] = []

    def by_step(self) -> list[list[Any]]:
        """The calls grouped by the optimizer step they belong to (a micro-batch in parts: one call a part)."""
        groups: dict[int, list] = {}
        for step, inputs in zip(self.steps, self):
            groups.setdefault(step, []).append(inputs)
        return list(groups.values())


def record_micro_batches(trainer: Any) -> Seen:
    """Wraps `trainer.loss_and_metrics` to append each call's inputs to the returned list."""
    seen = Seen()
    inner = trainer.loss_and_metrics

    def recording(model, inputs, mode):
        seen.append(inputs)
        seen.steps.append(trainer.state.global_step)
        return inner(model, inputs, mode)

    trainer.loss_and_metrics = recording
    return seen
