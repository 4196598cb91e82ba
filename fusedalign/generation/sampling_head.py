"""The next token drawn inside the head's own forward, chunk by chunk over the vocabulary.

A decoding step of `StaticDecode` otherwise makes the head's `[B, V]` logits in the model's
dtype, copies them to float32, and passes over them once per logits processor and a few
times for the Gumbel-max draw: at batch 512 and a 152k vocabulary each pass moves 311 MB,
more than the weights the forward reads. Here the head's forward is replaced (by head.py's
plain and LoRA forwards, so the weight is read inside the head's own call, as every op of
the project does) with one that, for each slice of the vocabulary,

    z = hidden @ W[slice].T (+ bias, + LoRA)   in the model's dtype, as the head makes it
    z = post-processing (logit scale, soft-cap) in the model's dtype, as the model applies it
    z = float32(z); repetition penalty; / temperature
    score = z (greedy) or z + Gumbel noise (unkeyed: torch.rand; keyed: the sampler's hash)

and keeps the running maximum of the scores and its token: the argmax over the whole
vocabulary, found without the whole vocabulary's logits alive. For a keyed sampler it keeps,
in float64 as the sampler computes, the running log-sum-exp of z and the z of the token kept,
so the token's log-prob comes out too. The model then returns `[B, 1, 2]` float32 — the
token id (exact in float32 below 2^24) and its log-prob (0 when not keyed) — where it would
return logits.

Exactness: each slice's logits are the head's logits of those tokens, post-processed in the
same dtype, so greedy and keyed draws are the tokens of the whole-vocabulary loop (up to the
rounding of a GEMM cut into slices, which CPU tests find equal); unkeyed draws are exact
samples of the same processed softmax with other noise. Top-k, top-p and min-p need the
whole distribution at once: with any of them on, `usable` says no and the loop takes the
logits path.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from fusedalign.architectures import PostProcessing, post_processing_of
from fusedalign.head_forward import _head_module, _lora_forward, _plain_forward, _replaced_forward
from fusedalign.model_calls import _is_lora_layer
from fusedalign.ops import LowRank

from .decode_state import gumbel_scores, penalised
from .keyed import KeyedSampler, filtering, gumbel_noise

CHUNK_ELEMENTS = 1 << 22  # B x slice float32 scores per slice: 16 MiB, a share of a GPU's L2
MIN_SLICE = 1024  # tokens: no slice narrower, whatever the batch
MAX_VOCAB = 1 << 24  # token ids travel as float32


def usable(lm: nn.Module, processing: dict[str, Any], sampler: KeyedSampler | None) -> str | None:
    """Why the sampling head cannot draw for this model and these flags (None: it can). Flags that
    remove no token (top-k 0 or at least the vocabulary, top-p 1, min-p 0) are no filtering."""
    vocab = lm.config.get_text_config().vocab_size
    if filtering(processing.get("top_k"), processing.get("top_p", 1.0), processing.get("min_p"), vocab):
        return "top-k, top-p or min-p filtering (they need the whole vocabulary at once)"
    if sampler is not None and sampler.filters(vocab):
        return "the keyed sampler's top-k, top-p or min-p filtering"
    head = _head_module(lm)
    if not (_is_lora_layer(head) or isinstance(head, nn.Linear)):
        return f"an output embedding of type {type(head).__name__}"
    if vocab >= MAX_VOCAB:
        return "a vocabulary of 2^24 tokens or more"
    try:
        post_processing_of(lm)
    except Exception as error:  # noqa: BLE001 - an unregistered architecture: the logits path
        return str(error).split(". ")[0]
    return None


class SamplingHead:
    """The state of one `sampling_head` context: the draw's flags and what it reads besides the hidden states.

    Args:
        post: the model's logit post-processing (done here while the context is active).
        repetition_penalty, temperature: transformers' processors (1 and 1: off).
        do_sample: False for greedy decoding.
        seen: [B, V] bool, the tokens of each row so far, when the penalty is on.
        sampler: a KeyedSampler (bound to the batch) and the completion position it draws at.
    """

    def __init__(self, post: PostProcessing, *, repetition_penalty: float, temperature: float, do_sample: bool,
                 seen: Tensor | None, sampler: KeyedSampler | None = None, position: int = 0):
        self.post, self.penalty, self.temperature, self.do_sample = post, repetition_penalty, temperature, do_sample
        self.seen, self.sampler, self.position = seen, sampler, position

    def compute(self, hidden: Tensor, weight: Tensor, bias: Tensor | None, low_rank: LowRank | None) -> Tensor:
        """[B, T', H] hidden states (the last position is drawn from) -> [B, 1, 2] (token, log-prob)."""
        x = hidden[:, -1]
        rows, vocab = x.shape[0], weight.shape[0]
        down = None if low_rank is None else low_rank.down.reshape(rows, -1, low_rank.down.shape[-1])[:, -1]
        keyed = self.sampler is not None
        acc = torch.float64 if keyed else torch.float32
        best = torch.full((rows,), float("-inf"), dtype=acc, device=x.device)
        token = torch.zeros(rows, dtype=torch.long, device=x.device)
        z_token = torch.zeros(rows, dtype=acc, device=x.device)
        lse = torch.full((rows,), float("-inf"), dtype=acc, device=x.device)
        hashes = self.sampler.row_hashes(self.position, x.device) if keyed else None
        width = max(MIN_SLICE, CHUNK_ELEMENTS // max(rows, 1))
        for start in range(0, vocab, width):
            stop = min(vocab, start + width)
            z = F.linear(x, weight[start:stop], None if bias is None else bias[start:stop])
            if down is not None:
                z = z + low_rank.scale * (down.to(z.dtype) @ low_rank.up[start:stop].to(z.dtype).T)
            z = self._post(z).float()  # as the loop's logits: float32 for the processors
            z = penalised(z, None if self.seen is None else self.seen[:, start:stop], self.penalty)
            z = z.to(acc) / self.temperature  # the keyed sampler divides in float64
            if keyed:
                score = z + gumbel_noise(hashes, stop - start, start)
                lse = torch.logaddexp(lse, z.logsumexp(-1))
            elif self.do_sample:
                score = gumbel_scores(z)
            else:
                score = z
            top, where = score.max(-1)
            better = top > best  # strictly: on a tie the earlier token stays, as argmax keeps the first
            best = torch.where(better, top, best)
            token = torch.where(better, where + start, token)
            if keyed:
                z_token = torch.where(better, z.gather(-1, where[:, None])[:, 0], z_token)
        logp = (z_token - lse) if keyed else torch.zeros_like(best)
        return torch.stack([token.to(torch.float32), logp.to(torch.float32)], dim=-1)[:, None, :]

    def _post(self, z: Tensor) -> Tensor:
        """The model's own post-processing of its logits, in their dtype."""
        if self.post.logit_scale != 1.0:
            z = z * self.post.logit_scale
        if self.post.softcap is not None:
            z = torch.tanh(z / self.post.softcap) * self.post.softcap
        return z


@contextlib.contextmanager
def sampling_head(lm: nn.Module, state: SamplingHead) -> Iterator[SamplingHead]:
    """Makes `lm(...)` return `[B, 1, 2]` (drawn token, its log-prob) where it would return logits."""
    head = _head_module(lm)
    forward = _lora_forward(state) if _is_lora_layer(head) else _plain_forward(state)
    with _replaced_forward(head, forward):
        undo = state.post.disable()
        try:
            yield state
        finally:
            undo()
