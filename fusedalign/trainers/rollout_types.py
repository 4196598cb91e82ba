"""The typed pieces GRPO's rollout (`grpo_rollout.py`) takes and gives: a generation's completion
metrics, the training window it serves, what it knows of a prompt split, and the strategy that
turns rewards into advantages (GRPO's group-relative one here; RLOO's in `rloo.py`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch

from fusedalign.losses import Advantages, group_advantages
from fusedalign.metrics import Max, Mean, MetricSet, Min, logged_as
from fusedalign.trainers.grpo_batch import GRPOMicroBatch


@dataclass(frozen=True)
class CompletionMetrics(MetricSet):
    """Completion lengths (tokens) and the share truncated, per completion, as TRL names them."""

    mean_length: Mean = logged_as("completions/mean_length")
    min_length: Min = logged_as("completions/min_length")
    max_length: Max = logged_as("completions/max_length")
    clipped_ratio: Mean = logged_as("completions/clipped_ratio")
    mean_terminated_length: Mean = logged_as("completions/mean_terminated_length")
    min_terminated_length: Min = logged_as("completions/min_terminated_length")
    max_terminated_length: Max = logged_as("completions/max_terminated_length")
    generation_time: Mean | None = logged_as("generation_time")  # seconds a generation, mean over ranks

    # A window in which no completion ended (all truncated) logs 0 for them, as TRL does.
    derived = {name: (lambda logged, name=name: logged.get(name, 0.0) if "completions/mean_length" in logged
                      else logged[name])
               for name in ("completions/mean_terminated_length", "completions/min_terminated_length",
                            "completions/max_terminated_length")}

    @classmethod
    def of(cls, lengths: torch.Tensor, truncated: torch.Tensor, seconds: float | None = None) -> "CompletionMetrics":
        """From one generation's completion lengths [n], truncation flags [n] and wall time on this rank."""
        n, t = lengths.double(), truncated.bool()
        one, done = torch.ones_like(n), (~t).double()
        inf = torch.full_like(n, float("inf"))
        # Per completion (evaluation drops repeated rows): 1/n of the rank's time, counted 1/n.
        share = torch.full_like(n, 1.0 / max(len(n), 1))
        return cls(
            Mean(n, one), Min(n), Max(n), Mean(t.double(), one), Mean(n * done, done),
            Min(torch.where(t, inf, n)), Max(torch.where(t, -inf, n)),
            None if seconds is None else Mean(share * seconds, share),
        )


@dataclass(frozen=True)
class StepTime(MetricSet):
    """Seconds from the start of an optimizer step (its generation included) to its last backward, as TRL's."""

    step_time: Mean = logged_as("step_time")


@dataclass
class Window:
    """The micro-batches of one training generation window, served in order, each `uses` times."""

    batches: list[GRPOMicroBatch]
    uses: int
    served: int = 0

    @property
    def exhausted(self) -> bool:
        return self.served >= len(self.batches) * self.uses

    def next(self) -> GRPOMicroBatch:
        batch = self.batches[self.served % len(self.batches)]
        self.served += 1
        return batch

    @property
    def last_was_first_use(self) -> bool:
        """Whether the micro-batch `next` last gave was served for the first time (not a later iteration)."""
        return 0 < self.served <= len(self.batches)


@dataclass(frozen=True)
class Split:
    """What the rollout needs to know of a prompt split: its format."""

    conversational: bool


Scorer = Callable[[Any, dict, torch.Tensor], torch.Tensor]  # (model, inputs, labels) -> logps [b, T]


class AdvantageStrategy(Protocol):
    """Advantages of a generation batch: (rewards [N, K], weights [K], G, sequence KL [N] or None) -> Advantages.

    `kl_in_reward`: the strategy takes each completion's summed KL to the reference (policy minus
    reference log-probs over its loss tokens, at generation) when beta != 0; None otherwise.
    """

    kl_in_reward: bool

    def __call__(self, rewards: torch.Tensor, weights: torch.Tensor, num_generations: int,
                 sequence_kl: torch.Tensor | None) -> Advantages: ...


@dataclass(frozen=True)
class GroupAdvantages:
    """GRPO's group-relative advantages (`losses.group_advantages`); the KL stays in the loss."""

    scale_rewards: str
    aggregation: str
    kl_in_reward: bool = False

    def __call__(self, rewards, weights, num_generations, sequence_kl=None) -> Advantages:
        return group_advantages(rewards, weights, num_generations, self.scale_rewards, self.aggregation)
