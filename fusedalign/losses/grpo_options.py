"""Every non-tensor option of the GRPO loss, checked once (TRL 1.16's GRPOConfig names and defaults)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
CLIPPED = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")  # the PPO-clip family
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")


@dataclass(frozen=True)
class GRPOOptions:
    """Every non-tensor option of the GRPO loss (names and defaults of TRL 1.16's GRPOConfig).

    Attributes:
        max_completion_length: dr_grpo's constant normaliser (required for dr_grpo).
        epsilon_high: None means epsilon. For cispo it is the cap on the ratio (ScaleRL: 5.0).
        delta: two-sided clip (INTELLECT-2): the unclipped ratio is capped at delta.
    """

    loss_type: str = "dapo"
    importance_sampling_level: str = "token"
    epsilon: float = 0.2
    epsilon_high: float | None = None
    delta: float | None = None
    beta: float = 0.0
    use_bias_correction_kl: bool = True
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    max_completion_length: int | None = None

    def __post_init__(self):
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {', '.join(LOSS_TYPES)}; got {self.loss_type!r}")
        if self.importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
            raise ValueError(
                f"importance_sampling_level must be 'token' or 'sequence'; got {self.importance_sampling_level!r}"
            )
        if self.loss_type == "dr_grpo" and not self.max_completion_length:
            raise ValueError("loss_type='dr_grpo' needs max_completion_length (its constant normaliser)")

    @property
    def epsilon_low(self) -> float:
        return self.epsilon

    @property
    def eps_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    @classmethod
    def from_args(cls, args: Any) -> "GRPOOptions":
        """The options named like fields of `args` (a GRPOConfig)."""
        return cls(**{f: getattr(args, f) for f in cls.__dataclass_fields__ if hasattr(args, f)})
