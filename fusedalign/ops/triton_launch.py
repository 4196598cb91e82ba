"""Launching the head's Triton kernels: their launch shapes, the per-token running state of
`fwd_chunk_kernel`, folding a tile of logits into it, and turning a tile into its gradient.

Shared by the per-token op (`triton_head.py`: vocabulary chunks, row blocks, autograd) and
its loss-aware block math (`TritonBlocks`, there too). The kernels themselves are in
`triton_kernels.py`, imported on first use.
"""

from __future__ import annotations

import math

import torch
import triton
from torch import Tensor

from fusedalign.ops.options import HeadOptions

# Launch shapes (rows per program, columns per program/step, warps), measured on an H200
# (docs/benchmarks.md): 256 columns per row keep each row's reductions inside one warp.
# Not part of the API; `benchmarks/head_kernels.py` sweeps the kernels' shapes directly.
# `benchmarks/head_kernels.py` (H200, 2026-12-02, docs/benchmarks.md, fd4eed5): the backward kernel
# reaches 1.3 TB/s with 2 x 2048 tiles against 0.87-0.98 with 16 x 256, on a vocabulary chunk
# and on a loss-aware block alike; the forward kernel keeps 16 x 256 on chunks, and takes
# 1 x 4096 on a block (0.50 ms against 0.62 for 1 x 2048 and 1.8 for 16 x 256 on one
# [3584, 151936] block), whose few thousand rows would otherwise leave SMs idle.
FWD_CONFIG = (16, 256, 4)
BWD_CONFIG = (2, 2048, 8)
# With a bias gradient the backward writes one fp32 partial column sum per row tile: taller
# tiles keep that buffer small (n / 32 x columns instead of n / 2), at about the same speed.
BWD_BIAS_CONFIG = (32, 256, 8)
# The loss-aware mode folds a block of a few thousand rows over all V columns at once.
BLOCK_FWD_CONFIG = (1, 4096, 8)


def kernels():
    """The kernel module, imported on first use rather than with this one, so that tests
    can choose TRITON_INTERPRET before the kernels are decorated."""
    from fusedalign.ops import triton_kernels

    return triton_kernels


def on_device(t: Tensor):
    """Triton launches on the current CUDA device: make it the tensors' device."""
    return torch.cuda.device(t.device) if t.is_cuda else _Nothing()


class _Nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def launch_shape(config: tuple[int, int, int], n: int, cols: int, cuda: bool) -> tuple[int, int, int]:
    """Launch shape; under the CPU interpreter, shrunk to the (tiny) test problem."""
    if cuda:
        return config
    # The interpreter pays per program and per op, not per element: few, large programs.
    return min(64, triton.next_power_of_2(n)), min(1024, triton.next_power_of_2(cols)), config[2]


_LOG2E = 1.0 / math.log(2.0)
_LN2 = math.log(2.0)


def scalars(opts: HeadOptions) -> tuple[float, float, float, float, float]:
    """(logit_scale, lora scale, softcap, k_u2, k_z2): the kernels work in base 2, with
    y2 = u * k_u2 (no softcap; u = the logits before logit_scale) or z * k_z2."""
    softcap = 1.0 if opts.softcap is None else opts.softcap
    k_z2 = _LOG2E / opts.temperature
    return opts.logit_scale, opts.low_rank_scale, softcap, opts.logit_scale * k_z2, k_z2


def new_state(n: int, opts: HeadOptions, dev: torch.device, lab: Tensor) -> tuple[Tensor, ...]:
    """Per-token running state of `fwd_chunk_kernel`: (m, s, tgt, w, zsum, zmax, amax);
    statistics not asked for alias another buffer (the kernel never touches them)."""
    f32 = torch.float32
    m, s, tgt = (torch.zeros(n, dtype=f32, device=dev) for _ in range(3))
    w = torch.zeros(n, dtype=f32, device=dev) if opts.entropy else m
    zsum = torch.zeros(n, dtype=f32, device=dev) if opts.logit_mean else m
    zmax = torch.zeros(n, dtype=f32, device=dev) if opts.argmax else m
    amax = torch.zeros(n, dtype=torch.int32, device=dev) if opts.argmax else lab
    return m, s, tgt, w, zsum, zmax, amax


