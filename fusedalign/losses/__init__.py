"""Losses as pure functions of log-probs: no model, no I/O, no rank, no backend.

Each loss returns per-example losses (or, for SFT, a sum already divided by a global token
count); batch statistics come back as detached sums with counts, for the trainer to
all-reduce (sum) and divide once.
"""

from .dpo import DPO_LOSSES, DPOLossOutput, check_dpo_args, dpo_losses, pairwise_dpo_losses
from .dpo_metrics import DPOMetrics, RewardMean, bco_reward_mean, dpo_metrics
from .kto import KTO_LOSSES, KTOLossOutput, check_kto_args, kto_losses
from .kto_stats import KLSums, KTOMetrics, kl_estimate, kl_from_sums, kl_sums, kto_metrics
from .grpo import GRPO_POLICY_TERMS, GRPOLossOutput, count_items, entropy_threshold, entropy_weight, grpo_loss, high_entropy_mask
from .grpo_advantages import Advantages, group_advantages
from .grpo_metrics import GRPOLossMetrics, RewardMetrics
from .grpo_policy import LOSS_TYPES as GRPO_LOSS_TYPES
from .grpo_policy import GRPOOptions
from .sft import SFTMetrics, sft_loss, sft_metrics

__all__ = [
    "DPO_LOSSES", "DPOLossOutput", "DPOMetrics", "KLSums", "KTO_LOSSES", "KTOLossOutput",
    "KTOMetrics", "RewardMean", "SFTMetrics", "bco_reward_mean", "check_dpo_args",
    "check_kto_args", "dpo_losses", "dpo_metrics", "kl_estimate", "kl_from_sums", "kl_sums",
    "kto_losses", "kto_metrics", "pairwise_dpo_losses", "sft_loss", "sft_metrics",
    # GRPO
    "Advantages", "GRPOLossMetrics", "GRPOLossOutput", "GRPOOptions", "GRPO_LOSS_TYPES", "GRPO_POLICY_TERMS",
    "RewardMetrics", "count_items", "entropy_threshold", "entropy_weight", "group_advantages", "grpo_loss",
    "high_entropy_mask",
]
