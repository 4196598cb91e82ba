"""StaticDecode: sampling in a decode loop of our own, on a static KV cache, one CUDA graph a token.

Why not `generate`: at GRPO's batch sizes a decoding step of a small model is bound by the
host, not the GPU. transformers' `generate` (TRL's path without vLLM) launches every kernel
of every step from Python and, on CUDA, reads `unfinished_sequences.max()` back after each
token, so the host waits for the GPU to drain before it may launch the next step: the two
never overlap. Its compiled path (`cache_implementation="static"`, auto-compile) removes
the launches but compiles for a minute and captures parameter storage that ZeRO-3 and FSDP2
gather anew for every generation.

Here the whole decoding step — the model's forward on the new token, the logits processors,
the draw, the end-of-sequence bookkeeping and the state for the next step — reads and writes
only tensors allocated once per call, so on CUDA it is captured as one CUDA graph after one
eager warm-up step and replayed for every further token. The graph is captured anew for each
`generate` call (milliseconds against seconds of decoding) and dropped after, so it only
ever reads the weights `generation_weights` made whole for this generation, on any backend.
The host asks whether every row has finished once every `check_every` tokens.

Sampling is transformers' (and so TRL's): the repetition penalty over the prompt (padding
included, as generate does) and the completion so far, then temperature, top-k, top-p and
min-p, then an exact draw from the softmax of what is left (Gumbel-max: argmax of the
filtered logits plus Gumbel noise). After its EOS a row gets padding. With a `KeyedSampler`
the sampler draws each token instead (eagerly: its draw is keyed on host-side state).

Supported: decoder models whose layers all attend to the whole row (no sliding window) with
eager or sdpa attention, the mask handed to the model as a 4D tensor (`masking_utils` takes
it as it is). For anything else `generate` is called instead, with the same flags.
"""

from __future__ import annotations

import inspect
from typing import Any, Sequence

import torch
from torch import Tensor, nn

from fusedalign.attention.checks import layer_windows
from fusedalign.head import unwrap_model

from .base import GenerationOutput, RowKey, cut_after_eos, left_pad
from .hf import HFGenerate
from .keyed import KeyedSampler, filter_logits

MASK_IMPLEMENTATIONS = ("sdpa", "eager")


def process_logits(z: Tensor, seen: Tensor | None, *, repetition_penalty: float = 1.0, temperature: float = 1.0,
                   top_k: int = 0, top_p: float = 1.0, min_p: float | None = None) -> Tensor:
    """transformers' logits processors, in its order: repetition penalty, temperature, top-k, top-p, min-p.

    Args:
        z: [B, V] float32 logits of the next token.
        seen: [B, V] bool, the tokens of the row so far (prompt padding included), or None
            when `repetition_penalty` is 1.

    Returns:
        [B, V] float32 scores; filtered tokens hold the dtype's minimum.
    """
    if repetition_penalty != 1.0:
        z = torch.where(seen, torch.where(z < 0, z * repetition_penalty, z / repetition_penalty), z)
    return filter_logits(z / temperature, top_k, top_p, min_p)


def gumbel_max(scores: Tensor) -> Tensor:
    """[B] tokens drawn from softmax(scores [B, V]) as argmax(scores + Gumbel noise).

    `torch.rand` draws from the device's default generator, which CUDA graphs replay with a
    new offset each time. A uniform draw of exactly 0 gives -inf noise (never chosen).
    """
    u = torch.rand_like(scores)
    return (scores - torch.log(-torch.log(u))).argmax(-1)


