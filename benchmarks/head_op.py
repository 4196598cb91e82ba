"""Benchmark of the output-head op: time, memory and accuracy, side by side in one run.

For each hidden size it prints a markdown table with, for every backend of
`fusedalign.ops.head_logprobs`, the peers that are importable (Liger's fused linear
cross-entropy, Cut Cross-Entropy; both per token, reduction="none", logp = -CE) and one
plain logits GEMM as the yardstick:

- fwd+bwd: median wall time of forward + backward to hidden and weight, under a random
  per-token upstream gradient (CUDA events and synchronisation on GPU); with `--pairs P`,
  under a DPO loss instead (sigmoid, beta 0.1, over P pairs of sequences of N / 2P tokens
  against a random reference), which `BACKEND+aware` declares to the op so that it forms
  its gradient in the forward (the loss-aware mode: three logits GEMMs, not four);
- peak extra memory (GPU only): the high-water mark above what was allocated before the
  call, minus the gradients it returns (every method returns the same ones);
- error: max_i |logp_i - truth_i| / max_i |truth_i|, truth computed in float64 (chunked,
  so it fits at GPU sizes) from the same rounded inputs;
- with `--batch_invariant`, each of our backends also runs as BACKEND+invariant
  (`head_logprobs(..., batch_invariant=True)`: a row's results independent of its
  batch-mates, what GRPO's old-policy log-probs need), and a column says whether a row's
  log-prob is the same bit for bit alone, in the first third of the batch and in the whole
  batch (the rows of 64 spread over the batch, no gradient).

Examples:
    python benchmarks/head_op.py                       # CUDA if present, else small CPU shapes
    python benchmarks/head_op.py --device cuda --h 896 4096 --repeats 10
    python benchmarks/head_op.py --device cpu --n 256 --v 2048 --h 32 --backends torch reference
    python benchmarks/head_op.py --h 896 --pairs 8 --backends triton triton+aware liger
    python benchmarks/head_op.py --h 896 4096 --backends triton torch --batch_invariant
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # this working tree's fusedalign, however it is installed

import torch  # noqa: E402

from fusedalign.ops import head_logprobs, known_backends  # noqa: E402
from fusedalign.ops.registry import resolve_backend  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
PEERS = ("liger", "cce")
GPU_DEFAULTS = dict(dtype="bf16", n=16384, v=151936, h=[896, 4096])
CPU_DEFAULTS = dict(dtype="fp32", n=512, v=4096, h=[64])


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="default: bf16 on GPU, fp32 on CPU")
    p.add_argument("--n", type=int, help="tokens (default: 16384 on GPU, 512 on CPU)")
    p.add_argument("--v", type=int, help="vocabulary (default: 151936 on GPU, 4096 on CPU)")
    p.add_argument("--h", type=int, nargs="+", help="hidden sizes (default: 896 4096 / 64)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per method (median)")
    p.add_argument("--backends", nargs="+", default=None,
                   help=f"any of {[b for b in known_backends() if b != 'auto']} + {list(PEERS)}"
                        "; ours take an optional memory budget in MiB, e.g. triton@64; "
                        "default: all")
    p.add_argument("--pairs", type=int, default=0,
                   help="upstream gradient from a DPO loss over this many pairs (N / 2P tokens a "
                        "sequence) instead of a random one per token; BACKEND+aware declares it to the op")
    p.add_argument("--batch_invariant", action="store_true",
                   help="also run each of our backends as BACKEND+invariant (batch_invariant=True), and "
                        "check for every method whether a row's log-prob depends on its batch-mates")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    defaults = GPU_DEFAULTS if args.device.startswith("cuda") else CPU_DEFAULTS
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.backends is None:
        ours_first = sorted((b for b in known_backends() if b != "auto"),
                            key=lambda b: (b == "reference", b != "torch", b))
        args.backends = ours_first + list(PEERS)
    if args.pairs and args.n % (2 * args.pairs):
        p.error(f"--n {args.n} must split into 2 x --pairs {args.pairs} sequences of equal length")
    if args.batch_invariant:
        ours_plain = [b for b in args.backends if b not in PEERS and "+" not in b]
        args.backends += [f"{b}+invariant" for b in ours_plain if f"{b}+invariant" not in args.backends]
    return args


# --------------------------------------------------------------------------- methods


def ours(backend: str, budget_bytes: int | None = None, aware: bool = False, invariant: bool = False) -> Callable:
    def run(hidden, weight, labels, sequence_loss=None):
        return head_logprobs(hidden, weight, labels, backend=backend, memory_budget_bytes=budget_bytes,
                             sequence_loss=sequence_loss if aware else None, batch_invariant=invariant).logps
    return run


def liger() -> Callable:
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    loss_fn = LigerFusedLinearCrossEntropyLoss(reduction="none")

    def run(hidden, weight, labels, sequence_loss=None):
        out = loss_fn(weight, hidden, labels)
        # Some versions return (loss, z_loss, ...) or an output object.
        out = getattr(out, "loss", out)
        return -(out[0] if isinstance(out, tuple) else out)
    return run


def cce() -> Callable:
    from cut_cross_entropy import linear_cross_entropy

    def run(hidden, weight, labels, sequence_loss=None):
        return -linear_cross_entropy(hidden, weight, labels, reduction="none")
    return run


def method(name: str, device: torch.device) -> tuple[str, Callable]:
    """(row label, fn(hidden, weight, labels) -> logps [N]); raises if unavailable."""
    if name == "liger":
        return "Liger fused linear CE", liger()
    if name == "cce":
        return "Cut Cross-Entropy", cce()
    # "triton@64": our backend with memory_budget_bytes = 64 MiB (one fp32 logits chunk);
    # "triton+aware": the loss-aware mode (with --pairs); "triton+invariant": batch_invariant=True.
    name, aware = (name[: -len("+aware")], True) if name.endswith("+aware") else (name, False)
    name, invariant = (name[: -len("+invariant")], True) if name.endswith("+invariant") else (name, False)
    name, _, mib = name.partition("@")
    budget = int(float(mib) * 2**20) if mib else None
    label = resolve_backend(name, device).name  # raises if unknown or unavailable here
    label = f"fusedalign {label}" + (" (unfused)" if name == "reference" else "")
    if budget is not None:
        label += f" (budget {mib} MiB)"
    if aware:
        label += " loss-aware"
    if invariant:
        label += " batch-invariant"
    return label, ours(name, budget, aware, invariant)


# --------------------------------------------------------------------------- measuring


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device) -> float:
    """Milliseconds of one call."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def fresh(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def bench_method(fn, hidden, weight, labels, g, repeats, device, pairs=None):
    """(median ms, peak extra bytes or None, detached fp32 logps of the first run).

    `pairs` = (sequence loss, loss of the logps): the upstream gradient comes from that
    loss instead of from g.
    """
    result = {}

    def step():
        logps = fn(hidden, weight, labels, None if pairs is None else pairs[0])
        total = (logps.float() * g).sum() if pairs is None else pairs[1](logps.float())
        grads = torch.autograd.grad(total, [hidden, weight])
        result.setdefault("logps", logps.detach().float())
        return grads

    fresh(device)
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    grads = step()  # warm-up; also the memory measurement
    sync(device)
    peak = None
    if device.type == "cuda":
        returned = sum(t.numel() * t.element_size() for t in grads)
        peak = torch.cuda.max_memory_allocated(device) - base - returned
    del grads
    times = [timed(step, device) for _ in range(repeats)]
    return statistics.median(times), peak, result["logps"]


