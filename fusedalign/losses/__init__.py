"""Losses as pure functions of log-probs: no model, no I/O, no rank, no backend.

Each loss returns per-example losses (or, for SFT, a sum already divided by a global token
count); batch statistics come back as detached sums with counts, for the trainer to
all-reduce (sum) and divide once.
"""

from .dpo import DPO_LOSSES, DPOLossOutput, check_dpo_args, dpo_losses, pairwise_dpo_losses
from .dpo_metrics import DPOMetrics, RewardMean, bco_reward_mean, dpo_metrics
from .kto import KTO_LOSSES, KTOLossOutput, check_kto_args, kto_losses
from .kto_stats import KLSums, KTOMetrics, kl_estimate, kl_from_sums, kl_sums, kto_metrics
from .sft import SFTMetrics, sft_loss, sft_metrics

__all__ = [
    "DPO_LOSSES", "DPOLossOutput", "DPOMetrics", "KLSums", "KTO_LOSSES", "KTOLossOutput",
    "KTOMetrics", "RewardMean", "SFTMetrics", "bco_reward_mean", "check_dpo_args",
    "check_kto_args", "dpo_losses", "dpo_metrics", "kl_estimate", "kl_from_sums", "kl_sums",
    "kto_losses", "kto_metrics", "pairwise_dpo_losses", "sft_loss", "sft_metrics",
]
