"""Configuration dataclasses (one file per trainer). Flag names follow TRL where the meaning is the same."""

from fusedalign.configs.common import FusedAlignConfig, ModelArguments, ScriptArguments
from fusedalign.configs.dpo import DPOConfig

__all__ = ["DPOConfig", "FusedAlignConfig", "ModelArguments", "ScriptArguments"]
