"""Step times of a `transformers.Trainer` run, each read after a synchronize.

`StepTimer` is a TrainerCallback: a step starts when the Trainer fetches the step's
micro-batches (`get_batch_samples`, wrapped by `time_from_batch_fetch`) or, for a trainer
not wrapped, at `on_step_begin`, and ends at `on_step_end`; each clock read follows a
synchronize, so a step's time is its GPU work, not the time the host took to queue it.
The start is the fetch because transformers calls `get_batch_samples` before
`on_step_begin`, and fusedalign's trainers prepare the step there (DPO's reference
forwards, GRPO's generation): timed from `on_step_begin`, that work would be missed.
`steady(...)` summarises the steps after warm-up (the first steps hold compilation,
cuDNN autotuning and allocator growth).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import Callable


def device_sync(cuda: bool) -> Callable[[], None]:
    if cuda:
        import torch

        return torch.cuda.synchronize
    return lambda: None


class Timers:
    """Named wall-clock sections, each between two synchronizes; repeated names add up."""

    def __init__(self, sync: Callable[[], None]):
        self.sync = sync
        self.totals: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        self.sync()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.sync()
            self.totals[name] = self.totals.get(name, 0.0) + time.perf_counter() - t0

    def get(self, name: str) -> float:
        return self.totals.get(name, 0.0)


class GenerationSplit:
    """A StepTimer hook: the generation time inside each step (from the timer named "generation")."""

    def __init__(self, timers: Timers):
        self.timers, self.at_begin, self.per_step = timers, 0.0, []

    def begin(self, step: int) -> None:
        self.at_begin = self.timers.get("generation")

    def end(self, step: int, seconds: float) -> None:
        self.per_step.append(self.timers.get("generation") - self.at_begin)


def step_timer(sync: Callable[[], None], hooks: list | None = None):
    """A TrainerCallback that times every step and keeps every log that has a loss.

    Args:
        sync: called before each clock read (torch.cuda.synchronize on a GPU).
        hooks: objects with `begin(step)` and `end(step, seconds)` (a profiler, a memory
            recorder), called inside the timed span, after the sync, with the 0-based step.
    """
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.begin: list[float] = []
            self.end: list[float] = []
            self.logs: list[dict] = []
            self.hooks = list(hooks or [])

        def start(self) -> None:
            """The step starts now (a fetch with no step after it is started again)."""
            sync()
            if len(self.begin) > len(self.end):
                self.begin.pop()
            else:
                for hook in self.hooks:
                    hook.begin(len(self.begin))
            self.begin.append(time.perf_counter())

        def on_step_begin(self, args, state, control, **kwargs):
            if len(self.begin) == len(self.end):  # not started at the batch fetch
                self.start()

        def on_step_end(self, args, state, control, **kwargs):
            sync()
            self.end.append(time.perf_counter())
            for hook in self.hooks:
                hook.end(len(self.end) - 1, self.end[-1] - self.begin[-1])

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                self.logs.append({"step": state.global_step, **{k: float(v) for k, v in logs.items()
                                                                  if isinstance(v, (int, float))}})

    return StepTimer()


def steady(begin: list[float], end: list[float], warmup: int, timed: int) -> dict:
    """The timed steps `[warmup, warmup + timed)`: their times, median, total, and the loop
    times (between successive step ends, which adds data loading and logging).

    Raises:
        RuntimeError: fewer steps were timed than asked for.
    """
    stop = warmup + timed
    if len(begin) < stop or len(end) < stop:
        raise RuntimeError(f"expected at least {stop} steps, timed {len(begin)} begins / {len(end)} ends")
    steps = [e - b for b, e in zip(begin[warmup:stop], end[warmup:stop])]
    loops = [end[i] - end[i - 1] for i in range(max(warmup, 1), stop)] or steps
    return {"step_times": steps, "median_step_s": statistics.median(steps), "total_step_s": sum(steps),
            "median_loop_s": statistics.median(loops)}


def time_from_batch_fetch(trainer, timer) -> None:
    """Starts each step of `timer` (a `step_timer`) when `trainer` fetches its micro-batches."""
    fetch = trainer.get_batch_samples

    def timed_fetch(*args, **kwargs):
        timer.start()
        return fetch(*args, **kwargs)

    trainer.get_batch_samples = timed_fetch
