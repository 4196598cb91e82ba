"""The decoding loop's state (`StaticDecode`): tensors allocated once per batch, written in place.

Everything a decoding step reads or writes lives here or in the static KV cache, so that the
step can be captured as one CUDA graph. When most rows have finished, `select` and
`select_cache_rows` gather the live rows into new, smaller tensors (the loop then captures a
new graph for them): finished rows stop costing forward passes.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import Tensor, nn

from .decode_attention import KERNELS, triton_runs_on
from .keyed import filter_logits, filtering


def process_logits(z: Tensor, seen: Tensor | None, *, repetition_penalty: float = 1.0, temperature: float = 1.0,
                   top_k: int = 0, top_p: float = 1.0, min_p: float | None = None) -> Tensor:
    """transformers' logits processors, in its order: repetition penalty, temperature, top-k, top-p, min-p.

    Args:
        z: [B, V] float32 logits of the next token.
        seen: [B, V] bool, the tokens of the row so far (its prompt without the padding), or None
            when `repetition_penalty` is 1.

    Returns:
        [B, V] float32 scores; filtered tokens hold the dtype's minimum.
    """
    return filter_logits(penalised(z, seen, repetition_penalty) / temperature, top_k, top_p, min_p)


def filters_off(processing: dict, vocab: int) -> bool:
    """Whether the logits processors of `processing` (StaticDecode's) only divide by the
    temperature: no repetition penalty, and no top-k, top-p or min-p that would remove a token
    (`keyed.filtering`)."""
    return processing["repetition_penalty"] == 1.0 and not filtering(
        processing["top_k"], processing["top_p"], processing["min_p"], vocab)


def penalised(z: Tensor, seen: Tensor | None, repetition_penalty: float) -> Tensor:
    """transformers' repetition penalty: the logits of tokens `seen` [B, V'] divided by the
    penalty where positive, multiplied where negative (z [B, V'] unchanged when it is 1)."""
    if repetition_penalty == 1.0:
        return z
    return torch.where(seen, torch.where(z < 0, z * repetition_penalty, z / repetition_penalty), z)


def gumbel_scores(scores: Tensor) -> Tensor:
    """scores + Gumbel noise, whose argmax is a draw from softmax(scores).

    `torch.rand` draws from the device's default generator, which CUDA graphs replay with a
    new offset each time. A uniform draw of exactly 0 gives -inf noise (never chosen).
    """
    return scores - torch.log(-torch.log(torch.rand_like(scores)))


def gumbel_max(scores: Tensor) -> Tensor:
    """[B] tokens drawn from softmax(scores [B, V]) as argmax(scores + Gumbel noise)."""
    return row_argmax(gumbel_scores(scores))


# The vocabulary's chunk in `row_argmax`'s first stage. On one H100 (03d0947, docs/benchmarks.md,
# "The compiled decoding step, kernel by kernel") inductor reduced each of 512 rows' 151,936 scores
# in one program: 0.405 ms for 155 MB, 0.38 TB/s, 12% of the compiled step.
ARGMAX_CHUNK = 4096


def row_argmax(scores: Tensor) -> Tensor:
    """`scores.argmax(-1)` of [B, V] in two stages, the same index (the first maximum): each chunk of
    `ARGMAX_CHUNK` tokens' maximum and its first index, then the first chunk holding the row's
    maximum. A row's reduction is then V / ARGMAX_CHUNK short ones that fill the GPU at any batch,
    where a compiled step reduced each row in one long program. Rows wholly -inf give 0, as argmax."""
    B, V = scores.shape
    n = V // ARGMAX_CHUNK
    if n < 2:
        return scores.argmax(-1)
    whole = n * ARGMAX_CHUNK
    top, where = scores[:, :whole].reshape(B, n, ARGMAX_CHUNK).max(-1)  # [B, n] each
    if whole < V:  # the tail, a last chunk of its own: after the others, so a tie keeps the earlier
        tail_top, tail_where = scores[:, whole:].max(-1)
        top = torch.cat([top, tail_top[:, None]], 1)
        where = torch.cat([where, tail_where[:, None]], 1)
    chunk = top.argmax(-1, keepdim=True)  # [B, 1]: the first chunk with the row's maximum
    return (chunk * ARGMAX_CHUNK + where.gather(1, chunk)).squeeze(1)


class DecodeState:
    """The live batch's rows: the token just drawn, its position and cache slot, what each row has drawn.

    Args:
        decode: the StaticDecode whose flags the draws follow.
        B, L, P: rows, cache slots (at least prompt + new tokens), padded prompt length.
        input_ids, prompt_mask: [B, P] the left-padded prompts.
        lm: the unwrapped causal LM (its vocabulary size and attention implementation).
    """

    def __init__(self, decode: Any, B: int, L: int, P: int, device, input_ids: Tensor, prompt_mask: Tensor,
                 lm: nn.Module):
        self.decode = decode
        self.eos = torch.tensor(decode.eos_token_ids, device=device)
        self.token = torch.full((B, 1), decode.pad_token_id, dtype=torch.long, device=device)   # [B, 1]
        self.position = torch.zeros((B, 1), dtype=torch.long, device=device)                    # [B, 1]
        self.slot = torch.full((1,), P, dtype=torch.long, device=device)   # the cache slot of `token`
        self.index = torch.zeros((1,), dtype=torch.long, device=device)    # the completion position drawn next
        self.finished = torch.zeros(B, dtype=torch.bool, device=device)
        self.tokens = torch.full((B, decode.max_new_tokens), decode.pad_token_id, dtype=torch.long, device=device)
        self.logprobs = (torch.zeros((B, decode.max_new_tokens), device=device)
                         if decode.sampler is not None else None)
        self.seen = None
        if decode.processing["repetition_penalty"] != 1.0:
            # The prompt's tokens, not its left padding (transformers 5.25's generate ignores it too;
            # 5.17 counted it, so a row's penalty depended on the batch it was padded in).
            vocab = lm.config.get_text_config().vocab_size
            seen = torch.zeros((B, vocab + 1), dtype=torch.bool, device=device)
            seen.scatter_(1, input_ids.masked_fill(prompt_mask == 0, vocab), True)
            self.seen = seen[:, :vocab].contiguous()
        # The 4D mask the decoding steps hand to the model: [B, 1, 1, L], over every cache slot.
        # The grouped attentions read what their mask covers.
        self.narrows = lm.config._attn_implementation in KERNELS.values()
        # decode_kernel "triton" (or "auto" on CUDA): a sampled draw by the Triton kernel
        # (draw_kernel.py) too, where the attention's kernel runs (CUDA, or Triton's interpreter in tests).
        self.kernel_draws = (decode.kernel_on(lm) == "triton" and decode.do_sample
                             and decode.sampler is None and triton_runs_on(torch.device(device)))
        visible = torch.zeros((B, 1, 1, L), dtype=torch.bool, device=device)
        visible[:, 0, 0, :P] = prompt_mask.bool()
        self.additive = lm.config._attn_implementation == "eager"
        if self.additive:
            dtype = next(lm.parameters()).dtype
            self.mask = torch.where(visible, torch.zeros((), dtype=dtype, device=device), torch.finfo(dtype).min)
        else:
            self.mask = visible

    @property
    def rows(self) -> int:
        return self.finished.shape[0]

    def select(self, keep: Tensor) -> "DecodeState":
        """A state of the rows `keep` [n] (indices into this batch), in new tensors; this one is left as it is."""
        new = object.__new__(DecodeState)
        for name, value in vars(self).items():
            batched = isinstance(value, Tensor) and name not in ("eos", "slot", "index")
            setattr(new, name, value.index_select(0, keep) if batched else value)
        new.slot, new.index = self.slot.clone(), self.index.clone()
        return new

    def open_slot(self, slots: int | None = None) -> Tensor:
        """The mask with `token`'s own slot opened (it attends to itself): over the first `slots`
        cache slots where the attention reads only what its mask covers, else (or with None)
        over all of them."""
        self.mask.index_fill_(3, self.slot, 0.0 if self.additive else True)
        return self.mask[..., :slots] if slots is not None and self.narrows else self.mask

    def take(self, logits: Tensor, first: bool = False) -> None:
        """Draws the next token from `logits` [B, V] (the model's dtype; the processors work in
        float32) and advances every tensor in place."""
        d = self.decode
        logps = None
        if d.sampler is not None:
            # transformers' repetition penalty first (the sampler is the last logits processor
            # under generate), then the sampler's own temperature and filters.
            logits = penalised(logits.float(), self.seen, d.processing["repetition_penalty"])
            token, logps = d.sampler.draw(logits, int(self.index))  # eager only: a host read per token
        elif self.kernel_draws:
            from .draw_kernel import gumbel_draw

            if filters_off(d.processing, logits.shape[-1]):  # the kernel divides by the temperature itself
                token = gumbel_draw(logits, d.processing["temperature"])
            else:
                token = gumbel_draw(process_logits(logits.float(), self.seen, **d.processing), 1.0)
        else:
            scores = process_logits(logits.float(), self.seen, **d.processing)
            token = gumbel_max(scores) if d.do_sample else row_argmax(scores)
        self.advance(token, logps, first)

    def advance(self, token: Tensor, logps: Tensor | None = None, first: bool = False) -> None:
        """Records the drawn `token` [B] (and the sampler's log-probs [B]) and moves every tensor on, in place."""
        d = self.decode
        if logps is not None:
            self.logprobs.index_copy_(1, self.index, logps.float()[:, None])
        token = torch.where(self.finished, torch.full_like(token, d.pad_token_id), token)
        self.tokens.index_copy_(1, self.index, token[:, None])
        self.finished |= (token[:, None] == self.eos).any(-1)
        if self.seen is not None:
            self.seen.scatter_(1, token[:, None], True)
        self.token.copy_(token[:, None])
        self.index.add_(1)
        if not first:
            self.slot.add_(1)
            self.position.add_(1)


def cache_rows_selectable(cache: Any) -> bool:
    """Whether `select_cache_rows` knows this cache's layout: transformers' plain static layers, whose
    only per-row tensors are their keys and values (not the layers with an indexer cache, say)."""
    from transformers.cache_utils import StaticLayer

    layers = getattr(cache, "layers", None)
    return bool(layers) and all(type(layer) is StaticLayer and isinstance(getattr(layer, "keys", None), Tensor)
                                for layer in layers)


def select_cache_rows(cache: Any, keep: Tensor) -> None:
    """Keeps the rows `keep` of every layer's static keys and values (new tensors; the old ones are freed)."""
    for layer in cache.layers:
        if isinstance(getattr(layer, "keys", None), Tensor):
            layer.keys = layer.keys.index_select(0, keep)
            layer.values = layer.values.index_select(0, keep)
            layer.batch_size = int(keep.numel())


def dtype_stable(cache: Any) -> Any:
    """The static cache, each layer's keys and values kept in the dtype of its first keys.

    Under autocast a float32 model's keys come out of the rotary embedding in float32 (it
    promotes) and its values out of `v_proj` in bfloat16. A dynamic cache stores each as it
    comes; a static one copies into buffers it allocates at the first update, and transformers
    5.17 allocates both in the keys' dtype, so `index_copy_` refused the values (the first
    generation of a float32 model with `bf16` on, on CUDA). Cast to the keys' dtype, then to
    the buffers': exact (bfloat16 widens to float32 without loss), and the attention casts
    both to autocast's dtype anyway, so it sees the values a dynamic cache gives it.
    `release_cache` undoes it when the generation ends.
    """
    for layer in getattr(cache, "layers", []):
        layer.update = _update_in_one_dtype(layer, layer.update)
    return cache


def _update_in_one_dtype(layer: Any, update: Any) -> Any:
    """`layer.update` casting as `dtype_stable` says. The layer is closed over, not bound as a
    default: dynamo keeps every function it traces in a cache keyed weakly by the function
    whose value holds the function's defaults (torch 2.11-2.13), so defaults that reach the
    layer kept the function, the layer and its buffers alive for the whole process: one KV
    cache more after every compiled generation (2.4 GiB each at 512 rows x 384 slots of the
    0.5B shape, measured on an H100 at db70797)."""

    def update_in_one_dtype(keys: Tensor, values: Tensor, *args: Any, **kwargs: Any):
        if getattr(layer, "is_initialized", False):
            keys, values = keys.to(layer.keys.dtype), values.to(layer.values.dtype)
        else:
            values = values.to(keys.dtype)
        return update(keys, values, *args, **kwargs)

    return update_in_one_dtype


def release_cache(cache: Any) -> None:
    """Frees the cache's buffers when a generation ends, whoever still holds its layers.

    Drops what `dtype_stable` installed (each layer's `update` closes over its layer, a cycle
    that only Python's cyclic collector would free, at a time that knows nothing of GPU memory)
    and every tensor a layer holds: after a compiled generation dynamo still references the
    last cache's layer list until the next one (torch 2.13 on the CPU), and would keep its
    buffers with it.
    """
    for layer in getattr(cache, "layers", []):
        layer.__dict__.pop("update", None)
        for name, value in list(vars(layer).items()):
            if isinstance(value, Tensor):
                setattr(layer, name, None)


def cache_keyword(lm: nn.Module) -> str:
    """The forward's name for the KV cache: `cache` from transformers 5.2x, `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(type(lm).forward).parameters else "past_key_values"


# One side stream a device for every capture's eager warm-up. cuBLAS keeps a workspace for each
# stream it has run a GEMM on, allocated through the caching allocator and never freed; a new
# pool stream a capture left one behind each time, until the pool's 32 streams had one each.
# That fits what GRPO's memory at rest did at f7eace9 on an H100: 64.5 MiB more at step 3 than at
# step 2, with two captures a generation (windows of 256 and 384 slots). Reusing one stream is
# the way around it that PyTorch's maintainers give (pytorch/pytorch#99196).
_WARMUP_STREAMS: dict[torch.device, "torch.cuda.Stream"] = {}


def warmup_stream(device) -> "torch.cuda.Stream":
    """The side stream captures on `device` warm up on, made once."""
    device = torch.device(device)
    if device.index is None:
        device = torch.device(device.type, torch.cuda.current_device())
    stream = _WARMUP_STREAMS.get(device)
    if stream is None:
        stream = _WARMUP_STREAMS[device] = torch.cuda.Stream(device)
    return stream


def capture_step(decode_step, device, slots: int) -> "torch.cuda.CUDAGraph":
    """Runs one decoding step over `slots` cache slots (`decode_step(slots)`) eagerly, on the
    device's warm-up stream as capture needs (a compiled step compiles here, outside the
    capture), then records it as a graph."""
    stream = warmup_stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        decode_step(slots)
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode_step(slots)  # recorded, not run
    return graph


def write_back(state: DecodeState, rows: Tensor, tokens: Tensor, logprobs: Tensor | None) -> None:
    """Copies the live batch's tokens (and log-probs) into the whole batch's rows `rows`."""
    if state.tokens is not tokens:
        tokens.index_copy_(0, rows, state.tokens)
        if logprobs is not None:
            logprobs.index_copy_(0, rows, state.logprobs)