def bench_gemm(hidden, weight, repeats, device) -> float:
    """Median ms of hidden @ weight.T into a preallocated [N, V] buffer: the GEMM alone.

    (On CPU a fresh N x V output costs page faults that can exceed the GEMM itself.)
    """
    with torch.no_grad():
        out = torch.empty(hidden.shape[0], weight.shape[0], dtype=hidden.dtype, device=device)
        torch.mm(hidden, weight.t(), out=out)  # warm-up
        sync(device)
        ms = statistics.median(
            timed(lambda: torch.mm(hidden, weight.t(), out=out), device) for _ in range(repeats)
        )
    del out
    fresh(device)
    return ms


def batch_dependence(fn, hidden, weight, labels) -> str:
    """Whether a row's log-prob depends on its batch-mates: 64 rows spread over the batch, each
    alone, and all of them in the first third of the batch, against the whole batch, bit for bit."""
    n = hidden.shape[0]
    probe = torch.linspace(0, n // 3 - 1, 64, device=hidden.device).long().unique()
    with torch.no_grad():
        whole = fn(hidden, weight, labels)[probe]
        third = fn(hidden[: n // 3], weight, labels[: n // 3])[probe]
        alone = torch.cat([fn(hidden[i:i + 1], weight, labels[i:i + 1]) for i in probe.tolist()])
    differ = int(((alone != whole) | (third != whole)).sum())
    return "yes" if differ == 0 else f"no ({differ} of {probe.numel()} rows differ)"


def truth_logps(hidden, weight, labels, budget_bytes=512 * 2**20) -> torch.Tensor:
    """float64 log-probs of the labels, chunked over tokens so GPU sizes fit."""
    w = weight.detach().double()
    rows = max(1, budget_bytes // (8 * w.shape[0]))
    out = torch.empty(hidden.shape[0], dtype=torch.float64, device=hidden.device)
    for s in range(0, hidden.shape[0], rows):
        logits = hidden[s:s + rows].detach().double() @ w.t()  # [rows, V]
        out[s:s + rows] = logits.log_softmax(-1).gather(1, labels[s:s + rows, None]).squeeze(1)
    return out


# --------------------------------------------------------------------------- report


def dpo_problem(n: int, pairs: int, gen: torch.Generator, device: torch.device):
    """(SequenceLoss, loss(logps)): a sigmoid DPO loss over `pairs` pairs of equal sequences."""
    from fusedalign.ops import SequenceLoss

    seq = torch.arange(2 * pairs).repeat_interleave(n // (2 * pairs)).to(device)  # [N]
    ref = (torch.randn(2 * pairs, generator=gen, dtype=torch.float64) * 10 - 3 * n / (2 * pairs)).to(device)

    def loss_of_sums(sums):
        margin = (sums[:pairs] - ref[:pairs]) - (sums[pairs:] - ref[pairs:])
        return -torch.nn.functional.logsigmoid(0.1 * margin.float()).sum() / pairs

    def loss(logps):
        sums = torch.zeros(2 * pairs, dtype=torch.float64, device=device).index_add(0, seq, logps.double())
        return loss_of_sums(sums.float())

    def grad(sums):
        sums = sums.detach().requires_grad_()
        return torch.autograd.grad(loss_of_sums(sums), sums)[0]

    pair = torch.arange(pairs, device=device)
    return SequenceLoss(seq, torch.cat([pair, pair]), grad), loss


def fmt_bytes(b) -> str:
    if b is None:
        return "n/a"
    return f"{b / 2**30:.3f} GiB" if abs(b) >= 2**26 else f"{b / 2**20:.1f} MiB"


def run_one_h(args, h: int, device: torch.device) -> None:
    dtype = DTYPES[args.dtype]
    gen = torch.Generator(device="cpu").manual_seed(args.seed)
    # Logits with a std of about 3, like a trained head's.
    hidden = torch.randn(args.n, h, generator=gen).to(device, dtype).requires_grad_()
    weight = (torch.randn(args.v, h, generator=gen) * 3 / h**0.5).to(device, dtype)
    weight.requires_grad_()
    labels = torch.randint(0, args.v, (args.n,), generator=gen).to(device)
    g = torch.randn(args.n, generator=gen).to(device)
    pairs = dpo_problem(args.n, args.pairs, gen, device) if args.pairs else None
    truth = truth_logps(hidden, weight, labels)

    gemm_ms = bench_gemm(hidden, weight, args.repeats, device)
    rows, notes = [], []
    rows.append(("one logits GEMM (fwd only)", gemm_ms, None, None, None))
    rows.append(("4 GEMMs (floor of a per-token op)", 4 * gemm_ms, None, None, None))
    if pairs is not None:
        rows.append(("3 GEMMs (floor of a loss-aware op)", 3 * gemm_ms, None, None, None))
    for name in args.backends:
        try:
            label, fn = method(name, device)
            ms, peak, logps = bench_method(fn, hidden, weight, labels, g, args.repeats, device, pairs)
            invariant = batch_dependence(fn, hidden, weight, labels) if args.batch_invariant else None
        except Exception as err:  # a peer not installed, no CUDA, out of memory...
            notes.append(f"- {name}: skipped ({type(err).__name__}: {str(err).splitlines()[0]})")
            fresh(device)
            continue
        err = ((logps.double() - truth).abs().max() / truth.abs().max()).item()
        rows.append((label, ms, peak, err, invariant))

    print(f"\n### N={args.n}, V={args.v}, H={h}, {args.dtype}, {device_name(device)}, "
          f"median of {args.repeats}\n")
    extra = " row alone = in batch |" if args.batch_invariant else ""
    print(f"| method | fwd+bwd (ms) | x one GEMM | peak extra memory | max rel err of logp |{extra}")
    print("|---|---:|---:|---:|---:|" + ("---|" if extra else ""))
    for label, ms, peak, err, invariant in rows:
        mem = "—" if err is None else fmt_bytes(peak)
        e = "—" if err is None else f"{err:.1e}"
        same = f" {invariant or '—'} |" if extra else ""
        print(f"| {label} | {ms:.2f} | {ms / gemm_ms:.1f} | {mem} | {e} |{same}")
    if notes:
        print("\n" + "\n".join(notes))


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({torch.get_num_threads()} threads)"


def main(argv=None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device)
    upstream = f"a DPO loss over {args.pairs} pairs" if args.pairs else "random per token"
    print(f"torch {torch.__version__}; upstream gradient: {upstream}; "
          "error against a float64 truth on the same rounded inputs")
    for h in args.h:
        run_one_h(args, h, device)
    if "liger" in args.backends:
        print("\nNote: Liger computes its gradients inside the forward; before its fix for "
              "reduction='none' (Liger-Kernel PR #1298) they are wrong under a non-uniform "
              "per-token upstream gradient. Its time is still a fair cost estimate.")


if __name__ == "__main__":
    main()