class StaticDecode:
    """A generator (see `fusedalign.generation.base.Generator`) with TRL's sampling flags.

    Args:
        max_new_tokens: max_completion_length.
        eos_token_id: one id or several (any ends a completion).
        pad_token_id: the left-padding id, and what a finished row gets.
        do_sample: False for greedy decoding.
        sampler: a KeyedSampler, which then draws every token (no CUDA graph).
        cuda_graphs: capture the decoding step as a CUDA graph on a CUDA device.
        check_every: tokens between two host-side checks that every row has finished.
    """

    def __init__(self, *, max_new_tokens: int, eos_token_id: int | Sequence[int], pad_token_id: int,
                 bos_token_id: int | None = None, do_sample: bool = True, temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = 0, min_p: float | None = None, repetition_penalty: float = 1.0,
                 sampler: KeyedSampler | None = None, cuda_graphs: bool = True, check_every: int = 16):
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.max_new_tokens = max_new_tokens
        self.eos_token_ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
        self.pad_token_id = pad_token_id
        self.sampler = sampler
        self.do_sample = do_sample
        self.processing = dict(repetition_penalty=repetition_penalty, temperature=temperature if do_sample else 1.0,
                               top_k=top_k if do_sample else 0, top_p=top_p if do_sample else 1.0,
                               min_p=min_p if do_sample else None)
        self.cuda_graphs = cuda_graphs
        self.check_every = max(1, check_every)
        self.fallback = HFGenerate(max_new_tokens=max_new_tokens, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                                   bos_token_id=bos_token_id, do_sample=do_sample, temperature=temperature,
                                   top_p=top_p, top_k=top_k, min_p=min_p, repetition_penalty=repetition_penalty,
                                   sampler=sampler)
        self.last_call: dict[str, Any] = {}  # how the last call ran: "path", "graph", "steps" (tokens drawn)

    @classmethod
    def from_args(cls, args: Any, tokenizer: Any, sampler: KeyedSampler | None = None) -> "StaticDecode":
        """From a GRPOConfig's sampling flags and the policy's tokenizer."""
        return cls(max_new_tokens=args.max_completion_length, eos_token_id=tokenizer.eos_token_id,
                   pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                   temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                   repetition_penalty=args.repetition_penalty, sampler=sampler)

    @staticmethod
    def unsupported(model: nn.Module) -> str | None:
        """Why this loop cannot decode `model` (None: it can)."""
        lm = unwrap_model(model)
        implementation = getattr(lm.config, "_attn_implementation", None)
        if implementation not in MASK_IMPLEMENTATIONS:
            return f"attention implementation {implementation!r} (the loop needs one of {MASK_IMPLEMENTATIONS})"
        if any(w is not None for w in layer_windows(lm).values()):
            return "sliding-window layers"
        if getattr(lm.config, "is_encoder_decoder", False):
            return "an encoder-decoder model"
        return None

    def generate(self, model: Any, prompt_ids: Sequence[Sequence[int]], row_keys: Sequence[RowKey], *,
                 step: int = 0) -> GenerationOutput:
        """Completions of the prompts; `model` is the whole-weights model `generation_weights` yields."""
        if len(row_keys) != len(prompt_ids):
            raise ValueError(f"{len(prompt_ids)} prompts but {len(row_keys)} row keys")
        reason = self.unsupported(model)
        if reason is not None:
            self.last_call = {"path": "generate", "why": reason}
            return self.fallback.generate(model, prompt_ids, row_keys, step=step)
        input_ids, attention_mask = left_pad(prompt_ids, self.pad_token_id)
        with torch.no_grad():
            tokens, logprobs = self._decode(model, input_ids, attention_mask, row_keys, step)
        completions, truncated = cut_after_eos(tokens, self.eos_token_ids)
        if logprobs is not None:
            rows = logprobs.cpu().tolist()
            logprobs = [row[: len(c)] for row, c in zip(rows, completions)]
        return GenerationOutput(completions, truncated, logprobs)

    # ------------------------------------------------------------------ the loop

    def _decode(self, model: nn.Module, input_ids: Tensor, prompt_mask: Tensor, row_keys, step: int):
        """[B, max_new_tokens] tokens (padding after each row's EOS), and the sampler's log-probs."""
        from transformers import StaticCache

        device = next(model.parameters()).device
        B, P = input_ids.shape
        L = P + self.max_new_tokens
        input_ids, prompt_mask = input_ids.to(device), prompt_mask.to(device)
        lm = unwrap_model(model)
        cache = {_cache_keyword(lm): _dtype_stable(StaticCache(config=lm.config, max_cache_len=L))}
        # Positions as generate gives them to left-padded rows.
        positions = (prompt_mask.cumsum(-1) - 1).clamp(min=0)
        if self.sampler is not None:
            self.sampler.bind(row_keys, P, step)
        state = _State(self, B, L, P, device, input_ids, prompt_mask, lm)
        out = model(input_ids=input_ids, attention_mask=prompt_mask, position_ids=positions, use_cache=True,
                    logits_to_keep=1, **cache)
        state.take(out.logits[:, -1].float(), first=True)
        state.position.copy_(positions[:, -1:] + 1)

        def decode_step():
            logits = model(input_ids=state.token, attention_mask=state.open_slot(), position_ids=state.position,
                           use_cache=True, logits_to_keep=1, **cache).logits
            state.take(logits[:, -1].float())

        graph = None
        remaining = self.max_new_tokens - 1
        use_graph = (self.cuda_graphs and device.type == "cuda" and self.sampler is None and remaining > 1)
        done = 0
        if use_graph:
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                decode_step()  # the warm-up step: a real step, eager
            torch.cuda.current_stream(device).wait_stream(stream)
            done = 1
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                decode_step()  # recorded, not run
        while done < remaining:
            if graph is not None:
                graph.replay()
            else:
                decode_step()
            done += 1
            if done % self.check_every == 0 and bool(state.finished.all()):
                break
        self.last_call = {"path": "static", "graph": graph is not None, "steps": 1 + done}
        tokens = state.tokens.clone()
        logprobs = state.logprobs.clone() if state.logprobs is not None else None
        del graph, cache
        return tokens, logprobs


