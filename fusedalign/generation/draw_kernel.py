"""A Triton kernel for a decoding step's sampled draw: argmax(logits / T + Gumbel noise), the noise
made inside the kernel, the logits read once in their own dtype.

Why a kernel of our own. StaticDecode's draw (decode_state.gumbel_max) is written as tensor ops:
uniform noise the shape of the logits, its double log, the sum, the argmax in chunks. Compiled by
inductor inside the decoding step on one H100 (397f537, `decode_profile.py --compile --kernels`,
batch 512, Qwen2.5-0.5B's 151,936 tokens) it was two kernels: one writing 311 MB of float32
noise (0.226 ms) and a reduction reading it back with the logits (0.322 ms), together 16% of
the compiled step. Here one program holds one (row, chunk of `DRAW_CHUNK` tokens): it loads the
chunk's logits (upcast to float32, divided by the temperature as the processors divide them),
draws its uniforms with Philox (`tl.rand4x`, four a call, keyed by a seed drawn once a call from
torch's generator plus the row, counted within the row), adds -log(-log(u)) and keeps the
chunk's maximum and its first index. The row's token is then the index kept by the first chunk
holding the row's maximum: the argmax over the chunks, as `row_argmax` takes it. In the same
step at 9ef7678 the kernel took 0.275 ms: bound by the Philox rounds and the two logs of 77.8
million uniforms, not by reading the 155 MB of bf16 logits.

The seed is a one-element tensor drawn by `torch.randint` in the call, so a CUDA graph that
captured the call draws a new seed, and new noise, on every replay. A uniform of exactly 0 gives
-inf noise (never chosen); a row whose logits are all -inf gives token 0, as argmax does.

`gumbel_draw(logits, temperature)` is a `torch.library` op: a compiled decoding step calls it as
one opaque op. Under TRITON_INTERPRET=1 the same kernel runs on CPU tensors (tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

DRAW_CHUNK = 4096  # tokens a program reduces: 38 programs a row for a 151,936-token vocabulary


@triton.jit
def _quarter(X, row_base, vocab, temperature, start, u, QUARTER: tl.constexpr, NOISE: tl.constexpr):
    """A quarter of a chunk, from token `start`: its maximum and the first token that holds it."""
    tokens = start + tl.arange(0, QUARTER)
    x = tl.load(X + row_base + tokens, mask=tokens < vocab, other=float("-inf")).to(tl.float32) / temperature
    if NOISE:
        x = x - tl.log(-tl.log(u))
    top, first = tl.max(x, 0, return_indices=True, return_indices_tie_break_left=True)
    return top, start + first


@triton.jit
def _chunk_gumbel_max(X, SEED, TOP, WHERE, s_xb, vocab, chunks, temperature,
                      CHUNK: tl.constexpr, NOISE: tl.constexpr):
    """One (row, chunk): the maximum of logits / temperature (+ Gumbel noise with NOISE) over the
    chunk's tokens, and the first token that holds it, to TOP/WHERE[row, chunk]. One Philox call
    gives four uniforms (`tl.rand4x`), one for a token in each quarter of the chunk: a quarter of
    the Philox rounds that a call a token (`tl.rand`) would cost."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    QUARTER: tl.constexpr = CHUNK // 4
    row_base = row.to(tl.int64) * s_xb
    start = chunk * CHUNK
    u0, u1, u2, u3 = tl.rand4x(tl.load(SEED) + row, chunk * QUARTER + tl.arange(0, QUARTER))  # [0, 1)
    top, where = _quarter(X, row_base, vocab, temperature, start, u0, QUARTER, NOISE)
    # The quarters in token order, a later one taken only when strictly larger: the first of ties.
    t, w = _quarter(X, row_base, vocab, temperature, start + QUARTER, u1, QUARTER, NOISE)
    where = tl.where(t > top, w, where)
    top = tl.maximum(top, t)
    t, w = _quarter(X, row_base, vocab, temperature, start + 2 * QUARTER, u2, QUARTER, NOISE)
    where = tl.where(t > top, w, where)
    top = tl.maximum(top, t)
    t, w = _quarter(X, row_base, vocab, temperature, start + 3 * QUARTER, u3, QUARTER, NOISE)
    where = tl.where(t > top, w, where)
    top = tl.maximum(top, t)
    tl.store(TOP + row * chunks + chunk, top)
    tl.store(WHERE + row * chunks + chunk, where)


def chunk_draw(logits: Tensor, temperature: float, *, noise: bool = True, chunk: int = DRAW_CHUNK) -> Tensor:
    """[B] int64: argmax over the vocabulary of logits [B, V] / temperature, plus Gumbel noise
    with `noise` (a draw from softmax(logits / temperature)); without it, `argmax(-1)`'s index,
    the first of ties. `chunk`: tokens a program reduces, a power of two (tests take small ones)."""
    B, V = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    chunks = triton.cdiv(V, chunk)
    top = torch.empty(B, chunks, dtype=torch.float32, device=logits.device)
    where = torch.empty(B, chunks, dtype=torch.int64, device=logits.device)
    # A fresh seed a call: under a CUDA graph, a fresh one a replay. Below 2**31 - B, so that
    # seed + row stays a distinct positive key for every row.
    seed = torch.randint(0, 2**31 - 1 - B, (1,), device=logits.device)
    _chunk_gumbel_max[(B, chunks)](logits, seed, top, where, logits.stride(0), V, chunks, float(temperature),
                                   CHUNK=chunk, NOISE=noise)
    best = top.argmax(-1, keepdim=True)  # [B, 1]: the first chunk with the row's maximum
    return where.gather(1, best).squeeze(1)


@torch.library.custom_op("fusedalign::gumbel_draw", mutates_args=())
def gumbel_draw(logits: Tensor, temperature: float) -> Tensor:
    """[B] int64 tokens drawn from softmax(logits [B, V] / temperature), logits in any float dtype."""
    return chunk_draw(logits, temperature)


@gumbel_draw.register_fake
def _(logits: Tensor, temperature: float) -> Tensor:
    return logits.new_empty(logits.shape[0], dtype=torch.int64)
