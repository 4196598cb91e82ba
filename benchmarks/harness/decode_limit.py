"""The decode limit: the tokens/s a decoding loop could reach if every step cost only the memory
traffic or the arithmetic it needs, whichever is larger, at the GPU's datasheet peaks.

Per decoding step with b rows still decoding at context c (prompt + tokens so far), for a dense
decoder of N parameters (embedding counted once: a tied head reads it whole every step), L
layers, h query heads and g key/value heads of size d, hidden size H, vocabulary V, in a dtype
of e bytes:

    bytes = N e + b c (2 L g d e)                        weights once, every live row's KV cache
    flops = 2 b (N - V H) + 2 b V H + 4 b c L h d        matmuls, head, attention scores and values
    time  = max(bytes / bandwidth, flops / peak)

and the prefill (b rows of P prompt tokens) costs 2 b P N / peak. The limit is the tokens
decoded over the sum of these times. Rows that have finished cost nothing in this ideal (the
realistic-length runs count the rows still decoding at each step, from the length
distribution); nothing of launch overhead, sampling, or the host is counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Peaks:
    """A GPU's datasheet peaks: memory bandwidth (TB/s) and dense bf16 tensor throughput (TFLOP/s)."""

    name: str
    tb_per_s: float
    tflops: float


# NVIDIA's datasheet values (SXM parts), dense (no sparsity) bf16.
KNOWN = (Peaks("H200", 4.8, 989.0), Peaks("H100", 3.35, 989.0), Peaks("A100", 2.039, 312.0))


def peaks_of(gpu_name: str) -> Peaks | None:
    for p in KNOWN:
        if p.name in gpu_name:
            return p
    return None


@dataclass(frozen=True)
class Shape:
    params: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    vocab: int
    dtype_bytes: int

    @property
    def kv_bytes_per_token(self) -> int:
        """One token's KV cache over every layer: 2 (K and V) x L x g x d x e."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @classmethod
    def of(cls, config, params: int, dtype_bytes: int) -> "Shape":
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(params, config.num_hidden_layers, config.num_attention_heads,
                   getattr(config, "num_key_value_heads", None) or config.num_attention_heads, head_dim,
                   config.hidden_size, config.vocab_size, dtype_bytes)


def limit_tokens_per_s(shape: Shape, peaks: Peaks, prompt_length: int, live_rows: Sequence[float]) -> float:
    """The decode limit for rows of `prompt_length` tokens, `live_rows[k]` of them drawing token k."""
    seconds = 2 * live_rows[0] * prompt_length * shape.params / (peaks.tflops * 1e12)  # the prefill draws token 0
    for k, b in enumerate(live_rows[1:], start=1):
        seconds += step_seconds(shape, peaks, b, prompt_length + k)
    return sum(live_rows) / seconds


def step_seconds(shape: Shape, peaks: Peaks, rows: float, context: int, cached_tokens: float | None = None) -> float:
    """The floor of one decoding step: `rows` rows each at `context` tokens (the bytes and flops above).

    `cached_tokens` is the cache the step reads, when rows share some of it (a group's prompt
    cached once); by default each row reads its own `context` tokens.
    """
    s = shape
    cached = rows * context if cached_tokens is None else cached_tokens
    traffic = s.params * s.dtype_bytes + cached * s.kv_bytes_per_token
    work = 2 * rows * s.params + 4 * rows * context * s.layers * s.heads * s.head_dim
    return max(traffic / (peaks.tb_per_s * 1e12), work / (peaks.tflops * 1e12))
