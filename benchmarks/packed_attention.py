"""One packed GRPO row's attention, forward and backward, alone: the ways a training step can
compute it, timed side by side.

The row is what the packed step of e2e_grpo builds at 64 x 8 x 256 under a budget of 8,192
tokens: --groups (3) prompts of --prompt (128) tokens, each shared by --completions (8)
completions of --completion (256) tokens, every completion seeing its prompt and itself
(`fusedalign.attention.masks`). Qwen2.5-0.5B's heads by default: 14 query heads sharing 2
key/value heads of 64. bf16 on CUDA. Variants:

    flex_repeat    flex attention (compiled, as transformers compiles it) on the row's
                   BlockMask, keys and values repeated to every query head and enable_gqa off:
                   transformers 5.17's flex path whenever the query heads are not a power of
                   two (14 here), so what a packed GRPO step runs today
    flex_gqa       the same with enable_gqa=True on the 2 key/value heads, nothing repeated
    sdpa_padded    the same completions as padded rows, each its own prompt and completion
                   ((prompt + completion) tokens, causal), sdpa with enable_gqa=True (cuDNN's
                   or the flash kernel on an H100): what the padded step runs

The profile of a packed step (bf33ce2, H100, docs/benchmarks.md) gave flex attention 419 ms a
step against 90 for cuDNN's kernels on the padded step, for about the same query-key pairs;
this says how much of that is the repeat and how much the kernel. Columns: milliseconds of the
forward and of forward plus backward (wall clock between two synchronisations, mean of --repeats
after --warmup calls; flex attention's backward does not run on the CPU), and the largest
difference of each variant's output from flex_repeat's at the same tokens (the padded layout's
prompt and completion outputs compared position by position).

Examples:
    python benchmarks/packed_attention.py                      # the row above, on CUDA
    python benchmarks/packed_attention.py --groups 8           # one micro-batch as one row
    python benchmarks/packed_attention.py --device cpu --tiny  # smoke test
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

VARIANTS = ("flex_repeat", "flex_gqa", "sdpa_padded")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default=None)
    p.add_argument("--tiny", action="store_true", help="small shapes (CPU smoke test)")
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--groups", type=int, nargs="+", default=None, help="prompts a row, default 3 8 (--tiny: 2)")
    p.add_argument("--prompt", type=int, default=None, help="prompt tokens, default 128 (--tiny: 8)")
    p.add_argument("--completions", type=int, default=None, help="completions a prompt, default 8 (--tiny: 3)")
    p.add_argument("--completion", type=int, default=None, help="completion tokens, default 256 (--tiny: 16)")
    p.add_argument("--heads", type=int, default=None, help="query heads, default 14 (--tiny: 6)")
    p.add_argument("--kv_heads", type=int, default=2)
    p.add_argument("--head_dim", type=int, default=None, help="default 64 (--tiny: 16)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--markdown_out", default=None)
    args = p.parse_args(argv)
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    for key, big, small in (("groups", [3, 8], [2]), ("prompt", 128, 8), ("completions", 8, 3),
                            ("completion", 256, 16), ("heads", 14, 6), ("head_dim", 64, 16)):
        if getattr(args, key) is None:
            setattr(args, key, small if args.tiny else big)
    if args.heads % args.kv_heads:
        p.error(f"--heads ({args.heads}) must be a multiple of --kv_heads ({args.kv_heads})")
    return args


def layouts(args, groups: int, device):
    """The packed row's segments and the padded rows' token indices, over the same unique tokens.

    Returns:
        segment_ids, parent_ids, position_ids: [1, T] long (T unique tokens: each prompt once);
        padded: [N, P + C] long, the unique token behind each padded position (N = groups x completions).
    """
    import torch

    P, C, K = args.prompt, args.completion, args.completions
    segments, parents, positions, padded = [], [], [], []
    token = segment = 0
    for _ in range(groups):
        prompt = list(range(token, token + P))
        segments += [segment] * P
        parents += [-1] * P
        positions += range(P)
        token, parent, segment = token + P, segment, segment + 1
        for _ in range(K):
            segments += [segment] * C
            parents += [parent] * C
            positions += range(P, P + C)
            padded.append(prompt + list(range(token, token + C)))
            token, segment = token + C, segment + 1

    def row(values):
        return torch.tensor([values], dtype=torch.long, device=device)

    return row(segments), row(parents), row(positions), torch.tensor(padded, dtype=torch.long, device=device)


class Variant:
    """A way to compute the row's attention: `leaves(q, k, v, padded)` makes its own inputs from the
    row's (outside the timing, each a leaf that takes gradients), `call(*leaves, mask)` is what is
    timed, and `row(out, padded, tokens)` maps its output back onto the row's tokens for the check."""

    def __init__(self, call, leaves=None, row=None):
        self.call = call
        self.leaves = leaves or (lambda q, k, v, padded: (q, k, v))
        self.row = row or (lambda out, padded, tokens: out)


