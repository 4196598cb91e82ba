"""The floor of a GRPO step on a GPU, and the most any trainer could gain over a measured step.

Computes, from the benchmark model's shape (Qwen2.5-0.5B, bf16; `--tiny` for the test model) and
a GPU's datasheet peaks, the least time each part of one step could take (`harness/step_floor.py`:
prefill, decoding, the policy's forward and backward, extra forward passes), with each group's
prompt once (the least work) and with a copy a row (as a padded trainer computes it). Given
measured steps (`--measured NAME=SECONDS`, each from a benchmark run on that GPU: e2e_grpo.py's
"s a step"), it prints each one's distance from the floor: the largest speed-up over that step
that any implementation of the same work could reach on that GPU.

Examples:
    python benchmarks/grpo_floor.py --gpu H100 --measured "TRL 1.16 (bda33d2)=10.11"
    python benchmarks/grpo_floor.py --gpu H200 --extra_forwards 1   # beta > 0: a reference pass
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.harness.decode_limit import KNOWN, Shape  # noqa: E402
from benchmarks.harness.step_floor import StepWork, step_floor  # noqa: E402
from benchmarks.harness.tables import markdown, write_markdown  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog=os.path.basename(__file__), description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpu", default="H100", choices=[k.name for k in KNOWN], help="whose datasheet peaks")
    p.add_argument("--tiny", action="store_true", help="the test model's shape instead of Qwen2.5-0.5B's")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--num_generations", type=int, default=8)
    p.add_argument("--prompt_length", type=int, default=128)
    p.add_argument("--new_tokens", type=int, default=256, help="every completion's length")
    p.add_argument("--extra_forwards", type=int, default=0,
                   help="forward-only passes over the step's tokens besides the policy's (reference, old policy)")
    p.add_argument("--measured", nargs="*", default=[], metavar="NAME=SECONDS",
                   help="measured steps of this work on this GPU, to set against the floor")
    p.add_argument("--markdown_out", default=None, help="also write the table to this file")
    args = p.parse_args(argv)
    args.steps = []
    for item in args.measured:
        name, _, seconds = item.rpartition("=")
        try:
            value = float(seconds)
        except ValueError:
            value = 0.0
        if not name or value <= 0:
            p.error(f"--measured: expected NAME=SECONDS with SECONDS > 0, got {item!r}")
        args.steps.append((name, value))
    return args


def model_shape(tiny: bool) -> Shape:
    """The benchmark model's shape in bf16, its parameters counted on the meta device (no weights)."""
    import torch
    from transformers import AutoModelForCausalLM

    from benchmarks.builders.model import model_config

    config = model_config(tiny)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return Shape.of(config, sum(p.numel() for p in model.parameters()), dtype_bytes=2)


def tables(args) -> str:
    shape, peaks = model_shape(args.tiny), next(k for k in KNOWN if k.name == args.gpu)
    rows, floors = [], {}
    for once in (True, False):
        work = StepWork(args.prompts, args.num_generations, args.prompt_length, args.new_tokens,
                        prompt_once=once, extra_forwards=args.extra_forwards)
        f = floors[once] = step_floor(shape, peaks, work)
        rows.append(["once a group" if once else "once a row", f"{work.trained_tokens:,}", f"{f.prefill_s:.3f}",
                     f"{f.decode_s:.3f}", f"{f.training_s:.3f}", f"{f.forwards_s:.3f}", f"{f.total_s:.3f}",
                     f"{work.rows / f.total_s:,.0f}"])
    title = (f"### The floor of a GRPO step: {args.prompts} prompts x {args.num_generations} completions, "
             f"{args.prompt_length}-token prompts, {args.new_tokens}-token completions, {shape.params:,} parameters "
             f"(bf16), {peaks.name} ({peaks.tb_per_s} TB/s, {peaks.tflops:g} dense bf16 TFLOP/s)")
    out = [title, markdown(["prompt", "trained tokens", "prefill s", "decode s", "training s", "extra forwards s",
                            "step s", "completions/s"], rows, numeric=set(range(1, 8)))]
    if args.steps:
        least = floors[True].total_s
        out.append(markdown(["measured step", "s", "of it, the floor", "the most any speed-up over it can be"],
                            [[name, f"{s:.2f}", f"{least / s:.1%}", f"{s / least:.1f}x"] for name, s in args.steps],
                            numeric={1, 2, 3}))
    return "\n\n".join(out)


def main(argv=None) -> int:
    args = parse_args(argv)
    text = tables(args)
    print(text)
    write_markdown(args, [text])
    return 0


if __name__ == "__main__":
    sys.exit(main())
