"""GEMMs whose results are summed over chunks or blocks, kept in fp32 while the inputs are bf16/fp16.

Rounding each chunk's partial product to bf16 before adding it up would cost about
sqrt(chunks) times the error of one unfused bf16 GEMM; returning (or accumulating into)
the GEMM's own fp32 accumulator avoids that. Shared by every backend of the head op.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

HALF = (torch.bfloat16, torch.float16)

# torch.mm / torch.addmm(..., out_dtype=float32) (aten::mm.dtype): a bf16/fp16 GEMM that
# returns, or adds into, its fp32 accumulator instead of rounding it. CUDA only, recent PyTorch.
_HAS_MM_OUT_DTYPE = hasattr(torch.ops.aten.mm, "dtype")


def wide_mm(a: Tensor, b: Tensor, acc: torch.dtype = torch.float32) -> Tensor:
    """a @ b returned in `acc` (fp32 or fp64), or in a's dtype when that is already `acc`.

    Off CUDA reduced-precision GEMMs are no faster than fp32, so there the inputs are
    simply upcast (exact products, fp32 sums).
    """
    if a.dtype == acc:
        return torch.mm(a, b)
    if a.is_cuda and _HAS_MM_OUT_DTYPE and acc == torch.float32:
        return torch.mm(a, b, out_dtype=acc)
    if a.is_cuda:  # older PyTorch: one rounding, then the wide dtype
        return torch.mm(a, b).to(acc)
    return torch.mm(a.to(acc), b.to(acc))


def accumulate_mm(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """acc += a @ b, with acc in fp32 (or fp64) while a and b may be bf16/fp16."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif a.is_cuda and acc.dtype == torch.float32 and _addmm_into_fp32_works(a.device, a.dtype):
        # cuBLAS reads acc as C with beta = 1: no temporary of acc's size, one pass over acc.
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:
        acc.add_(wide_mm(a, b, acc.dtype))


@functools.lru_cache(maxsize=None)
def _addmm_into_fp32_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this PyTorch accumulates a half-precision GEMM into an fp32 tensor in place."""
    if not hasattr(torch.ops.aten.addmm, "dtype_out"):
        return False
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(64, 48, device=device, generator=gen).to(dtype)
    b = torch.randn(48, 40, device=device, generator=gen).to(dtype)
    acc = torch.randn(64, 40, device=device, generator=gen)
    want = acc + a.float() @ b.float()
    try:
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return bool(torch.allclose(acc, want, rtol=1e-3, atol=1e-3))
