"""The floor of a GRPO step: the least time any trainer could take for one step's work on a GPU,
if every part ran at the datasheet's bandwidth or dense bf16 throughput, whichever binds.

A step of p prompts of P tokens, G completions each of C tokens (R = p G rows), for a dense
decoder of N parameters (a tied head counted once: it is read, and multiplied, every token), L
layers, h query heads of size d, g key/value heads, e bytes a value:

    prefill   2 N x prompt tokens                                          flops
    decode    per step k = 1 .. C-1: max(bytes / bandwidth, flops / peak), with
              bytes = N e + (cached tokens) 2 L g d e,  flops = 2 R N + 4 R (P + k) L h d
    training  6 N x trained tokens + 12 L h d x (sum over trained tokens of the context attended)
    forwards  2 N x trained tokens + 4 L h d x (that sum), for each extra forward-only pass
              (the reference model with beta > 0, the old policy with num_iterations > 1)

With `prompt_once` (the least work: any trainer must at least do this) a group's prompt is
prefilled, cached, read and trained once, and its G completions attend to it; without, every row
carries its own copy, as a padded trainer computes it. Nothing else is counted: no optimizer, no
loss, no sampling, no launches, no host, no rewards. A step that takes T seconds is at least
T / floor times slower than the hardware allows, so a speed-up target of k over a step of T
seconds is out of reach on that GPU when T / k is below the floor.
"""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.harness.decode_limit import Peaks, Shape, step_seconds


@dataclass(frozen=True)
class StepWork:
    """One GRPO step's work: `prompts` x `generations` rows of `prompt_length` + `completion_length`."""

    prompts: int
    generations: int
    prompt_length: int
    completion_length: int
    prompt_once: bool = True
    extra_forwards: int = 0

    @property
    def rows(self) -> int:
        return self.prompts * self.generations

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens prefilled and trained: once a group, or once a row."""
        return self.prompt_length * (self.prompts if self.prompt_once else self.rows)

    @property
    def trained_tokens(self) -> int:
        return self.prompt_tokens + self.rows * self.completion_length

    @property
    def attended(self) -> int:
        """Sum over trained tokens of the context each attends to, itself included (causal)."""
        P, C = self.prompt_length, self.completion_length
        prompt = P * (P + 1) // 2  # one prompt's tokens: 1 .. P
        completion = C * P + C * (C + 1) // 2  # one completion's tokens: P + 1 .. P + C
        return prompt * (self.prompts if self.prompt_once else self.rows) + completion * self.rows


@dataclass(frozen=True)
class StepFloor:
    """Seconds each part of a step takes at the floor, and their sum."""

    prefill_s: float
    decode_s: float
    training_s: float
    forwards_s: float

    @property
    def total_s(self) -> float:
        return self.prefill_s + self.decode_s + self.training_s + self.forwards_s


def step_floor(shape: Shape, peaks: Peaks, work: StepWork) -> StepFloor:
    """The floor of each part of one step of `work` for a model of `shape` on a GPU of `peaks`."""
    s, flop_s = shape, peaks.tflops * 1e12
    attention = s.layers * s.heads * s.head_dim  # flops per attended token are 4x this forward
    prefill = 2 * s.params * work.prompt_tokens / flop_s
    # The prefill drew token 0; step k draws token k, reading each row's own k tokens and the
    # prompts' cache (once a group, or a copy a row).
    decode = sum(step_seconds(s, peaks, work.rows, work.prompt_length + k, work.prompt_tokens + work.rows * k)
                 for k in range(1, work.completion_length))
    forward = 2 * s.params * work.trained_tokens + 4 * attention * work.attended
    return StepFloor(prefill, decode, 3 * forward / flop_s, work.extra_forwards * forward / flop_s)
