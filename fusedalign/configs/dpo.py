"""DPOConfig: the arguments of `fusedalign dpo` and `DPOTrainer`."""

from __future__ import annotations

from dataclasses import dataclass, field

from fusedalign.configs.common import FusedAlignConfig
from fusedalign.losses import check_dpo_args


@dataclass
class DPOConfig(FusedAlignConfig):
    """Direct Preference Optimization (Rafailov et al., 2023) and its variants."""

    output_dir: str | None = field(default="outputs/dpo")
    learning_rate: float = field(default=1e-6)
    beta: float = field(default=0.1, metadata={"help": "Temperature of the implicit reward; > 0."})
    loss_type: list[str] = field(
        default_factory=lambda: ["sigmoid"],
        metadata={"help": "One or more of: " + "sigmoid, robust, hinge, ipo, exo_pair, nca_pair, bco_pair, "
                  "sppo_hard, aot, aot_pair, apo_zero, apo_down, discopop, sft."},
    )
    loss_weights: list[float] | None = field(default=None, metadata={"help": "Weight of each loss_type."})
    label_smoothing: float = field(default=0.0)
    discopop_tau: float = field(default=0.05)
    max_prompt_length: int | None = field(default=512)
    truncation_mode: str = field(default="keep_end", metadata={"help": "keep_end or keep_start (for completions)."})
    precompute_ref_log_probs: bool = field(default=False)
    reference_free: bool = field(default=False)
    ref_model_name_or_path: str | None = field(default=None, metadata={"help": "Default: the policy's own path."})
    loss_aware_head: bool = field(
        default=True,
        metadata={"help": "With the fused head, form the head's gradient in its forward from the DPO loss (the "
                  "reference runs first): three logits GEMMs instead of four, at the cost of one pair's logits "
                  "(a block of whole pairs) held during the head's forward. Every loss type but aot, aot_pair "
                  "and bco_pair. Same result; false runs the per-token op."},
    )

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.loss_type, str):
            self.loss_type = [self.loss_type]
        if self.beta <= 0:
            raise ValueError(f"beta must be > 0 (the scale of the implicit reward), got {self.beta}.")
        # Every other loss option is checked by the loss module itself, before any model loads.
        check_dpo_args(self.loss_type, beta=self.beta, label_smoothing=self.label_smoothing, loss_weights=self.loss_weights)
        if self.truncation_mode not in ("keep_end", "keep_start"):
            raise ValueError(f"truncation_mode must be 'keep_end' or 'keep_start', got {self.truncation_mode!r}.")
        if self.loss_weights is not None and len(self.loss_weights) != len(self.loss_type):
            raise ValueError(
                f"loss_weights has {len(self.loss_weights)} values but loss_type has {len(self.loss_type)} "
                f"({self.loss_type}); give one weight per loss type."
            )