def fold(x: Tensor, lx: Tensor | None, bias: Tensor | None, lab: Tensor, state, c0: int,
         opts: HeadOptions, config: tuple[int, int, int]) -> None:
    """Folds the chunk x = [n, C] (columns c0 .. c0 + C of the logits) into `state`."""
    n, cl = x.shape
    br, bc, warps = config
    kernels().fwd_chunk_kernel[(triton.cdiv(n, br),)](
        x, x.stride(0), x if lx is None else lx, cl if lx is None else lx.stride(0),
        x if bias is None else bias, lab, *state,
        n, c0, cl, int(c0 == 0), *scalars(opts),
        HAS_BIAS=bias is not None, HAS_LORA=lx is not None,
        HAS_SOFTCAP=opts.softcap is not None, ENTROPY=opts.entropy,
        MEAN=opts.logit_mean, ARGMAX=opts.argmax, ACCURATE_TANH=x.is_cuda,
        BLOCK_R=br, BLOCK_C=bc, num_warps=warps,
    )


def fill_gradient(x: Tensor, lx: Tensor | None, bias: Tensor | None, lab: Tensor, lse2: Tensor, gs: Tensor,
                  gh: Tensor | None, ent: Tensor | None, dbias: Tensor | None, c0: int, opts: HeadOptions,
                  config: tuple[int, int, int], *, lora_grad: bool) -> None:
    """Overwrites the chunk x = [n, C] (columns c0 .. c0 + C of the raw logits h W^T) with
    G = d(sum_i g_i logp_i + g^H_i H_i) / du, and the adapter's logits lx [n, C] too when
    `lora_grad`.

    lab [n] int32 (-1 where ignored), lse2 [n], gs [n] = g logit_scale / T, and (for the
    entropy's gradient, else None) gh [n] = g^H logit_scale / T and the entropy ent [n],
    all fp32, are the rows' inputs; dbias [row tiles, >= C] fp32 receives G's column sums
    per row tile (None: no bias gradient).
    """
    n, cl = x.shape
    br, bc, warps = config
    kernels().bwd_chunk_kernel[(triton.cdiv(n, br), triton.cdiv(cl, bc))](
        x, x.stride(0), x if lx is None else lx, cl if lx is None else lx.stride(0),
        x if bias is None else bias, lab, lse2, gs, gs if gh is None else gh, gs if ent is None else ent,
        lab if dbias is None else dbias, cl if dbias is None else dbias.stride(0),
        n, c0, cl, *scalars(opts),
        HAS_BIAS=bias is not None, HAS_LORA=lx is not None, HAS_SOFTCAP=opts.softcap is not None,
        BIAS_GRAD=dbias is not None, LORA_GRAD=lora_grad, ENTROPY_GRAD=gh is not None,
        ACCURATE_TANH=x.is_cuda, BLOCK_R=br, BLOCK_C=bc, num_warps=warps,
    )


def finish(state, valid: Tensor, labels: Tensor, v: int, opts: HeadOptions):
    """(logps, entropy, logit_mean, argmax_match, lse2) from the folded state."""
    m, s, tgt, w, zsum, _zmax, amax = state
    # The state is in base 2: y2 = y log2 e. Back to natural log-probs at the end.
    log2_s = torch.log2(s)
    lse2 = m + log2_s
    logps = torch.where(valid, (tgt - lse2) * _LN2, 0.0)
    entropy = (log2_s - w / s) * _LN2 if opts.entropy else None
    mean = zsum / v if opts.logit_mean else None
    match = (amax.long() == labels) & valid if opts.argmax else None
    return logps, entropy, mean, match, lse2


def block_fwd_config(n: int, v: int, cuda: bool) -> tuple[int, int, int]:
    """A block has few rows and all V columns: fewer rows per program keep the SMs busy."""
    if not cuda:
        return launch_shape(FWD_CONFIG, n, v, cuda)
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    return FWD_CONFIG if triton.cdiv(n, FWD_CONFIG[0]) >= 4 * sms else BLOCK_FWD_CONFIG
