"""A tiny reward model for tests: a seeded random Qwen2 classifier (one label) with the tiny tokenizer."""

from __future__ import annotations

import os
from pathlib import Path

import torch

# Where the distributed runner finds the reward model the test process saved (tests/distributed).
REWARD_MODEL_ENV = "FUSEDALIGN_TEST_REWARD_MODEL"


def save_tiny_reward_model(path: str | os.PathLike) -> Path:
    """Builds the classifier from builtin:tiny-qwen2's config (seed 0) and saves it and the tokenizer at `path`.

    Built in one plain process: under ZeRO-3, transformers would partition a model built there, and
    under any backend it writes from rank 0 only.
    """
    from transformers import AutoConfig, Qwen2ForSequenceClassification

    from fusedalign.models import load_tokenizer, resolve_model_path

    base, path = resolve_model_path("builtin:tiny-qwen2"), Path(path)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = Qwen2ForSequenceClassification(AutoConfig.from_pretrained(base, num_labels=1))
    model.save_pretrained(path)
    load_tokenizer(base).save_pretrained(path)
    return path
