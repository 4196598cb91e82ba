"""Memory at rest and each step's rise above it: what a trainer holds between steps, apart
from what a step adds.

A run's peak mixes two things. What stays allocated between optimizer steps — the weights,
the optimizer's state, a frozen teacher or reference — is the same for every trainer that
trains the same models with the same optimizer; what a step adds on top of it (gradients,
activations, logits, the generation's KV cache) is where trainers differ. With models and
optimizer state large against the step's work (on-policy distillation of a 0.5B student from
a 1.5B teacher with gradient checkpointing), the peak's ratio hides the step's: this hook
reports both.

`StepMemory` is a StepTimer hook (`harness/timing.py`): at the start of each step it reads the
bytes allocated (the step's rest) and restarts the allocator's peak; at its end it reads the
peak. The peak of the whole run (`overall`) keeps the largest of every window, between steps
included, so restarting the allocator's peak loses nothing.
"""

from __future__ import annotations

from typing import Callable

GiB = 2**30


class StepMemory:
    """Per step: the bytes allocated at its start and the largest allocated during it.

    Args:
        allocated, peak, reset_peak: the allocator's readings (default: torch.cuda's
            memory_allocated, max_memory_allocated and reset_peak_memory_stats).
    """

    def __init__(self, allocated: Callable[[], int] | None = None, peak: Callable[[], int] | None = None,
                 reset_peak: Callable[[], None] | None = None):
        if allocated is None or peak is None or reset_peak is None:
            import torch

            allocated = allocated or torch.cuda.memory_allocated
            peak = peak or torch.cuda.max_memory_allocated
            reset_peak = reset_peak or torch.cuda.reset_peak_memory_stats
        self._allocated, self._peak, self._reset = allocated, peak, reset_peak
        self.rest: list[int] = []  # bytes allocated at each step's start
        self.peaks: list[int] = []  # the largest allocated during each step
        self._outside = 0  # the largest allocated outside the steps so far

    def begin(self, step: int) -> None:
        self._outside = max(self._outside, self._peak())
        self._reset()
        self.rest.append(self._allocated())

    def end(self, step: int, seconds: float) -> None:
        self.peaks.append(self._peak())

    def overall(self) -> int:
        """The largest allocated since the run's peak was last reset before the first step."""
        return max([self._outside, self._peak()] + self.peaks)

    def summary(self, timed: slice) -> dict:
        """`resident_gib`: allocated at the start of the first timed step; `step_gib`: the
        largest rise of a timed step above its own start; both lists per step."""
        rest, peaks = self.rest[timed], self.peaks[timed]
        if not rest or not peaks:
            return {}
        rises = [p - r for r, p in zip(rest, peaks)]
        return {"resident_gib": rest[0] / GiB, "step_gib": max(rises) / GiB,
                "rest_gib_by_step": [r / GiB for r in self.rest], "peak_gib_by_step": [p / GiB for p in self.peaks]}
