"""Each decoder layer's projections that read the same input, as one GEMM while decoding.

A decoding step at batch 512 runs seven small GEMMs per layer (q, k, v, o, gate, up, down),
each a few microseconds of weights read at M = 512 rows, latency-bound rather than
bandwidth-bound (170 GEMM launches took 1.45 ms of the 0.5B shape's eager forward on an
H100, for 0.72 GB of layer weights that the bandwidth reads in 0.21 ms). q, k and v read the
same hidden states, as do gate and up: concatenated, they are two GEMMs instead of five.
Neither transformers nor inductor does this (inductor's concat-linear pass runs only with
frozen weights, which a policy that trains cannot have).

`fused_projections(lm)` installs the fusion for the length of a generation call, where the
weights are whole and do not change (the trainer updates them between generations):

- an MLP of the gated form `down(act(gate(x)) * up(x))` computes gate and up as one GEMM
  against `cat([W_gate, W_up])`, split after;
- an attention computes q, k and v as one GEMM against `cat([W_q, W_k, W_v])` (and the
  biases alike) when its q projection is called; its k and v projections, called next on
  the same hidden states, return their slices of that product.

Only classes whose forward is known to take that form are fused (`MLP_CLASSES`,
`ATTENTION_CLASSES`), and only plain `nn.Linear` projections without hooks of their own (a
LoRA layer or a quantised one is left as it is). The concatenated weights are copies made at
each module's first call in the block (about 0.47 GB for Qwen2.5-0.5B in bf16; under FSDP2
the weights are whole only from then, under ZeRO-3 for the whole generation) and dropped on
exit; every module is as it was after the block, even on an error. Each output element is the
same dot product as before; a different GEMM kernel may sum it in another order, so the
logits can differ from the unfused ones in the last bits (tests hold them within float
tolerance and the tokens equal).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# Forwards of the form the fusion assumes, by class name (transformers' modeling files):
# MLP: down_proj(act_fn(gate_proj(x)) * up_proj(x)); attention: q_proj, k_proj and v_proj each
# applied once, in that order, to the same hidden states.
MLP_CLASSES = frozenset({"LlamaMLP", "Qwen2MLP", "Qwen3MLP", "MistralMLP", "GemmaMLP", "Gemma2MLP"})
ATTENTION_CLASSES = frozenset({"LlamaAttention", "Qwen2Attention", "Qwen3Attention", "MistralAttention",
                               "GemmaAttention", "Gemma2Attention"})


@dataclass(frozen=True)
class FusedCount:
    """What `fused_projections` fused: MLPs (gate + up) and attentions (q + k + v)."""

    mlps: int
    attentions: int


def _plain(*linears: nn.Module) -> bool:
    """Plain nn.Linear layers over the same input size, without hooks, biases all present or all absent."""
    if not all(type(m) is nn.Linear for m in linears):
        return False
    if any(m._forward_hooks or m._forward_pre_hooks for m in linears):
        return False
    if len({m.in_features for m in linears}) != 1 or len({m.weight.dtype for m in linears}) != 1:
        return False
    return len({m.bias is None for m in linears}) == 1


def _concat(linears: tuple[nn.Linear, ...]) -> tuple[Tensor, Tensor | None]:
    """The layers' weights [sum(out), in] and biases [sum(out)] (or None), concatenated."""
    weight = torch.cat([m.weight.detach() for m in linears])
    bias = None if linears[0].bias is None else torch.cat([m.bias.detach() for m in linears])
    return weight, bias


class _Concatenated:
    """The layers' weights and biases concatenated, made at the first call: under FSDP2 the weights
    are whole only inside the forward (its hooks unshard each layer as it runs), and the first call
    of a generation is its prefill, eager, before any step is compiled or captured."""

    def __init__(self, linears: tuple[nn.Linear, ...]):
        self.linears = linears
        self.weight: Tensor | None = None
        self.bias: Tensor | None = None

    def __call__(self, x: Tensor) -> Tensor:
        if self.weight is None:
            self.weight, self.bias = _concat(self.linears)
        return F.linear(x, self.weight, self.bias)


def _fuse_mlp(mlp: nn.Module) -> bool:
    linears = (mlp.gate_proj, mlp.up_proj)
    if not _plain(*linears):
        return False
    product = _Concatenated(linears)
    width = mlp.gate_proj.out_features

    def forward(x: Tensor) -> Tensor:
        gate, up = product(x).split([width, width], dim=-1)  # [..., I] each
        return mlp.down_proj(mlp.act_fn(gate) * up)

    mlp.forward = forward  # an instance attribute: nn.Module.__call__ finds it before the class's
    return True


class _SharedProduct:
    """q, k and v of one attention from one GEMM: the q projection computes it, k and v take their slices."""

    def __init__(self, linears: tuple[nn.Linear, ...]):
        self.product = _Concatenated(linears)
        self.widths = [m.out_features for m in linears]
        self.pending: list[Tensor] | None = None  # k and v of the last product, until taken


class _Slice(nn.Module):
    """Stands in for one of q_proj, k_proj, v_proj while fused."""

    def __init__(self, shared: _SharedProduct, index: int, original: nn.Linear):
        super().__init__()
        self.shared, self.index = shared, index
        self.original = [original]  # in a list: not a submodule (its parameters stay where they were)

    def forward(self, x: Tensor) -> Tensor:
        shared = self.shared
        if self.index == 0:
            q, k, v = shared.product(x).split(shared.widths, dim=-1)
            shared.pending = [k, v]
            return q
        if shared.pending is None or shared.pending[self.index - 1] is None:
            return self.original[0](x)  # not called after q on these states: the projection as it is
        out = shared.pending[self.index - 1]
        shared.pending[self.index - 1] = None
        if self.index == 2:
            shared.pending = None
        return out


def _fuse_attention(attention: nn.Module) -> list[tuple[nn.Module, str, nn.Module]] | None:
    linears = (attention.q_proj, attention.k_proj, attention.v_proj)
    if not _plain(*linears):
        return None
    shared = _SharedProduct(linears)
    swapped = []
    for index, (name, linear) in enumerate(zip(("q_proj", "k_proj", "v_proj"), linears)):
        setattr(attention, name, _Slice(shared, index, linear))
        swapped.append((attention, name, linear))
    return swapped


@contextlib.contextmanager
def fused_projections(lm: nn.Module) -> Iterator[FusedCount]:
    """Inside the block, `lm`'s MLPs and attentions of the known forms compute their projections
    that share an input as one GEMM (module docstring); after it every module is as before.
    Yields what was fused."""
    mlps: list[nn.Module] = []
    swapped: list[tuple[nn.Module, str, nn.Module]] = []
    try:
        with torch.no_grad():
            for module in list(lm.modules()):
                kind = type(module).__name__
                if kind in MLP_CLASSES and "forward" not in vars(module) and _fuse_mlp(module):
                    mlps.append(module)
                elif kind in ATTENTION_CLASSES:
                    done = _fuse_attention(module)
                    if done:
                        swapped += done
        yield FusedCount(mlps=len(mlps), attentions=len(swapped) // 3)
    finally:
        for mlp in mlps:
            del mlp.forward
        for attention, name, linear in swapped:
            setattr(attention, name, linear)
