"""Losses as pure functions of log-probs: no model, no I/O, no rank, no backend.

Each method has per-example losses (`dpo_losses`, `kto_losses`, ...) and a micro-batch
function that returns `(sum of the batch's losses, metrics)` for the trainers
(`dpo_batch_loss`, `kto_batch_loss`, `sft_batch_loss`); metrics are typed
(`fusedalign.metrics`): each field declares how it reduces over ranks, micro-batches and
logging windows. Options are validated once, by the configs (`check_*_args`).
"""

from .dpo import DPO_LOSSES, DPOLossOutput, check_dpo_args, dpo_losses, pair_losses, pairwise_dpo_losses
from .dpo_batch import dpo_batch_loss, pair_loss_gradient, valid_pairs
from .dpo_fdiv import F_DIVERGENCE_LOSS_TYPES, F_DIVERGENCES
from .dpo_length import WeightedSums, ld_weighted
from .dpo_weighting import wpo_weights
from .dpo_metrics import DPOMetrics, RewardMean, RunningRewardMean, bco_reward_mean, dpo_metrics
from .dpo_types import DPOOptions, PairLogps
from .distillation import DistillationMetrics, distillation_batch_loss, distillation_loss
from .grpo import (
    GRPO_POLICY_TERMS,
    GRPOLossOutput,
    count_items,
    entropy_threshold,
    entropy_weight,
    grpo_loss,
    high_entropy_mask,
)
from .grpo_advantages import Advantages, group_advantages
from .grpo_metrics import GRPOLossMetrics, RewardMetrics
from .grpo_policy import LOSS_TYPES as GRPO_LOSS_TYPES
from .grpo_policy import GRPOOptions
from .rloo import RLOOLossOutput, rloo_advantages, rloo_loss
from .kto import KTO_LOSSES, KTOLossOutput, KTOOptions, check_kto_args, kto_batch_loss, kto_losses
from .kto_stats import KLSums, KTOMetrics, kl_estimate, kl_from_sums, kl_sums, kto_metrics
from .sft import SFTMetrics, sft_batch_loss, sft_loss, sft_metrics

__all__ = [
    "DPO_LOSSES", "DPOLossOutput", "DPOMetrics", "DPOOptions", "F_DIVERGENCES", "F_DIVERGENCE_LOSS_TYPES", "KLSums",
    "KTO_LOSSES", "KTOLossOutput", "KTOMetrics", "KTOOptions", "PairLogps", "RewardMean", "RunningRewardMean",
    "SFTMetrics", "WeightedSums", "bco_reward_mean", "check_dpo_args", "check_kto_args", "dpo_batch_loss",
    "dpo_losses", "dpo_metrics", "kl_estimate", "kl_from_sums", "kl_sums", "kto_batch_loss", "kto_losses",
    "kto_metrics", "ld_weighted", "pair_loss_gradient", "pair_losses", "pairwise_dpo_losses", "sft_batch_loss",
    "sft_loss", "sft_metrics", "valid_pairs", "wpo_weights",
    # distillation
    "DistillationMetrics", "distillation_batch_loss", "distillation_loss",
    # GRPO
    "Advantages", "GRPOLossMetrics", "GRPOLossOutput", "GRPOOptions", "GRPO_LOSS_TYPES", "GRPO_POLICY_TERMS",
    "RewardMetrics", "count_items", "entropy_threshold", "entropy_weight", "group_advantages", "grpo_loss",
    "high_entropy_mask",
    # RLOO
    "RLOOLossOutput", "rloo_advantages", "rloo_loss",
]
