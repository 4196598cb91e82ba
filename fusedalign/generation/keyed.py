"""KeyedSampler: sampling whose draws depend on what is drawn, never on the batch, rank or padding.

Each draw is the Gumbel-max trick: token = argmax_v (z_v / T + g_v), with g_v Gumbel noise
made by a counter-based hash of (seed, step, row key, generation index, position, v). Given
the same logits a row gets the same token alone, inside any batch, on any rank, with any
padding; and the argmax of z/T + Gumbel noise is an exact sample of softmax(z/T) (restricted
by top-k / top-p / min-p, applied first as transformers' warpers do). Use it as a logits
processor with greedy decoding (HFGenerate does): it returns scores whose argmax is the draw.

The hash works on 32-bit values held in int64 with no overflow (products stay below 2^49),
so it gives the same bits on every device.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

_M32 = 0xFFFFFFFF
_SALTS = (0x9E3779B9, 0x85EBCA6B, 0xC2B2AE35, 0x27D4EB2F, 0x165667B1, 0xD3A2646C)


def _mul32(x: Tensor, c: int) -> Tensor:
    """(x * c) mod 2^32 for int64 x in [0, 2^32), without int64 overflow."""
    lo, hi = x & 0xFFFF, x >> 16
    return (lo * c + (((hi * c) & 0xFFFF) << 16)) & _M32


def mix32(x: Tensor) -> Tensor:
    """A 32-bit integer finaliser (xor-shift-multiply), elementwise on int64 tensors in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def combine(h: Tensor, value: Tensor | int, salt: int) -> Tensor:
    """Hash of (h, value): both taken mod 2^32."""
    v = torch.as_tensor(value, dtype=torch.long, device=h.device) & _M32
    return mix32(h ^ mix32((v + salt) & _M32))


def gumbel_noise(row_hash: Tensor, vocab: int, start: int = 0) -> Tensor:
    """[B, vocab] float64 Gumbel noise of tokens start .. start + vocab - 1, from per-row hashes [B]
    (already keyed by position): a slice of the vocabulary gets the same noise as the whole."""
    v = torch.arange(start, start + vocab, dtype=torch.long, device=row_hash.device)
    h = mix32(row_hash[:, None] ^ mix32((v + _SALTS[5]) & _M32)[None, :])
    u = (h.double() + 0.5) / 2.0**32  # in (0, 1)
    return -torch.log(-torch.log(u))


def filtering(top_k: int | None, top_p: float, min_p: float | None, vocab: int) -> bool:
    """Whether `filter_logits` would remove a token of a `vocab`-token vocabulary with these flags:
    top-k between 1 and vocab - 1, top-p under 1, min-p above 0 (each is skipped otherwise)."""
    return bool(top_k and 0 < top_k < vocab) or top_p < 1.0 or (min_p is not None and min_p > 0)


def filter_logits(z: Tensor, top_k: int = 0, top_p: float = 1.0, min_p: float | None = None) -> Tensor:
    """transformers' top-k, top-p and min-p warpers on z [B, V] (already divided by T): removed -> -inf."""
    neg = torch.finfo(z.dtype).min
    if top_k and top_k > 0 and top_k < z.shape[-1]:
        kth = torch.topk(z, top_k, dim=-1).values[..., -1:]
        z = z.masked_fill(z < kth, neg)
    if top_p < 1.0:
        sorted_z, order = torch.sort(z, dim=-1)  # ascending
        cum = sorted_z.softmax(-1).cumsum(-1)
        drop = cum <= (1 - top_p)
        drop[..., -1] = False  # keep at least the most likely token
        z = z.masked_fill(drop.scatter(-1, order, drop), neg)
    if min_p is not None and min_p > 0:
        probs = z.softmax(-1)
        z = z.masked_fill(probs < min_p * probs.max(-1, keepdim=True).values, neg)
    return z


class KeyedSampler:
    """A logits processor that samples by key. Bind the batch's rows before each generate.

    Args:
        seed: the run's seed.
        temperature, top_k, top_p, min_p: TRL's sampling flags (top_k 0 = off, top_p 1 = off).
    """

    def __init__(self, seed: int = 0, *, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                 min_p: float | None = None):
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.seed, self.temperature, self.top_k, self.top_p, self.min_p = seed, temperature, top_k, top_p, min_p
        self._rows: Tensor | None = None
        self._prompt_length = 0
        self.logprobs: list[Tensor] = []

    def bind(self, row_keys: Sequence[tuple[int, int]], prompt_length: int, step: int = 0) -> None:
        """The rows (keys in batch order) and padded prompt length of the next generate call."""
        keys = torch.tensor([list(k) for k in row_keys], dtype=torch.long).reshape(-1, 2)
        h = combine(torch.full((len(keys),), self.seed, dtype=torch.long) & _M32, step, _SALTS[0])
        h = combine(h, keys[:, 0], _SALTS[1])
        self._rows = combine(h, keys[:, 1], _SALTS[2])
        self._prompt_length = prompt_length
        self.logprobs = []

    def select(self, keep: Tensor) -> None:
        """Keeps the bound rows `keep` [n] (indices into the bound batch), in that order: the decoding
        loop's live rows after it set its finished rows aside."""
        if self._rows is None:
            raise RuntimeError("KeyedSampler: bind() the batch's row keys before selecting rows")
        self._rows = self._rows.index_select(0, keep.to(self._rows.device))

    def filters(self, vocab: int) -> bool:
        """Whether its top-k, top-p or min-p removes tokens of a `vocab`-token vocabulary (a draw
        then needs the whole vocabulary at once)."""
        return filtering(self.top_k, self.top_p, self.min_p, vocab)

    def row_hashes(self, position: int, device) -> Tensor:
        """[B] the bound rows' hashes at completion `position`: what `gumbel_noise` draws from."""
        if self._rows is None:
            raise RuntimeError("KeyedSampler: bind() the batch's row keys before generating")
        return combine(self._rows.to(device), position, _SALTS[3])

    def draw(self, scores: Tensor, position: int) -> tuple[Tensor, Tensor]:
        """(tokens [B], their log-probs under the filtered softmax [B]) at completion `position`."""
        if self._rows is None or self._rows.shape[0] != scores.shape[0]:
            raise RuntimeError("KeyedSampler: bind() the batch's row keys before generating")
        z = filter_logits(scores.double() / self.temperature, self.top_k, self.top_p, self.min_p)
        h = self.row_hashes(position, scores.device)
        tokens = (z + gumbel_noise(h, z.shape[-1])).argmax(-1)
        return tokens, z.log_softmax(-1).gather(-1, tokens[:, None])[:, 0]

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        tokens, logps = self.draw(scores, input_ids.shape[1] - self._prompt_length)
        self.logprobs.append(logps.float())
        out = torch.full_like(scores, float("-inf"))
        return out.scatter(-1, tokens[:, None], 0.0)  # greedy decoding then takes exactly this token
