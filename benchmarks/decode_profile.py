"""Where one StaticDecode token goes: the decoding step split into its parts, each timed alone.

At each batch size, on the benchmark model (Qwen2.5-0.5B-shaped random init, bf16) with its
static cache filled to the mean context of a rollout (--prompt_length + --new_tokens / 2), one
decoding step is cut into the parts `DecodeState.take` and the loop run, and each part is
captured as a CUDA graph of its own and replayed --repeats times between two CUDA events:

    forward     the model on the new token: every layer, the head, [B, V] logits in bf16
    to_float    the logits made float32 ([B, V])
    processors  repetition penalty (when on), temperature, top-k, top-p, min-p
    draw        the Gumbel-max draw: uniform noise, its double log, the argmax
    (with --decode_kernel triton and no filtering flags, also the Triton draw kernel alone, which
    the step runs instead of the three above: `generation/draw_kernel.py`)
    bookkeeping padding after EOS, the token written, the finished flags, the next position

then the whole step as one graph (what StaticDecode replays) and the whole step eager (what
the host adds: the launches); with --compile, the whole step compiled by inductor and then
captured (what StaticDecode(compile_step=True) replays); with --fused_sampling, the whole step
with the draw inside the head (`generation/sampling_head.py`: no [B, V] logits, what
StaticDecode(fused_sampling=True) runs), as one graph and, with --compile, compiled first; with
--fuse_projections, the whole step with each layer's q/k/v and gate/up projections as one GEMM
each (`generation/fused_projections.py`), likewise. The decode limit of the shape at
that batch and context (`harness/decode_limit.py`, datasheet peaks) sets the floor the step
could reach.

Examples:
    python benchmarks/decode_profile.py                          # batch 64 256 512
    python benchmarks/decode_profile.py --top_k 50 --top_p 0.9   # with TRL's filtering flags
    python benchmarks/decode_profile.py --batches 512 --compile --fused_sampling --decode_kernel triton
    python benchmarks/decode_profile.py --device cpu --tiny      # smoke test (eager, wall clock)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import shutil
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.builders.model import build_model  # noqa: E402
from benchmarks.harness.decode_limit import Shape, peaks_of, step_seconds  # noqa: E402
from benchmarks.harness.env import log, versions, versions_line  # noqa: E402
from benchmarks.harness.tables import markdown, write_markdown  # noqa: E402

PARTS = ("forward", "to_float", "processors", "draw", "bookkeeping")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default=None)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--batches", type=int, nargs="+", default=None, help="default 64 256 512 (--tiny: 4)")
    p.add_argument("--prompt_length", type=int, default=None, help="default 128 (--tiny: 8)")
    p.add_argument("--new_tokens", type=int, default=None, help="default 256 (--tiny: 8)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top_k", type=int, default=0)
    p.add_argument("--top_p", type=float, default=1.0)
    p.add_argument("--min_p", type=float, default=None)
    p.add_argument("--repetition_penalty", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--model_dir", default=None)
    p.add_argument("--markdown_out", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--attn_implementation", default=None, help="the model's attention (default: transformers')")
    p.add_argument("--window_slots", type=int, default=256,
                   help="StaticDecode's window_slots: the cache slots a step reads (0: all)")
    p.add_argument("--transformers_attention", action="store_true",
                   help="decode through the model's own attention, not StaticDecode's grouped sdpa")
    p.add_argument("--decode_kernel", choices=["sdpa", "triton"], default="sdpa",
                   help="the grouped attention's kernel (StaticDecode's decode_kernel; triton: CUDA only)")
    p.add_argument("--compile", action="store_true",
                   help="also time the whole step compiled by torch.compile (inductor) before capture, as "
                        "StaticDecode(compile_step=True) runs it")
    p.add_argument("--fused_sampling", action="store_true",
                   help="also time the whole step with the draw inside the head (StaticDecode(fused_sampling=True)), "
                        "as one graph and, with --compile, compiled first")
    p.add_argument("--fuse_projections", action="store_true",
                   help="also time the whole step with each layer's q/k/v and gate/up projections as one GEMM each "
                        "(StaticDecode(fuse_projections=True)), as one graph and, with --compile, compiled first; "
                        "and, with --kernels, its compiled step's kernels")
    p.add_argument("--kernels", type=int, default=0, metavar="N",
                   help="also list the N kernels that take the most GPU time in the forward (torch.profiler) "
                        "and, with --compile, in the whole compiled step")
    args = p.parse_args(argv)
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.decode_kernel == "triton" and args.device != "cuda":
        p.error("--decode_kernel triton runs on CUDA only (on the CPU the step would use the grouped sdpa)")
    for key, big, small in (("batches", [64, 256, 512], [4]), ("prompt_length", 128, 8), ("new_tokens", 256, 8)):
        if getattr(args, key) is None:
            setattr(args, key, small if args.tiny else big)
    return args


class Clock:
    """Milliseconds per call of a function: CUDA graph replays between events, or eager wall clock."""

    def __init__(self, device, repeats: int):
        self.device, self.repeats = device, repeats

    def graph_ms(self, fn) -> float:
        import torch

        if self.device.type != "cuda":
            return self.eager_ms(fn)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(self.repeats):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / self.repeats

    def eager_ms(self, fn) -> float:
        import torch

        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        fn()
        sync()
        t0 = time.perf_counter()
        for _ in range(self.repeats):
            fn()
        sync()
        return (time.perf_counter() - t0) * 1000 / self.repeats


def profile_batch(args, model, batch: int, clock: Clock) -> dict[str, float]:
    import torch
    from transformers import StaticCache

    from fusedalign.architectures import post_processing_of
    from fusedalign.generation import StaticDecode
    from fusedalign.generation import sampling_head as sampling
    from fusedalign.generation.decode_state import (
        DecodeState,
        cache_keyword,
        dtype_stable,
        filters_off,
        gumbel_max,
        process_logits,
    )

    device = next(model.parameters()).device
    vocab = model.config.vocab_size
    decode = StaticDecode(max_new_tokens=args.new_tokens, eos_token_id=vocab - 1, pad_token_id=0,
                          temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                          repetition_penalty=args.repetition_penalty, decode_kernel=args.decode_kernel)
    if args.fused_sampling and (why := sampling.usable(model, decode.processing, None)):
        raise SystemExit(f"decode_profile.py: --fused_sampling: the sampling head cannot draw here: {why}")
    post = post_processing_of(model) if args.fused_sampling else None
    context = args.prompt_length + args.new_tokens // 2
    gen = torch.Generator().manual_seed(args.seed + batch)
    ids = torch.randint(1, vocab, (batch, context), generator=gen).to(device)
    mask = torch.ones_like(ids)
    cache = dtype_stable(StaticCache(config=model.config, max_cache_len=context + args.new_tokens))
    keyword = cache_keyword(model)
    state = DecodeState(decode, batch, context + args.new_tokens, context, device, ids, mask, model)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1), use_cache=True,
                    logits_to_keep=1, **{keyword: cache})
        state.take(out.logits[:, -1], first=True)
        state.position.fill_(context)
        buffers = {"logits": None, "z": None, "scores": None, "token": None}

        def rewind():  # every replay writes the same cache slot, inside the buffers
            for layer in cache.layers:
                layer.cumulative_length.fill_(context)

        def forward():
            rewind()
            buffers["logits"] = model(input_ids=state.token, attention_mask=state.open_slot(window),
                                      position_ids=state.position, use_cache=True, logits_to_keep=1,
                                      **{keyword: cache}).logits[:, -1]

        def to_float():
            buffers["z"] = buffers["logits"].float()

        def processors():
            buffers["scores"] = process_logits(buffers["z"], state.seen, **decode.processing)

        def draw():
            buffers["token"] = gumbel_max(buffers["scores"])

        def bookkeeping():
            token = torch.where(state.finished, torch.full_like(buffers["token"], 0), buffers["token"])
            state.tokens.index_copy_(1, state.index.clamp(max=args.new_tokens - 1), token[:, None])
            state.finished |= (token[:, None] == state.eos).any(-1)
            if state.seen is not None:
                state.seen.scatter_(1, token[:, None], True)
            state.token.copy_(token[:, None])

        def stay():  # inside the buffers however often it is replayed
            state.index.fill_(1)
            state.slot.fill_(context)
            state.position.fill_(context)

        def whole():
            forward()
            state.take(buffers["logits"])  # with --decode_kernel triton, a sampled draw by its kernel
            stay()

        def whole_fused():  # StaticDecode's step with the sampling head (installed around the call, as there)
            rewind()
            drawn = model(input_ids=state.token, attention_mask=state.open_slot(window),
                          position_ids=state.position, use_cache=True, logits_to_keep=1,
                          **{keyword: cache}).logits[:, -1]
            state.advance(drawn[:, 0].long())
            stay()

        times = {}
        # The cache slots StaticDecode's graph would read at this context (`window_slots`).
        window = StaticDecode(max_new_tokens=1, eos_token_id=0, pad_token_id=0,
                              window_slots=args.window_slots)._window(context + 1, context + args.new_tokens)
        for name, fn in zip(PARTS, (forward, to_float, processors, draw, bookkeeping)):
            times[name] = clock.graph_ms(fn)
        if state.kernel_draws and filters_off(decode.processing, vocab):
            # What the step draws with instead of to_float, processors and draw: one kernel on the logits.
            def kernel_draw():
                from fusedalign.generation.draw_kernel import gumbel_draw

                buffers["token"] = gumbel_draw(buffers["logits"], decode.processing["temperature"])

            times["draw, Triton kernel (from the logits)"] = clock.graph_ms(kernel_draw)
        times["step, one graph"] = clock.graph_ms(whole)
        times["step, eager"] = clock.eager_ms(whole)
        compiled_whole = torch.compile(whole, dynamic=True) if args.compile else None
        if args.compile:  # StaticDecode(compile_step=True): inductor first, then the graph
            times["step, compiled, one graph"] = clock.graph_ms(compiled_whole)
        if args.fused_sampling:
            head = decode._sampling_state(post)
            head.seen = state.seen
            with sampling.sampling_head(model, head):
                times["step, draw in the head, one graph"] = clock.graph_ms(whole_fused)
                if args.compile:
                    times["step, draw in the head, compiled, one graph"] = clock.graph_ms(
                        torch.compile(whole_fused, dynamic=True))
        kernels = []
        if args.kernels and device.type == "cuda":
            kernels = [("forward, eager", *k) for k in top_kernels(forward, args.kernels)]
            if compiled_whole is not None:  # where the compiled step's time goes (inductor's kernels by name)
                kernels += [("step, compiled", *k) for k in top_kernels(compiled_whole, args.kernels)]
        if args.fuse_projections:
            from fusedalign.generation.fused_projections import fused_projections

            with fused_projections(model):
                times["step, projections fused, one graph"] = clock.graph_ms(whole)
                if args.compile:
                    # dynamo's code cache for `whole` holds the unfused step: compile the fused one anew.
                    torch._dynamo.reset()
                    fused_whole = torch.compile(whole, dynamic=True)
                    times["step, projections fused, compiled, one graph"] = clock.graph_ms(fused_whole)
                    if args.kernels and device.type == "cuda":
                        kernels += [("step, projections fused, compiled", *k)
                                    for k in top_kernels(fused_whole, args.kernels)]
    del cache
    return times, kernels


def top_kernels(fn, count: int, device: str = "cuda") -> list[tuple[str, float, int]]:
    """The `count` kernels with the most GPU time in three calls of `fn`, then every kernel's
    time summed by kind (`harness/profiling.kernel_kind`, named "all <kind>"): (name, ms a
    call, launches a call). `device="cpu"` lists CPU operators instead (tests)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.harness.profiling import by_kind

    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    fn()
    sync()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            fn()
        sync()
    where = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    events = [e for e in prof.key_averages() if e.device_type == where]
    spent = (lambda e: e.self_device_time_total / 3000) if cuda else (lambda e: e.self_cpu_time_total / 3000)  # noqa: E731
    events.sort(key=spent, reverse=True)
    kernels = [(e.key, spent(e), e.count // 3) for e in events]
    return ([(name[:90], ms, n) for name, ms, n in kernels[:count]]
            + [(f"all {kind}", ms, n) for kind, ms, n in by_kind(kernels)])


def main(argv=None) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    from fusedalign.generation.decode_attention import decoding_attention, decoding_implementation

    args = parse_args(argv)
    log("versions: " + versions_line(versions(("torch", "transformers"))))
    own = args.model_dir is None
    if own:
        args.model_dir = tempfile.mkdtemp(prefix="decode-profile-model-")
        log("model: " + build_model(args.model_dir, tiny=args.tiny, dtype="bf16" if args.device == "cuda" else "fp32",
                                    seed=args.seed))
    try:
        dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
        extra = {"attn_implementation": args.attn_implementation} if args.attn_implementation else {}
        model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=dtype, **extra).to(args.device).eval()
        device = next(model.parameters()).device
        gpu = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
        shape = Shape.of(model.config, sum(p.numel() for p in model.parameters()), dtype.itemsize)
        peaks = peaks_of(gpu)
        clock = Clock(device, args.repeats)
        rows, kernel_rows = [], []
        kernel = args.decode_kernel
        attention = (model.config._attn_implementation if args.transformers_attention
                     else decoding_implementation(model, kernel))
        for batch in args.batches:
            with contextlib.nullcontext() if args.transformers_attention else decoding_attention(model, kernel):
                times, kernels = profile_batch(args, model, batch, clock)
            kernel_rows += [[str(batch), what, name, f"{ms:.3f}", str(n)] for what, name, ms, n in kernels]
            step = times["step, one graph"]
            for name, ms in times.items():
                rows.append([str(batch), name, f"{ms:.3f}", f"{100 * ms / step:.0f}%" if name in PARTS else ""])
            if peaks is not None:
                context = args.prompt_length + args.new_tokens // 2
                floor = 1000 * step_seconds(shape, peaks, batch, context)
                rows.append([str(batch), f"decode limit at context {context}", f"{floor:.3f}", ""])
            log(f"batch {batch}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in times.items()))
    finally:
        if own:
            shutil.rmtree(args.model_dir, ignore_errors=True)
    flags = ", ".join(f"{k} {getattr(args, k)}" for k in ("temperature", "top_k", "top_p", "min_p",
                                                          "repetition_penalty"))
    title = (f"### one StaticDecode token, by part ({gpu}; {attention} attention, window_slots {args.window_slots}; "
             f"context {args.prompt_length} + {args.new_tokens // 2}; "
             f"{flags}; {'CUDA graph replays' if device.type == 'cuda' else 'eager, wall clock'}, mean of "
             f"{args.repeats})")
    text = title + "\n\n" + markdown(["batch", "part", "ms", "of the step"], rows, numeric={0, 2, 3})
    if kernel_rows:
        text += (f"\n\n### the kernels with the most GPU time ({attention} attention; the forward eager"
                 + (" and the whole step compiled, each" if args.compile else ",")
                 + " called without a graph under torch.profiler, mean of 3 calls)\n\n"
                 + markdown(["batch", "of", "kernel", "ms a call", "launches"], kernel_rows, numeric={0, 3, 4}))
    log("\n" + text + "\n")
    write_markdown(args, [text])
    return 0


if __name__ == "__main__":
    sys.exit(main())
