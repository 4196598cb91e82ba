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

With `compile_step` the step is first compiled by torch.compile (inductor), which fuses each
layer's element-wise work (norms, rotary embedding, activations, residual adds) and the
processors and draw into a few kernels; the graph is then captured from the compiled step. The
compiled code takes the parameters as inputs (inductor's freezing is off: no storage is baked
in), so it serves every generation's weights, and with dynamic shapes it serves every batch
size, cache length and window without compiling again. Its draws use inductor's random
numbers, not eager `torch.rand`'s: the same distribution, other samples; greedy tokens are
the same.

Sampling is transformers' (and so TRL's): the repetition penalty over the prompt (not its
left padding, as transformers 5.25's generate; 5.17's counted the padding, which made a
row's draws depend on its batch) and the completion so far, then temperature, top-k, top-p
and min-p, then an exact draw from the softmax of what is left (Gumbel-max: argmax of the
filtered logits plus Gumbel noise). After its EOS a row gets padding. With a `KeyedSampler`
the penalty applies first and the sampler then draws each token (eagerly: its draw is keyed
on host-side state), as under generate, where it is the last logits processor.

Supported: decoder models whose layers all attend to the whole row (no sliding window) with
eager or sdpa attention, the mask handed to the model as a 4D tensor (`masking_utils` takes
it as it is). For anything else `generate` is called instead, with the same flags.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from typing import Any, Sequence

import torch
from torch import Tensor, nn

from fusedalign.architectures import post_processing_of
from fusedalign.attention.checks import layer_windows
from fusedalign.head import unwrap_model

from .base import GenerationOutput, RowKey, cut_after_eos, left_pad
from .hf import HFGenerate
from .decode_state import (
    DecodeState,
    cache_keyword,
    capture_step,
    cache_rows_selectable,
    dtype_stable,
    gumbel_max,
    process_logits,
    release_cache,
    select_cache_rows,
    write_back,
)
from . import sampling_head as sampling
from .decode_attention import (GROUPED, GROUPED_TRITON, KERNEL_CHOICES, decoding_attention, decoding_implementation,
                               kernel_for)
from .fused_projections import fused_projections
from .keyed import KeyedSampler

MASK_IMPLEMENTATIONS = (GROUPED, GROUPED_TRITON, "sdpa", "eager")


def graphs_possible(device: torch.device) -> bool:
    """Whether the decoding step can be captured as a CUDA graph on `device`."""
    return device.type == "cuda"


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
        compact_below: at a check, when at most this share of the batch's rows is still
            decoding, those rows continue as a batch of their own (0: never), so that a window
            of uneven lengths costs its tokens rather than its longest row times its rows.
        fused_sampling: draw each token inside the head's forward, chunk by chunk over the
            vocabulary (`generation/sampling_head.py`), instead of from the [B, V] logits; used
            where it can be (no top-k, top-p or min-p; a linear or LoRA head), else the logits path.
        window_slots: a step's attention reads only the KV-cache slots written so far (the rest
            are masked; `decode_attention`): eager steps exactly those, a CUDA graph
            those up to the next multiple of this, captured again when the tokens outgrow it
            (0: every graph reads the whole cache). Attention implementations other than the
            grouped sdpa read the whole cache.
        compile_step: compile the decoding step with torch.compile (inductor: each layer's
            element-wise work and the processors and draw fused into fewer kernels) before it is
            captured as a graph. The first call compiles (once per process: dynamic shapes). Not
            with a KeyedSampler, whose draw reads host-side state every token.
        decode_kernel: what computes a step's grouped attention: "sdpa" (the grouped sdpa,
            `decode_attention.py`), "triton" (`decode_kernel.py`, on CUDA) or "auto" (the
            default: "triton" on CUDA where Triton is installed, "sdpa" elsewhere;
            `decode_attention.kernel_for`; uncompiled, 1.32x the grouped sdpa's tokens/s at batch
            512 on an H100, the same peak, bda33d2). With "triton" a sampled token drawn from
            the logits is drawn by a Triton kernel too (`draw_kernel.py`: the Gumbel noise made
            inside it, the logits read once in their dtype); greedy decoding is unchanged.
        fuse_projections: each layer's q, k and v projections as one GEMM, and its gate and up
            projections as one, for the length of a call (`generation/fused_projections.py`; models
            of the Llama, Qwen2/3, Mistral and Gemma/Gemma2 forms with plain linear layers; opt-in:
            on an H100 at bda33d2 it adds 1.2% to uncompiled generation at batch 512 for 1.0 GiB
            more at the peak (the fused weights are copies for the call), and 7.4% to GRPO's
            completions/s with the step compiled and the Triton kernels).
    """

    def __init__(self, *, max_new_tokens: int, eos_token_id: int | Sequence[int], pad_token_id: int,
                 bos_token_id: int | None = None, do_sample: bool = True, temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = 0, min_p: float | None = None, repetition_penalty: float = 1.0,
                 sampler: KeyedSampler | None = None, cuda_graphs: bool = True, check_every: int = 16,
                 compact_below: float = 0.5, fused_sampling: bool = False, window_slots: int = 256,
                 compile_step: bool = False, decode_kernel: str = "auto", fuse_projections: bool = False):
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        if decode_kernel not in KERNEL_CHOICES:
            raise ValueError(f"decode_kernel must be one of {list(KERNEL_CHOICES)}, got {decode_kernel!r}")
        if decode_kernel == "triton" and importlib.util.find_spec("triton") is None:
            raise ValueError("decode_kernel='triton' needs Triton, which is not installed; use decode_kernel='sdpa'")
        self.decode_kernel = decode_kernel
        self.max_new_tokens = max_new_tokens
        self.eos_token_ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
        self.pad_token_id = pad_token_id
        self.sampler = sampler
        self.do_sample = do_sample
        self.processing = dict(repetition_penalty=repetition_penalty, temperature=temperature if do_sample else 1.0,
                               top_k=top_k if do_sample else 0, top_p=top_p if do_sample else 1.0,
                               min_p=min_p if do_sample else None)
        self.cuda_graphs = cuda_graphs
        self.window_slots = window_slots
        self.check_every = max(1, check_every)
        if not 0 <= compact_below < 1:
            raise ValueError(f"compact_below must be in [0, 1), got {compact_below}")
        self.compact_below = compact_below
        self.fused_sampling = fused_sampling
        self.compile_step = compile_step
        self.fuse_projections = fuse_projections
        self._announced = False
        self.fallback = HFGenerate(max_new_tokens=max_new_tokens, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                                   bos_token_id=bos_token_id, do_sample=do_sample, temperature=temperature,
                                   top_p=top_p, top_k=top_k, min_p=min_p, repetition_penalty=repetition_penalty,
                                   sampler=sampler)
        # How the last call ran: "path", "graph", "graphs" (captured), "steps" (tokens drawn),
        # "batch_sizes" (the rows decoded, then after each compaction), "compiled", "attention".
        self.last_call: dict[str, Any] = {}

    @classmethod
    def from_args(cls, args: Any, tokenizer: Any, sampler: KeyedSampler | None = None) -> "StaticDecode":
        """From a GRPOConfig's sampling flags and the policy's tokenizer."""
        return cls(max_new_tokens=args.max_completion_length, eos_token_id=tokenizer.eos_token_id,
                   pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                   temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                   repetition_penalty=args.repetition_penalty, sampler=sampler,
                   compile_step=getattr(args, "compile_generation", False),
                   fused_sampling=getattr(args, "fused_sampling", False),
                   decode_kernel=getattr(args, "decode_kernel", "auto"),
                   fuse_projections=getattr(args, "fuse_projections", False))

    def unsupported(self, model: nn.Module) -> str | None:
        """Why this loop cannot decode `model` (None: it can)."""
        lm = unwrap_model(model)
        implementation = decoding_implementation(lm, self.kernel_on(lm))
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
        lm = unwrap_model(model)
        why_not_fused = sampling.usable(lm, self.processing, self.sampler) if self.fused_sampling else "not asked"
        # The sampling head is installed once for the whole call, outside the step: installing it
        # inside would swap a module's forward in the compiled step, a graph break.
        head = None if why_not_fused else self._sampling_state(post_processing_of(lm))
        with torch.no_grad(), decoding_attention(lm, self.kernel_on(lm)), \
                sampling.sampling_head(lm, head) if head is not None else contextlib.nullcontext(), \
                fused_projections(lm) if self.fuse_projections else contextlib.nullcontext() as fused:
            tokens, logprobs = self._decode(model, input_ids, attention_mask, row_keys, step, head)
        self.last_call["why_not_fused"] = why_not_fused
        self.last_call["fused_projections"] = None if fused is None else {"mlps": fused.mlps,
                                                                          "attentions": fused.attentions}
        completions, truncated = cut_after_eos(tokens, self.eos_token_ids)
        if logprobs is not None:
            rows = logprobs.cpu().tolist()
            logprobs = [row[: len(c)] for row, c in zip(rows, completions)]
        return GenerationOutput(completions, truncated, logprobs)

    def kernel_on(self, lm: nn.Module) -> str:
        """The grouped attention's kernel (a key of `KERNELS`) a generation by `lm` uses: `decode_kernel`,
        "auto" made "triton" or "sdpa" for the device of `lm`'s weights."""
        return kernel_for(self.decode_kernel, next(lm.parameters()).device)

    # ------------------------------------------------------------------ the loop

    def _decode(self, model: nn.Module, input_ids: Tensor, prompt_mask: Tensor, row_keys, step: int,
                head: "sampling.SamplingHead | None"):
        """[B, max_new_tokens] tokens (padding after each row's EOS), and the sampler's log-probs;
        with `head` (installed) each token is drawn inside the head's forward."""
        from transformers import StaticCache

        # A few slots more than the tokens need (to the next multiple of 16, at least one): the
        # first slots a step reads are then never the whole cache, nor contiguous, so a compiled
        # step does not specialise on whether they are. The slots past them stay masked.
        slots = ((input_ids.shape[1] + self.max_new_tokens) // 16 + 1) * 16
        cache = dtype_stable(StaticCache(config=unwrap_model(model).config, max_cache_len=slots))
        try:
            return self._decode_into(cache, slots, model, input_ids, prompt_mask, row_keys, step, head)
        finally:
            release_cache(cache)  # its buffers go with the call, whatever traced its layers

    def _decode_into(self, cache: Any, slots: int, model: nn.Module, input_ids: Tensor, prompt_mask: Tensor,
                     row_keys, step: int, head: "sampling.SamplingHead | None"):
        """`_decode` in the static cache `cache` of `slots` slots."""
        device = next(model.parameters()).device
        B, P = input_ids.shape
        L = P + self.max_new_tokens  # the slots the tokens need
        input_ids, prompt_mask = input_ids.to(device), prompt_mask.to(device)
        lm = unwrap_model(model)
        keyword = cache_keyword(lm)
        # Positions as generate gives them to left-padded rows.
        positions = (prompt_mask.cumsum(-1) - 1).clamp(min=0)
        if self.sampler is not None:
            self.sampler.bind(row_keys, P, step)
        state = DecodeState(self, B, slots, P, device, input_ids, prompt_mask, lm)
        if head is not None:
            head.seen = state.seen  # and again whenever compaction rebinds `state`

        def forward_and_draw(first: bool = False, **inputs) -> None:
            if head is None:
                logits = model(use_cache=True, logits_to_keep=1, **{keyword: cache}, **inputs).logits
                state.take(logits[:, -1], first=first)
                return
            if self.sampler is not None:
                head.position = int(state.index)  # keyed: eager, a host read per token
            drawn = model(use_cache=True, logits_to_keep=1, **{keyword: cache}, **inputs).logits[:, -1]
            state.advance(drawn[:, 0].long(), drawn[:, 1] if self.sampler is not None else None, first)

        forward_and_draw(first=True, input_ids=input_ids, attention_mask=prompt_mask, position_ids=positions)
        state.position.copy_(positions[:, -1:] + 1)
        tokens = state.tokens  # [B, max_new_tokens]: each row's tokens, written back at every compaction
        logprobs = state.logprobs
        rows = torch.arange(B, device=device)  # the row of the whole batch each live row is

        def decode_step(slots: int):  # reads `state` as it is bound when it runs: compaction rebinds it
            forward_and_draw(input_ids=state.token, attention_mask=state.open_slot(slots), position_ids=state.position)

        compiled = self.compile_step and self.sampler is None  # a keyed draw reads the host every token
        if compiled:
            # Dynamic shapes: one compilation serves every batch size (compaction), window and cache
            # length; dynamo keeps it for later calls (a new `decode_step` has the same code).
            decode_step = torch.compile(decode_step, dynamic=True)
            self._announce_compilation()

        remaining = self.max_new_tokens - 1
        use_graphs = self.cuda_graphs and graphs_possible(device) and self.sampler is None
        graph, done, graphs, sizes, window = None, 0, 0, [B], L
        while done < remaining:
            written = P + done + 1  # the cache slots this step attends to: the prompt's, the tokens', its own
            if graph is not None and written > window:
                del graph  # captured for fewer slots than this step needs
                graph = None
            if use_graphs and graph is None and remaining - done > 1:
                window = self._window(written, L)
                graph = capture_step(decode_step, device, window)  # its warm-up is a real step, eager
                graphs += 1
            elif graph is not None:
                graph.replay()
            else:
                decode_step(written)
            done += 1
            if done % self.check_every:
                continue
            live = ~state.finished
            left = int(live.sum())
            if left == 0:
                break
            if self._compacts(left, state.rows, cache) and done < remaining:
                keep = live.nonzero()[:, 0]
                write_back(state, rows, tokens, logprobs)
                del graph  # its memory pool goes with it
                graph, rows = None, rows.index_select(0, keep)
                state = state.select(keep)
                if head is not None:
                    head.seen = state.seen
                select_cache_rows(cache, keep)
                if self.sampler is not None:
                    self.sampler.select(keep)
                sizes.append(left)
        write_back(state, rows, tokens, logprobs)
        self.last_call = {"path": "static", "graph": graphs > 0, "graphs": graphs, "steps": 1 + done,
                          "batch_sizes": sizes, "fused_sampling": head is not None, "compiled": compiled,
                          "attention": lm.config._attn_implementation, "decode_kernel": self.kernel_on(lm),
                          "draw_kernel": state.kernel_draws and head is None}
        del graph, cache
        return tokens, logprobs

    def _sampling_state(self, post: Any) -> "sampling.SamplingHead":
        """The sampling head's flags for a call (a keyed sampler's temperature is its own); the
        loop sets its `seen` (and a keyed sampler's `position`) as it goes."""
        keyed = self.sampler is not None
        return sampling.SamplingHead(
            post, repetition_penalty=self.processing["repetition_penalty"],
            temperature=self.sampler.temperature if keyed else self.processing["temperature"],
            do_sample=self.do_sample, seen=None, sampler=self.sampler)

    def _announce_compilation(self) -> None:
        """One line, on the first compiled call (from one rank): why that generation takes longer."""
        if self._announced:
            return
        self._announced = True
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            print("[fusedalign] compiling the decoding step (compile_step, --compile_generation): the first "
                  "generation takes longer, once a run", file=sys.stderr)

    def _window(self, written: int, L: int) -> int:
        """The cache slots a graph captured when `written` are in use attends to: up to the next
        multiple of `window_slots` (all `L` when 0)."""
        if self.window_slots <= 0:
            return L
        return min(L, -(-written // self.window_slots) * self.window_slots)

    def _compacts(self, left: int, rows: int, cache: Any) -> bool:
        """Whether to gather the `left` live rows of `rows` into a batch of their own now."""
        return self.compact_below > 0 and left <= self.compact_below * rows and cache_rows_selectable(cache)
