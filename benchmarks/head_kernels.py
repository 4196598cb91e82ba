"""Launch-shape sweep of the Triton head kernels: time and bandwidth per (BLOCK_R, BLOCK_C, warps).

The element-wise kernels of the "triton" backend (`fusedalign/ops/triton_kernels.py`) are
memory-bound: the forward kernel reads each bf16 logit once, the backward kernel reads it
and writes the gradient over it. This times both, alone, on the two shapes they meet:

- a vocabulary chunk of the per-token op: [N, C] = [16384, 3328] (the 256 MiB default);
- a block of the loss-aware op: one DPO pair, [2 x 1792, V] = [3584, 151936].

and prints, per launch shape, the median time and the bandwidth it reaches (bytes the
kernel must move / time), against a device-to-device copy of the same bytes; for the
backward kernel also its time with the entropy's gradient compiled in (ENTROPY_GRAD,
`head_logprobs(..., entropy_grad=True)`), which reads two more fp32 values a row.

    python benchmarks/head_kernels.py                    # CUDA only
    python benchmarks/head_kernels.py --repeats 20
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # this working tree's fusedalign, however it is installed

import torch  # noqa: E402

FWD_SHAPES = [(16, 256, 4), (4, 512, 4), (2, 1024, 4), (1, 2048, 8), (1, 4096, 8), (2, 2048, 8), (1, 1024, 4)]
BWD_SHAPES = [(16, 256, 4), (32, 256, 8), (2, 2048, 8), (1, 4096, 8), (4, 2048, 8), (2, 4096, 16), (1, 2048, 4)]
PROBLEMS = {"chunk [16384, 3328]": (16384, 3328), "block [3584, 151936]": (3584, 151936)}


def timed(fn, repeats: int) -> float:
    """Median milliseconds of fn() over `repeats` runs (after one warm-up, which compiles)."""
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args(argv)
    import triton

    from fusedalign.ops import triton_kernels as K
    from fusedalign.ops.options import HeadOptions
    from fusedalign.ops.triton_launch import new_state, scalars

    opts = HeadOptions()
    kernel_scalars = scalars(opts)
    print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}; "
          f"bf16 logits, no softcap/bias/LoRA/statistics; median of {args.repeats}")
    for title, (n, c) in PROBLEMS.items():
        gen = torch.Generator(device="cuda").manual_seed(0)
        x0 = (torch.randn(n, c, device="cuda", generator=gen) * 3).bfloat16()
        x = x0.clone()
        labels = torch.randint(0, c, (n,), device="cuda", generator=gen).int()
        gs = torch.randn(n, device="cuda", generator=gen)
        state = new_state(n, opts, x.device, labels)
        copy_ms = timed(lambda: x.copy_(x0), args.repeats)
        nbytes = x.numel() * x.element_size()
        print(f"\n### {title}: {nbytes / 2**20:.0f} MiB of bf16 logits; a copy (read + write) takes "
              f"{copy_ms:.3f} ms = {2 * nbytes / copy_ms / 1e6:.0f} GB/s\n")
        print("| kernel | BLOCK_R | BLOCK_C | warps | ms | GB/s | ms with the entropy gradient |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for br, bc, warps in FWD_SHAPES:
            def fwd():
                K.fwd_chunk_kernel[(triton.cdiv(n, br),)](
                    x0, c, x0, c, x0, labels, *state, n, 0, c, 1, *kernel_scalars,
                    HAS_BIAS=False, HAS_LORA=False, HAS_SOFTCAP=False, ENTROPY=False, MEAN=False, ARGMAX=False,
                    ACCURATE_TANH=True, BLOCK_R=br, BLOCK_C=bc, num_warps=warps)
            ms = timed(fwd, args.repeats)
            print(f"| fwd_chunk_kernel | {br} | {bc} | {warps} | {ms:.3f} | {nbytes / ms / 1e6:.0f} | — |")
        m, s = state[0], state[1]
        lse2 = m + torch.log2(s)
        entropy = torch.rand(n, device="cuda", generator=gen) * 5
        for br, bc, warps in BWD_SHAPES:
            def bwd(entropy_grad: bool):
                K.bwd_chunk_kernel[(triton.cdiv(n, br), triton.cdiv(c, bc))](
                    x, c, x, c, x, labels, lse2, gs, gs, entropy, labels, c, n, 0, c, *kernel_scalars,
                    HAS_BIAS=False, HAS_LORA=False, HAS_SOFTCAP=False, BIAS_GRAD=False, LORA_GRAD=False,
                    ENTROPY_GRAD=entropy_grad, ACCURATE_TANH=True, BLOCK_R=br, BLOCK_C=bc, num_warps=warps)
                # x now holds a gradient; the next run overwrites it again (same work).
            ms = timed(lambda: bwd(False), args.repeats)
            ms_h = timed(lambda: bwd(True), args.repeats)
            print(f"| bwd_chunk_kernel | {br} | {bc} | {warps} | {ms:.3f} | {2 * nbytes / ms / 1e6:.0f} | {ms_h:.3f} |")


if __name__ == "__main__":
    main()
