"""What one decoder layer saves for its backward, per token: what its recompute holds under checkpointing.

With gradient checkpointing a step keeps each layer's input, and in the backward one layer at a
time runs its forward again and holds what that forward saves for its backward, for every token
of the row. At one completion a row that recompute, with the layers' inputs, is what a long
completion's training memory grows with (docs/benchmarks.md, "What 4x TRL's longest completion
at one completion a micro-batch would need"). This counts it exactly, on any device: one
decoder layer of the benchmark model's shape (Qwen2.5-0.5B; `--tiny` for the test model) runs a
forward with gradients on a row of each length, and every tensor autograd saves is seen by a
saved-tensor hook; each storage is counted once, the layer's own weights not at all. The
per-token figure is the slope between the shortest and the longest length, so what does not
grow with the row (a workspace, a compiled graph's constants) drops out.

Modes: `eager`; `tiled` (`--tiled_mlp_tokens`: the MLP over tiles under their own checkpoints);
`compile` (`--compile_layers`: inductor, element-wise ops recomputed in the backward); and
`tiled_compile`, both.

Examples:
    python benchmarks/layer_saved_bytes.py                     # CPU, lengths 2048 and 4096
    python benchmarks/layer_saved_bytes.py --device cuda --lengths 4096 16384
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.harness.tables import markdown, write_markdown  # noqa: E402

MODES = ("eager", "tiled", "compile", "tiled_compile")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog=os.path.basename(__file__), description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="the test model's shape instead of Qwen2.5-0.5B's")
    p.add_argument("--device", default="cpu")
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096], help="tokens of the row, two or more")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--tiled_mlp_tokens", type=int, default=896, help="tokens a tile in the tiled modes")
    p.add_argument("--attn_implementation", default="sdpa")
    p.add_argument("--markdown_out", default=None, help="also write the table to this file")
    args = p.parse_args(argv)
    if len(set(args.lengths)) < 2 or min(args.lengths) < 1:
        p.error(f"--lengths: expected two or more different positive lengths, got {args.lengths}")
    return args


def one_layer_model(args, mode: str):
    """The benchmark shape with one decoder layer, bf16, random weights, with `mode`'s levers applied."""
    import torch
    from transformers import AutoModelForCausalLM

    from benchmarks.builders.model import model_config
    from fusedalign.backbone import compile_decoder_layers
    from fusedalign.tiled_mlp import tile_mlps

    config = model_config(args.tiny, longest=max(args.lengths))
    config.num_hidden_layers = 1
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=args.attn_implementation,
                                             dtype=torch.bfloat16).to(args.device)
    if "tiled" in mode:
        tile_mlps(model, args.tiled_mlp_tokens)
    if "compile" in mode:
        compile_decoder_layers(model)
    return model


def saved_by_layer(model, tokens: int, device: str) -> tuple[int, int]:
    """Bytes (all, of which float32) that the model's one decoder layer saves for its backward on a
    row of `tokens` tokens, each storage once, the model's parameters left out."""
    import torch

    inner = model.model
    layer = inner.layers[0]
    hidden = torch.randn(1, tokens, model.config.hidden_size, dtype=torch.bfloat16, device=device,
                         requires_grad=True)
    positions = torch.arange(tokens, device=device)[None]
    cos_sin = inner.rotary_emb(hidden, positions)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, tuple[int, bool]] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            seen[storage.data_ptr()] = (storage.nbytes(), t.dtype == torch.float32)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(hidden, attention_mask=None, position_ids=positions, position_embeddings=cos_sin)
    return sum(n for n, _ in seen.values()), sum(n for n, f32 in seen.values() if f32)


def measure(args) -> dict[str, tuple[dict[int, int], float, float]]:
    """For each mode: the bytes saved at each length, and the bytes a token (all, of which float32)."""
    short, long = min(args.lengths), max(args.lengths)
    out = {}
    for mode in args.modes:
        model = one_layer_model(args, mode)
        at = {t: saved_by_layer(model, t, args.device) for t in sorted(set(args.lengths))}
        out[mode] = ({t: n for t, (n, _) in at.items()}, (at[long][0] - at[short][0]) / (long - short),
                     (at[long][1] - at[short][1]) / (long - short))
        del model
    return out


def tables(args) -> str:
    lengths = sorted(set(args.lengths))
    title = (f"### Saved for the backward by one decoder layer ({'tiny' if args.tiny else 'Qwen2.5-0.5B'} shape, bf16, "
             f"{args.attn_implementation}, {args.device}; tiles of {args.tiled_mlp_tokens} tokens)")
    columns = ["mode", *(f"MiB at {t:,}" for t in lengths), "bytes a token", "of which float32"]
    rows = [[mode, *(f"{at[t] / 2**20:,.1f}" for t in lengths), f"{slope:,.0f}", f"{slope32:,.0f}"]
            for mode, (at, slope, slope32) in measure(args).items()]
    return title + "\n\n" + markdown(columns, rows, numeric=set(range(1, len(columns))))


def main(argv=None) -> int:
    args = parse_args(argv)
    text = tables(args)
    print(text)
    write_markdown(args, [text])
    return 0


if __name__ == "__main__":
    sys.exit(main())
