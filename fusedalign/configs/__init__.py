"""Configuration dataclasses (one file per trainer). Flag names follow TRL where the meaning is the same."""

from fusedalign.configs.common import FusedAlignConfig, ModelArguments, ScriptArguments
from fusedalign.configs.distillation import DistillationConfig
from fusedalign.configs.dpo import DPOConfig
from fusedalign.configs.grpo import GRPOConfig
from fusedalign.configs.kto import KTOConfig
from fusedalign.configs.rloo import RLOOConfig
from fusedalign.configs.sft import SFTConfig

__all__ = ["DistillationConfig", "DPOConfig", "FusedAlignConfig", "GRPOConfig", "KTOConfig", "ModelArguments", "RLOOConfig", "SFTConfig", "ScriptArguments"]