def variants(names, device) -> dict:
    """The variants named, on `device` (flex attention compiled on CUDA, as transformers runs it;
    eager on the CPU, forward only)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import flex_attention

    from fusedalign.model_calls import FLEX_KERNEL_OPTIONS

    flex = torch.compile(flex_attention) if device.type == "cuda" else flex_attention
    options = dict(FLEX_KERNEL_OPTIONS) if device.type == "cuda" else None

    def flex_repeat(q, k, v, mask):
        n = q.shape[1] // k.shape[1]
        k, v = (t.repeat_interleave(n, dim=1) for t in (k, v))
        return flex(q, k, v, block_mask=mask, enable_gqa=False, kernel_options=options)

    def flex_gqa(q, k, v, mask):
        return flex(q, k, v, block_mask=mask, enable_gqa=True, kernel_options=options)

    def padded_leaves(q, k, v, padded):  # [1, heads, T, d] -> [N, heads, P+C, d]
        return tuple(t.detach()[0][:, padded].transpose(0, 1).contiguous().requires_grad_() for t in (q, k, v))

    def sdpa_padded(q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    def padded_row(out, padded, tokens):  # [N, h, P+C, d] -> [1, h, T, d]; a prompt's rows agree
        flat = out.transpose(1, 2).reshape(-1, out.shape[1], out.shape[3])  # [N (P+C), h, d]
        back = torch.zeros(tokens, out.shape[1], out.shape[3], dtype=out.dtype, device=out.device)
        return back.index_copy(0, padded.flatten(), flat).transpose(0, 1)[None]

    table = {"flex_repeat": Variant(flex_repeat), "flex_gqa": Variant(flex_gqa),
             "sdpa_padded": Variant(sdpa_padded, padded_leaves, padded_row)}
    return {name: table[name] for name in names}


def timed(variant: Variant, leaves, mask, backward: bool, warmup: int, repeats: int, device) -> float:
    """Milliseconds a call (forward, or forward and backward), mean of `repeats` after `warmup`."""
    import torch

    def call():
        out = variant.call(*leaves, mask)
        if backward:
            torch.autograd.grad(out, leaves, torch.ones_like(out))

    for _ in range(warmup):
        call()
    return Clock(device, repeats).eager_ms(call)


def main(argv=None) -> int:
    import torch

    from fusedalign.attention.masks import block_mask

    args = parse_args(argv)
    log("versions: " + versions_line(versions(("torch",))))
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    fns = variants(args.variants, device)
    rows = []
    for groups in args.groups:
        segments, parents, positions, padded = layouts(args, groups, device)
        tokens = segments.shape[1]
        g = torch.Generator().manual_seed(args.seed + groups)
        q = torch.randn(1, args.heads, tokens, args.head_dim, generator=g)
        k, v = (torch.randn(1, args.kv_heads, tokens, args.head_dim, generator=g) for _ in range(2))
        q, k, v = (t.to(device, dtype).requires_grad_() for t in (q, k, v))
        mask = block_mask(segments, parents, positions)
        outputs = {}
        for name, variant in fns.items():
            leaves = variant.leaves(q, k, v, padded)
            flex_backward = device.type == "cuda" or not name.startswith("flex")
            if not flex_backward:  # flex attention refuses inputs that take gradients on the CPU
                leaves = tuple(t.detach() for t in leaves)
            with torch.no_grad():
                outputs[name] = variant.row(variant.call(*leaves, mask), padded, tokens).float()
            forward = timed(variant, leaves, mask, False, args.warmup, args.repeats, device)
            both = timed(variant, leaves, mask, True, args.warmup, args.repeats, device) if flex_backward else None
            base = outputs.get("flex_repeat")
            error = None if base is None else float((outputs[name] - base).abs().max())
            rows.append([str(groups), f"{tokens:,}", f"{padded.numel():,}", name, fmt(forward, ".3f"),
                         fmt(both, ".3f"), fmt(error, ".2e")])
            log(f"groups {groups}: {name} forward {forward:.3f} ms, forward and backward "
                f"{'-' if both is None else f'{both:.3f}'} ms")
    title = (f"### one packed row's attention ({gpu}; prompts of {args.prompt} tokens, each shared by "
             f"{args.completions} completions of {args.completion}; {args.heads} query heads, {args.kv_heads} "
             f"key/value heads of {args.head_dim}, {str(dtype).removeprefix('torch.')}; "
             f"wall clock between synchronisations, mean of {args.repeats})")
    table = markdown(["prompts a row", "row tokens", "padded tokens", "variant", "forward ms",
                      "forward + backward ms", "max diff vs flex_repeat"], rows, numeric={4, 5, 6})
    print(title + "\n\n" + table)
    write_markdown(args, [title + "\n\n" + table])
    return 0


if __name__ == "__main__":
    sys.exit(main())
