"""Each decoder layer's MLP over tiles of tokens (`--tiled_mlp_tokens`): its activations one tile at a time.

Why: at long rows the MLP's intermediates are most of what a decoder layer keeps for its
backward (Qwen2.5-0.5B: gate, up, their product and SiLU, 4 x 4,864 values a token, about
38 KiB in bf16, against 1.75 KiB for the layer's input). With gradient checkpointing one
layer's recompute holds them for every token of the micro-batch; without it every layer does.
The MLP acts on each token alone, so it can run over consecutive tiles of tokens, each under
its own (non-reentrant) checkpoint: the forward keeps only each tile's input, a view of the
layer's own tensor, and the backward recomputes one tile's intermediates at a time. Without
gradients (the reference's and the teacher's passes, evaluation) tiling alone bounds the
intermediates' transient memory the same way. This is the tiled MLP of Arctic Long Sequence
Training (arXiv 2506.13996), built here from plain `torch.utils.checkpoint`, so that the
gradients flow through the ordinary autograd graph: DDP's and DeepSpeed's gradient hooks and
FSDP2's reshard see one gradient a parameter, summed over the tiles, as without tiling. Under
ZeRO-3, which gathers a module's weights at each of its calls, the MLP's weights are gathered
once for all its tiles (`distributed.gather_once_per_call`), since ranks run different numbers of
tiles; FSDP2 gathers a whole decoder layer at once, so the tiles inside it are plain calls.

The cost: each tile's MLP runs forward once more in the backward (with gradient checkpointing
on, twice more). The result equals the untiled MLP's up to the rounding of smaller matmuls.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from fusedalign.backbone import decoder_layers
from fusedalign.distributed import gather_once_per_call
from fusedalign.head import unwrap_model

# Modules whose output for a token depends on more than that token's hidden state (a router's
# load-balancing statistics, expert capacity), so that tiling would change the computation.
_NOT_TOKENWISE = ("moe", "sparse", "expert", "router")


def _tiled_forward(forward: Callable[[torch.Tensor], torch.Tensor], tokens: int, hidden: torch.Tensor) -> torch.Tensor:
    """`forward` (a token-wise MLP) over consecutive tiles of at most `tokens` tokens.

    Args:
        forward: the MLP's own forward, `[..., H] -> [..., H]`.
        tokens: tokens a tile.
        hidden: `[..., H]`, any leading shape (`[B, T, H]`, or `[1, T, H]` for packed rows).
    """
    flat = hidden.reshape(-1, hidden.shape[-1])  # [N, H]
    if flat.shape[0] <= tokens:
        return forward(hidden)
    # `split`'s backward joins the tiles' gradients once; slicing would allocate a zero-filled
    # gradient of the whole input for every tile.
    tiles = flat.split(tokens)
    if torch.is_grad_enabled():
        outs = [checkpoint(forward, tile, use_reentrant=False) for tile in tiles]
    else:
        outs = [forward(tile) for tile in tiles]
    out = torch.cat(outs)  # [N, H_out]
    return out.view(*hidden.shape[:-1], out.shape[-1])


def _mlp_of(layer: nn.Module) -> nn.Module:
    mlp = getattr(layer, "mlp", None)
    name = type(mlp).__name__
    if not isinstance(mlp, nn.Module) or any(word in name.lower() for word in _NOT_TOKENWISE) or hasattr(mlp, "experts"):
        raise ValueError(
            f"--tiled_mlp_tokens: {type(layer).__name__} has no dense token-wise MLP at .mlp (found "
            f"{name if mlp is not None else 'none'}); tiling is only exact for a dense MLP. Leave it at 0 for this model."
        )
    return mlp


def tile_mlps(model: nn.Module, tokens: int) -> int:
    """Runs each decoder layer's MLP over tiles of at most `tokens` tokens, in place.

    Args:
        model: the model (under PEFT or other wrappers is fine).
        tokens: tokens a tile, >= 1.

    Returns:
        How many MLPs were tiled (a second call on the same model changes nothing and returns 0).

    Raises:
        ValueError: for `tokens` < 1, a model without decoder layers, or a layer whose `.mlp`
            is not a dense token-wise MLP (mixture-of-experts routers are not).
    """
    if tokens < 1:
        raise ValueError(f"--tiled_mlp_tokens must be >= 1 to tile (0 leaves the MLPs whole); got {tokens}.")
    layers = decoder_layers(model)
    if not layers:
        raise ValueError(
            f"--tiled_mlp_tokens: found no decoder layer (transformers GradientCheckpointingLayer) in "
            f"{type(unwrap_model(model)).__name__}; leave it at 0 for this model."
        )
    tiled = 0
    for mlp in map(_mlp_of, layers):
        if getattr(mlp, "_fusedalign_tile_tokens", None) is None:
            # The instance's own attribute: the class, shared with other models, is untouched.
            mlp.forward = functools.partial(_tiled_forward, mlp.forward, tokens)
            mlp._fusedalign_tile_tokens = tokens
            # ZeRO-3 gathers at each call of a child, and ranks run different numbers of tiles.
            gather_once_per_call(mlp)
            tiled += 1
    return tiled
