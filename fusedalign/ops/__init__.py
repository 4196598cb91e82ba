"""Per-token log-probs from hidden states through the output head, never materialising N x V.

The only place in fusedalign that computes log-probs from hidden states; see
docs/internals.md for the contract.
"""

from fusedalign.ops.api import head_logprobs, reference_head_logprobs
from fusedalign.ops.blocks import BlockForward, BlockMath
from fusedalign.ops.divergence import DivergenceOutput
from fusedalign.ops.divergence_api import divergence_head, generalised_jsd
from fusedalign.ops.loss_aware import DeclaredLossMismatch
from fusedalign.ops.options import HeadOptions, HeadOutput, LowRank, SequenceLoss
from fusedalign.ops.registry import (
    Backend,
    BackendUnavailableError,
    known_backends,
    register_backend,
)

__all__ = [
    "Backend",
    "BackendUnavailableError",
    "BlockForward",
    "BlockMath",
    "DeclaredLossMismatch",
    "DivergenceOutput",
    "HeadOptions",
    "HeadOutput",
    "LowRank",
    "SequenceLoss",
    "divergence_head",
    "generalised_jsd",
    "head_logprobs",
    "known_backends",
    "reference_head_logprobs",
    "register_backend",
]
