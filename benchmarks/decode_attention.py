"""One decoding step's attention, alone: the ways a one-token query can attend to a grouped
key/value cache, timed side by side.

At Qwen2.5-0.5B's attention shape (14 query heads sharing 2 key/value heads of 64; --heads,
--kv_heads, --head_dim), bf16 on CUDA, left padding of every amount, for each batch size and
number of cache slots read, one call of:

    grouped_sdpa           what StaticDecode runs (generation/decode_attention.py): each group's
                           query heads as query positions of its key/value head, sdpa with the
                           boolean mask
    grouped_sdpa_additive  the same with an additive float mask made once, not converted from
                           the booleans in every layer
    gqa_sdpa               sdpa's own grouped-query path (enable_gqa=True) on [B, h, 1, d]
    matmul                 scores by batched matmul, masked softmax in float32, values by
                           batched matmul
    matmul_compiled        the same through torch.compile (inductor)
    flex_compiled          flex attention, the mask as a score modification, compiled (CUDA
                           only: compiled flex attention with one query position gives wrong
                           outputs on the CPU with torch 2.13)
    triton_grouped         fusedalign's Triton kernel (generation/decode_kernel.py): a group's
                           query heads as one block against its key/value head, the slots
                           split over programs when the batch is small (CUDA only; its CPU
                           check runs under Triton's interpreter in the tests)
    triton_loads_masked    the same kernel, its default launch with skip_masked=False: the
                           masked slots' keys and values are loaded too (each row's left padding here, a
                           decoding step's window of unwritten slots in StaticDecode), as the
                           default launch did before it skipped them; "reads MB" counts every
                           slot, masked or not

With --step_like each call is timed as a decoding step makes it: --layers calls in one graph,
each on a cache of its own (so no layer finds the last one's keys and values in the L2 cache,
which holds about 50 MB on an H100: at batch 512 and 256 slots one layer reads 67 MB), every row
seeing the first --written slots and none of the rest of the window (StaticDecode's graph at a
context of 256 reads a window of 384 slots, 257 written); the time is the graph's over --layers.
Without it one cache is replayed, its rows hiding left padding of every amount.

And with --triton_configs the Triton kernel under every launch of a grid (slots a program reads
per iteration 32/64/128, warps 2/4/8, pipeline stages 2/3/4: `triton bn64 w4 s3`), to choose its
default from measurements; with --split_fills N... the default launch with the slots split over
more programs (`triton fillN`: N programs a multiprocessor); each captured as a CUDA graph and
replayed --repeats times between two CUDA events (on the CPU: eager wall clock). Columns: milliseconds a call, what the call must
read (keys and values, MB) and the rate that makes (TB/s), the largest error against float32 arithmetic, and a call's
milliseconds times --layers: its share of one decoding step. At 4099510 (one H200, batch 512,
`decode_profile.py --kernels`), cuDNN's kernel for grouped_sdpa took 1.72 ms of a 6.9 ms step.

Examples:
    python benchmarks/decode_attention.py                        # batch 64 256 512, slots 256 512 2048
    python benchmarks/decode_attention.py --variants triton_grouped --triton_configs --batches 512
    python benchmarks/decode_attention.py --step_like --slots 384 --variants grouped_sdpa triton_grouped
    python benchmarks/decode_attention.py --device cpu --tiny    # smoke test
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.decode_profile import Clock  # noqa: E402
from benchmarks.harness.env import log, versions, versions_line  # noqa: E402
from benchmarks.harness.tables import fmt, markdown, write_markdown  # noqa: E402

VARIANTS = ("grouped_sdpa", "grouped_sdpa_additive", "gqa_sdpa", "matmul", "matmul_compiled", "flex_compiled",
            "triton_grouped", "triton_loads_masked")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default=None)
    p.add_argument("--tiny", action="store_true", help="small shapes (CPU smoke test)")
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--triton_configs", action="store_true",
                   help="also the Triton kernel under each launch of a grid (CUDA only): block of slots, warps, stages")
    p.add_argument("--split_fills", type=int, nargs="*", default=[],
                   help="also the kernel's default launch with its slots split to fill N programs a "
                        "multiprocessor, for each N (CUDA only; the default launch fills 4)")
    p.add_argument("--batches", type=int, nargs="+", default=None, help="default 64 256 512 (--tiny: 4)")
    p.add_argument("--slots", type=int, nargs="+", default=None,
                   help="cache slots read (the context), default 256 512 2048 (--tiny: 16)")
    p.add_argument("--heads", type=int, default=14)
    p.add_argument("--kv_heads", type=int, default=2)
    p.add_argument("--head_dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=24, help="layers of the model, for the share of a step")
    p.add_argument("--step_like", action="store_true",
                   help="--layers calls a graph, each on its own cache, rows seeing the first --written slots")
    p.add_argument("--written", type=int, default=None,
                   help="with --step_like: the slots every row sees (default two thirds of --slots, plus one)")
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--markdown_out", default=None)
    args = p.parse_args(argv)
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    for key, big, small in (("batches", [64, 256, 512], [4]), ("slots", [256, 512, 2048], [16])):
        if getattr(args, key) is None:
            setattr(args, key, small if args.tiny else big)
    if args.written is not None and not args.step_like:
        p.error("--written is for --step_like")
    if args.heads % args.kv_heads:
        p.error(f"--heads ({args.heads}) must be a multiple of --kv_heads ({args.kv_heads})")
    return args


def inputs(args, batch: int, slots: int, device, dtype):
    """query [B, h, 1, d], keys and values [B, g, S, d], visible [B, S] (left padding: row i's
    first i % (S / 2) slots hidden)."""
    import torch

    g = torch.Generator().manual_seed(args.seed + batch + slots)
    query = torch.randn(batch, args.heads, 1, args.head_dim, generator=g)
    key, value = (torch.randn(batch, args.kv_heads, slots, args.head_dim, generator=g) for _ in range(2))
    visible = torch.ones(batch, slots, dtype=torch.bool)
    for row in range(batch):
        visible[row, : row % (slots // 2)] = False
    return (query.to(device, dtype), key.to(device, dtype), value.to(device, dtype), visible.to(device))


def step_inputs(args, batch: int, slots: int, device, dtype):
    """--step_like: query [B, h, 1, d], --layers caches of keys and values [B, g, S, d], visible
    [B, S] (every row the first --written slots, as a decoding step's window past the context)."""
    import torch

    g = torch.Generator().manual_seed(args.seed + batch + slots)
    written = min(slots, args.written if args.written is not None else 2 * slots // 3 + 1)
    query = torch.randn(batch, args.heads, 1, args.head_dim, generator=g).to(device, dtype)
    caches = [tuple(torch.randn(batch, args.kv_heads, slots, args.head_dim, generator=g).to(device, dtype)
                    for _ in range(2)) for _ in range(args.layers)]
    visible = torch.zeros(batch, slots, dtype=torch.bool, device=device)
    visible[:, :written] = True
    return query, caches, visible


def reference(query, key, value, visible):
    """float32 arithmetic, every query head against a copy of its key/value head."""
    import torch

    repeat = query.shape[1] // key.shape[1]
    k, v = (t.float().repeat_interleave(repeat, 1) for t in (key, value))
    scores = (query.float() @ k.transpose(-1, -2)) / query.shape[-1] ** 0.5
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    return scores.softmax(-1) @ v  # [B, h, 1, d]


def variants(names, device, triton_configs: bool = False, split_fills=()) -> dict:
    """fn(query, key, value, visible, additive) -> [B, h, 1, d] for each variant named; the
    compiled ones are compiled once, with dynamic shapes, for every batch and slot count."""
    import torch
    import torch.nn.functional as F

    def grouped(query, key, value, attn_mask):
        B, h, _, d = query.shape
        g = key.shape[1]
        out = F.scaled_dot_product_attention(query.reshape(B, g, h // g, d), key, value, attn_mask=attn_mask)
        return out.reshape(B, h, 1, d)

    def matmul(query, key, value, visible, additive):
        B, h, _, d = query.shape
        g = key.shape[1]
        scores = (query.reshape(B, g, h // g, d) @ key.transpose(-1, -2)).float() * d ** -0.5
        probs = scores.masked_fill(~visible[:, None, None, :], float("-inf")).softmax(-1).to(value.dtype)
        return (probs @ value).reshape(B, h, 1, d)

    def flex(query, key, value, visible, additive):
        from torch.nn.attention.flex_attention import flex_attention

        def masked(score, b, h, q_idx, kv_idx):
            return torch.where(visible[b, kv_idx], score, float("-inf"))

        return flex_attention(query, key, value, score_mod=masked, enable_gqa=True)

    def triton_grouped(query, key, value, visible, additive):
        from fusedalign.generation.decode_kernel import decode_attention

        return decode_attention(query, key, value, visible, query.shape[-1] ** -0.5)

    def triton_loads_masked(query, key, value, visible, additive):
        from fusedalign.generation.decode_kernel import DEFAULT, grouped_decode

        return grouped_decode(query, key, value, visible, query.shape[-1] ** -0.5, DEFAULT._replace(skip_masked=False))

    table = {
        "grouped_sdpa": lambda q, k, v, visible, additive: grouped(q, k, v, visible[:, None, None, :]),
        "grouped_sdpa_additive": lambda q, k, v, visible, additive: grouped(q, k, v, additive),
        "gqa_sdpa": lambda q, k, v, visible, additive: F.scaled_dot_product_attention(
            q, k, v, attn_mask=visible[:, None, None, :], enable_gqa=True),
        "matmul": matmul,
        "matmul_compiled": torch.compile(matmul, dynamic=True),
        "flex_compiled": torch.compile(flex, dynamic=True) if device.type == "cuda" else None,
        "triton_grouped": triton_grouped if device.type == "cuda" else None,
        "triton_loads_masked": triton_loads_masked if device.type == "cuda" else None,
    }
    chosen = {name: table[name] for name in names}
    if triton_configs:
        chosen.update(launches(device))
    if split_fills:
        chosen.update(fills(device, split_fills))
    return chosen


def launches(device) -> dict:
    """`triton bnN wW sS`: the Triton kernel launched each way of the grid (None off CUDA)."""
    import itertools

    from fusedalign.generation.decode_kernel import Launch, grouped_decode

    def launched(config):
        return lambda q, k, v, visible, additive: grouped_decode(q, k, v, visible, q.shape[-1] ** -0.5, config)

    return {f"triton bn{bn} w{w} s{st}": launched(Launch(bn, w, st, skip_masked=True)) if device.type == "cuda"
            else None
            for bn, w, st in itertools.product((32, 64, 128), (2, 4, 8), (2, 3, 4))}


def fills(device, per_sm) -> dict:
    """`triton fillN`: the kernel's default launch with its slots split into as many shares as fill
    N programs a multiprocessor (the default fills 4: one share a row at batch 512 on an H100's
    132), to see whether more programs in flight read the cache faster (None off CUDA)."""
    import torch

    from fusedalign.generation import decode_kernel

    def filled(n):
        def call(q, k, v, visible, additive):
            wanted = decode_kernel._programs_wanted
            decode_kernel._programs_wanted = lambda dev: n * decode_kernel._multiprocessors(
                dev.index if dev.index is not None else torch.cuda.current_device())
            try:
                return decode_kernel.decode_attention(q, k, v, visible, q.shape[-1] ** -0.5)
            finally:
                decode_kernel._programs_wanted = wanted
        return call

    return {f"triton fill{n}": filled(n) if device.type == "cuda" else None for n in per_sm}


def main(argv=None) -> int:
    import torch

    args = parse_args(argv)
    log("versions: " + versions_line(versions(("torch",))))
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    rows = []
    fns = variants(args.variants, device, args.triton_configs, args.split_fills)
    clock = Clock(device, args.repeats)
    how = (f"{args.layers} caches a graph, every row seeing the first "
           f"{args.written if args.written is not None else 'two thirds + 1 of the'} slots; " if args.step_like
           else "one cache, left padding of every amount; ")
    title = (f"### one decoding step's attention ({gpu}; {args.heads} query heads, {args.kv_heads} key/value heads "
             f"of {args.head_dim}, {str(dtype).removeprefix('torch.')}; {how}"
             f"{'CUDA graph replays' if device.type == 'cuda' else 'eager, wall clock'}, mean of {args.repeats})")
    for batch in args.batches:
        for slots in args.slots:
            if args.step_like:
                query, caches, visible = step_inputs(args, batch, slots, device, dtype)
                key, value = caches[0]
            else:
                query, key, value, visible = inputs(args, batch, slots, device, dtype)
                caches = [(key, value)]
            additive = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill(~visible, float("-inf"))
            additive = additive[:, None, None, :]
            call = (query, key, value, visible, additive)
            want = reference(query, key, value, visible)
            read_mb = (key.numel() + value.numel()) * key.element_size() / 1e6
            for name, fn in fns.items():
                try:
                    if fn is None:
                        raise RuntimeError("CUDA only (compiled flex attention with one query position is wrong "
                                           "on the CPU; Triton kernels need a GPU)")
                    error = (fn(*call).float() - want).abs().max().item()

                    def every_cache(fn=fn):  # one call a cache: a layer each with --step_like
                        for k, v in caches:
                            fn(query, k, v, visible, additive)

                    ms = clock.graph_ms(every_cache) / len(caches)  # its warm-up call compiles
                    cells = [f"{ms:.4f}", f"{read_mb / ms / 1e3:.2f}", f"{error:.1e}", f"{ms * args.layers:.3f}"]
                except Exception as exc:  # a variant this torch or device cannot run: say why, go on
                    log(f"{name} at batch {batch}, {slots} slots: {type(exc).__name__}: {exc}")
                    cells = ["—", "—", f"{type(exc).__name__}", "—"]
                rows.append([str(batch), str(slots), name, *cells[:1], fmt(read_mb, ".1f"), *cells[1:]])
                log(f"batch {batch}, {slots} slots, {name}: {cells[0]} ms")
            text = title + "\n\n" + markdown(
                ["batch", "slots", "variant", "ms a call", "reads MB", "TB/s", "max error", f"ms x {args.layers} layers"],
                rows, numeric={0, 1, 3, 4, 5, 7})
            write_markdown(args, [text])
    log("\n" + text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
