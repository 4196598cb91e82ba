"""KTOConfig: the arguments of `fusedalign kto` and `KTOTrainer`."""

from __future__ import annotations

from dataclasses import dataclass, field

from fusedalign.configs.common import FusedAlignConfig
from fusedalign.losses import KTO_LOSSES, check_kto_args


@dataclass
class KTOConfig(FusedAlignConfig):
    """Kahneman-Tversky Optimization (Ethayarajh et al., 2024) on unpaired preference data.

    KTO has no reference-free mode: its implied reward is log pi(y|x) - log pi_ref(y|x)
    and its reference point z0 is a KL divergence from the reference, so both need a
    reference model (a separate one, or the policy with its PEFT adapter disabled, or
    reference log-probs precomputed before training).
    """

    output_dir: str | None = field(default="outputs/kto")
    learning_rate: float = field(default=1e-6)
    beta: float = field(default=0.1, metadata={"help": "Temperature of the implied reward; > 0."})
    desirable_weight: float = field(
        default=1.0,
        metadata={"help": "Weight of the losses of desirable examples (lambda_D). With unbalanced classes, "
                  "keep (desirable_weight * n_desirable) / (undesirable_weight * n_undesirable) in [1, 4/3]."},
    )
    undesirable_weight: float = field(default=1.0, metadata={"help": "Weight of the losses of undesirable examples (lambda_U)."})
    loss_type: str = field(default="kto", metadata={"help": "One of: " + ", ".join(KTO_LOSSES) + "."})
    max_prompt_length: int | None = field(default=512)
    max_completion_length: int | None = field(default=None)
    truncation_mode: str = field(default="keep_end", metadata={"help": "keep_end or keep_start (for completions)."})
    precompute_ref_log_probs: bool = field(
        default=False,
        metadata={"help": "Compute the reference log-probs of every row (its completion and its KL pair) in one "
                  "pass before they are needed, and drop the reference forward from training."},
    )
    ref_model_name_or_path: str | None = field(default=None, metadata={"help": "Default: the policy's own path."})
    unpair_preference: bool = field(
        default=False,
        metadata={"help": "Accept paired preference data (prompt/chosen/rejected) and train on it unpaired: "
                  "each pair becomes a desirable and an undesirable example."},
    )

    def __post_init__(self):
        super().__post_init__()
        check_kto_args(
            self.loss_type, beta=self.beta, desirable_weight=self.desirable_weight,
            undesirable_weight=self.undesirable_weight,
        )
        if self.truncation_mode not in ("keep_end", "keep_start"):
            raise ValueError(f"truncation_mode must be 'keep_end' or 'keep_start', got {self.truncation_mode!r}.")

    @property
    def uses_kl(self) -> bool:
        """Whether the loss needs the KL reference point z0 (apo_zero_unpaired does not)."""
        return self.loss_type == "kto"
