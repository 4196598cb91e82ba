"""A Triton kernel for one decoding step's grouped-query attention: each key/value head's slots
read once for all the query heads that share it, split over the slots when the batch is small.

Why a kernel of our own. StaticDecode's grouped sdpa (decode_attention.py) lays a group's query
heads out as query positions of one head: Qwen2.5-0.5B's 7 query heads per key/value head become
7 query rows. On one H200 at batch 512 (4099510, `decode_profile.py --kernels`) cuDNN's kernel
for it took 1.72 ms of a 6.9 ms step: it tiles query rows by 64, so it computes 64 rows for 7,
while the work is bound by reading the cache (at batch 512 and 256 slots, 67 MB a layer, about
16 us at 4.3 TB/s). Here a program holds one (row, key/value head): its G query heads as a
[16, d] block (rows past G masked), the slots in blocks of `BLOCK_N`, an online softmax in
float32 (base 2), and the values summed with the probabilities cast to the cache's dtype, as
flash attention does (a float32 cache is multiplied in full float32 precision, not TF32).
When rows x key/value heads are too few to fill the GPU, each program takes a share of the
slots (`splits`) and a second kernel combines the shares by their maxima and sums; with one
share a program normalises its rows and writes the output itself, in the query's dtype. Either
way a call is one or two launches: the tensor ops that combined the shares before (several
launches, or a division and a cast with one share) cost more than the kernel at small batches.

The mask is the decoding step's boolean one (True: attend; a row's left padding False). Slots
past the mask's width are not read, as in the grouped sdpa. With `Launch.skip_masked` (the
default launch's) neither are the masked slots within it: a CUDA graph's window of slots
(`StaticDecode.window_slots`) is rounded up past the slots written, and a row's left padding
holds nothing to read; the mask is then read first and the keys' and values' loads wait for it
(measured against the launch that loads them by benchmarks/decode_attention.py's
`triton_loads_masked`). Masked scores are set to -1e30, a
finite value, and their probabilities to 0: a share of slots that are all masked then has sum
0 and a maximum that weighs nothing beside a real one, never a NaN.

`decode_attention(query, key, value, visible, scale)` is a `torch.library` op: a compiled
decoding step calls it as one opaque op, and a CUDA graph captures its launches. Under
TRITON_INTERPRET=1 the same kernel runs on CPU tensors (tests).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK_N = 64  # slots a program reads per iteration in a Launch that names none (DEFAULT reads 32)
FILL_PROGRAMS = 512  # programs to fill off CUDA (the interpreter): split the slots until there are this many
LOG2E = 1.4426950408889634


class Launch(NamedTuple):
    """How the kernel is launched: slots a program reads per iteration, warps a program, pipeline
    stages (None: Triton's defaults), and whether the keys and values of masked slots are read
    (`skip_masked`: their loads are masked too, so a decoding step's window of slots not yet
    written, and a row's left padding, cost no memory traffic; off: only slots past the cache's
    width are left unread, and the loads depend on nothing loaded in the same iteration).
    `DEFAULT` is what `decode_attention` uses; benchmarks/decode_attention.py times others."""

    block_n: int = BLOCK_N
    num_warps: int | None = None
    num_stages: int | None = None
    skip_masked: bool = False


# Masked slots unread: never slower than loading them, and 10-17% faster at batch 256 and 512
# (benchmarks/decode_attention.py --triton_configs, af7e42b, one H100, docs/benchmarks.md).
# 32 slots an iteration, 2 warps, 3 stages: the grid's best at batch 512 in two runs on an H100,
# 7% under Triton's defaults with 64 slots on one cache (397f537), and 10% at batch 512, 16% at
# 256, 3% at 64 as a step calls it, 24 caches a graph, 257 of 384 slots seen (5785009).
DEFAULT = Launch(block_n=32, num_warps=2, num_stages=3, skip_masked=True)


@triton.jit
def _grouped_decode(Q, K, V, MASK, ACC, MAX, SUM, OUT,
                    s_qb, s_qg, s_qr, s_kb, s_kg, s_ks, s_vb, s_vg, s_vs, s_mb, s_ms, s_ob, s_oh,
                    kv_heads, group, slots, share, scale_log2,
                    HAS_MASK: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
                    PRECISION: tl.constexpr, SKIP_MASKED: tl.constexpr, FINAL: tl.constexpr):
    """One (row, key/value head) x one share of the slots. With FINAL (one share: every slot) its
    G query heads' attention, normalised and in OUT's dtype, written to OUT[row, head x G + r];
    otherwise its partial sum of values [BLOCK_G, D] and the running maximum and sum of the
    base-2 exponentials [BLOCK_G], written to ACC/MAX/SUM[(row x kv_heads + head), split] for
    `_combine_shares`."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    splits = tl.num_programs(1)
    b = pid // kv_heads
    h = pid % kv_heads
    rows = tl.arange(0, BLOCK_G)
    dims = tl.arange(0, D)
    q = tl.load(Q + b * s_qb + h * s_qg + rows[:, None] * s_qr + dims[None, :],
                mask=rows[:, None] < group, other=0.0)
    top = tl.full([BLOCK_G], -1.0e30, tl.float32)
    total = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, D], tl.float32)
    start = split * share
    end = tl.minimum(start + share, slots)
    for n0 in range(start, end, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        inside = cols < end
        valid = inside
        if HAS_MASK:
            valid = valid & (tl.load(MASK + b * s_mb + cols * s_ms, mask=inside, other=0) != 0)
        read = valid if SKIP_MASKED else inside  # the slots whose keys and values are loaded
        k = tl.load(K + b * s_kb + h * s_kg + cols[:, None] * s_ks + dims[None, :], mask=read[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [BLOCK_G, BLOCK_N], base 2
        scores = tl.where(valid[None, :], scores, -1.0e30)
        new_top = tl.maximum(top, tl.max(scores, 1))
        alpha = tl.exp2(top - new_top)
        p = tl.where(valid[None, :], tl.exp2(scores - new_top[:, None]), 0.0)
        total = total * alpha + tl.sum(p, 1)
        v = tl.load(V + b * s_vb + h * s_vg + cols[:, None] * s_vs + dims[None, :], mask=read[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        top = new_top
    if FINAL:
        heads = h * group + rows
        tl.store(OUT + b * s_ob + heads[:, None] * s_oh + dims[None, :],
                 (acc / total[:, None]).to(OUT.dtype.element_ty), mask=rows[:, None] < group)
    else:
        out = (pid * splits + split) * BLOCK_G + rows
        tl.store(ACC + out[:, None] * D + dims[None, :], acc)
        tl.store(MAX + out, top)
        tl.store(SUM + out, total)


@triton.jit
def _combine_shares(ACC, MAX, SUM, OUT, s_ob, s_oh, kv_heads, group, splits,
                    BLOCK_G: tl.constexpr, D: tl.constexpr):
    """One (row, key/value head): its shares' partial sums weighed by 2^(share's maximum - the
    largest), normalised by the weighed sums, written to OUT in its dtype (one launch where
    several tensor ops took one each)."""
    pid = tl.program_id(0)
    b = pid // kv_heads
    h = pid % kv_heads
    rows = tl.arange(0, BLOCK_G)
    dims = tl.arange(0, D)
    top = tl.full([BLOCK_G], -float("inf"), tl.float32)
    for split in range(0, splits):
        top = tl.maximum(top, tl.load(MAX + (pid * splits + split) * BLOCK_G + rows))
    acc = tl.zeros([BLOCK_G, D], tl.float32)
    total = tl.zeros([BLOCK_G], tl.float32)
    for split in range(0, splits):
        at = (pid * splits + split) * BLOCK_G + rows
        weight = tl.exp2(tl.load(MAX + at) - top)
        total += tl.load(SUM + at) * weight
        acc += tl.load(ACC + at[:, None] * D + dims[None, :]) * weight[:, None]
    heads = h * group + rows
    tl.store(OUT + b * s_ob + heads[:, None] * s_oh + dims[None, :],
             (acc / total[:, None]).to(OUT.dtype.element_ty), mask=rows[:, None] < group)


def _programs_wanted(device: torch.device) -> int:
    """Programs that fill the device: 4 a multiprocessor on CUDA."""
    if device.type == "cuda":
        return 4 * _multiprocessors(device.index if device.index is not None else torch.cuda.current_device())
    return FILL_PROGRAMS


@functools.lru_cache(maxsize=None)
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def splits_for(rows: int, kv_heads: int, slots: int, programs: int, block_n: int = BLOCK_N) -> int:
    """How many shares of the slots each (row, key/value head) is cut into: enough programs to fill
    `programs`, never a share under one block of `block_n` slots."""
    most = max(1, triton.cdiv(slots, block_n))
    return max(1, min(most, triton.cdiv(programs, rows * kv_heads)))


@torch.library.custom_op("fusedalign::grouped_decode_attention", mutates_args=())
def decode_attention(query: Tensor, key: Tensor, value: Tensor, visible: Tensor | None, scale: float) -> Tensor:
    """One query position's attention to a grouped key/value cache.

    Args:
        query: [B, h, 1, d], h a multiple of the g key/value heads; d a power of two >= 16.
        key, value: [B, g, S, d] (the cache's first S slots; the last dimension contiguous).
        visible: [B, S] bool (True: attend), or None (every slot).
        scale: the scores' factor (1 / sqrt(d) for most models).

    Returns:
        [B, h, 1, d] in the query's dtype.
    """
    return grouped_decode(query, key, value, visible, scale, DEFAULT)


def grouped_decode(query: Tensor, key: Tensor, value: Tensor, visible: Tensor | None, scale: float,
                   launch: Launch) -> Tensor:
    """`decode_attention` launched as `launch` says (a plain function: benchmarks time launches)."""
    B, h, _, d = query.shape
    g, S = key.shape[1], key.shape[2]
    group = h // g
    block_g = max(16, triton.next_power_of_2(group))
    q = query.reshape(B, g, group, d)
    splits = splits_for(B, g, S, _programs_wanted(query.device), launch.block_n)
    share = triton.cdiv(triton.cdiv(S, splits), launch.block_n) * launch.block_n
    out = torch.empty(B, h, d, dtype=query.dtype, device=query.device)
    final = splits == 1
    if final:  # the shares' scratch is neither written nor read
        acc = top = total = out
    else:
        acc = torch.empty(B * g, splits, block_g, d, dtype=torch.float32, device=query.device)
        top = torch.empty(B * g, splits, block_g, dtype=torch.float32, device=query.device)
        total = torch.empty_like(top)
    mask = visible if visible is not None else key  # a pointer the kernel never reads without HAS_MASK
    mask_strides = (visible.stride(0), visible.stride(1)) if visible is not None else (0, 0)
    _grouped_decode[(B * g, splits)](
        q, key, value, mask, acc, top, total, out,
        q.stride(0), q.stride(1), q.stride(2), key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2), *mask_strides, out.stride(0), out.stride(1),
        g, group, S, share, scale * LOG2E,
        HAS_MASK=visible is not None, BLOCK_G=block_g, BLOCK_N=launch.block_n, D=d,
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32",  # float32 models: no TF32 rounding
        SKIP_MASKED=launch.skip_masked and visible is not None, FINAL=final,
        **{k: v for k, v in (("num_warps", launch.num_warps), ("num_stages", launch.num_stages)) if v is not None})
    if not final:
        _combine_shares[(B * g,)](acc, top, total, out, out.stride(0), out.stride(1), g, group, splits,
                                  BLOCK_G=block_g, D=d)
    return out.reshape(B, h, 1, d)


@decode_attention.register_fake
def _(query: Tensor, key: Tensor, value: Tensor, visible: Tensor | None, scale: float) -> Tensor:
    return torch.empty_like(query)


def supports(query: Tensor, key: Tensor, value: Tensor) -> str | None:
    """Why the kernel cannot take these tensors, or None."""
    d = query.shape[-1]
    if d < 16 or d & (d - 1) or value.shape[-1] != d:
        return f"head dimension {d} (the kernel takes a power of two >= 16, the same for keys and values)"
    if query.shape[1] % key.shape[1]:
        return f"{query.shape[1]} query heads over {key.shape[1]} key/value heads"
    if not query.dtype == key.dtype == value.dtype:
        return f"query, keys and values in {query.dtype}, {key.dtype} and {value.dtype} (autocast)"
    if query.stride(-1) != 1 or key.stride(-1) != 1 or value.stride(-1) != 1:
        return "a query, key or value whose last dimension is not contiguous"
    return None