def _dtype_stable(cache: Any) -> Any:
    """The static cache, each layer's keys and values kept in the dtype of its first keys.

    Under autocast a float32 model's keys come out of the rotary embedding in float32 (it
    promotes) and its values out of `v_proj` in bfloat16. A dynamic cache stores each as it
    comes; a static one copies into buffers it allocates at the first update, and transformers
    5.17 allocates both in the keys' dtype, so `index_copy_` refused the values (the first
    generation of a float32 model with `bf16` on, on CUDA). Cast to the keys' dtype, then to
    the buffers': exact (bfloat16 widens to float32 without loss), and the attention casts
    both to autocast's dtype anyway, so it sees the values a dynamic cache gives it.
    """
    for layer in getattr(cache, "layers", []):
        update = layer.update

        def update_in_one_dtype(keys: Tensor, values: Tensor, *args: Any, _layer=layer, _update=update, **kwargs):
            if getattr(_layer, "is_initialized", False):
                keys, values = keys.to(_layer.keys.dtype), values.to(_layer.values.dtype)
            else:
                values = values.to(keys.dtype)
            return _update(keys, values, *args, **kwargs)

        layer.update = update_in_one_dtype
    return cache


def _cache_keyword(lm: nn.Module) -> str:
    """The forward's name for the KV cache: `cache` from transformers 5.2x, `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(type(lm).forward).parameters else "past_key_values"


class _State:
    """The decoding loop's tensors, allocated once per call and only ever written in place."""

    def __init__(self, decode: StaticDecode, B: int, L: int, P: int, device, input_ids: Tensor, prompt_mask: Tensor,
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
            self.seen = torch.zeros((B, lm.config.get_text_config().vocab_size), dtype=torch.bool, device=device)
            self.seen.scatter_(1, input_ids, True)
        # The 4D mask the decoding steps hand to the model: [B, 1, 1, L], over every cache slot.
        visible = torch.zeros((B, 1, 1, L), dtype=torch.bool, device=device)
        visible[:, 0, 0, :P] = prompt_mask.bool()
        self.additive = lm.config._attn_implementation == "eager"
        if self.additive:
            dtype = next(lm.parameters()).dtype
            self.mask = torch.where(visible, torch.zeros((), dtype=dtype, device=device), torch.finfo(dtype).min)
        else:
            self.mask = visible

    def open_slot(self) -> Tensor:
        """The mask with `token`'s own slot opened (it attends to itself)."""
        self.mask.index_fill_(3, self.slot, 0.0 if self.additive else True)
        return self.mask

    def take(self, logits: Tensor, first: bool = False) -> None:
        """Draws the next token from `logits` [B, V] float32 and advances every tensor in place."""
        d = self.decode
        if d.sampler is not None:
            token, logps = d.sampler.draw(logits, int(self.index))  # eager only: a host read per token
            self.logprobs.index_copy_(1, self.index, logps.float()[:, None])
        else:
            scores = process_logits(logits, self.seen, **d.processing)
            token = gumbel_max(scores) if d.do_sample else scores.argmax(-1)
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
