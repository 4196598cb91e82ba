"""A profiled step: its CUDA kernels by kind, how busy the GPU was, its Chrome trace."""

from __future__ import annotations

import gzip
import os
import shutil

# Kernel kinds, by name (first match wins): what any implementation of the same
# computation must run (GEMMs, attention) against what differs between them.
KERNEL_KINDS = (
    ("GEMM", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "splitkreduce", "tem_fused_mm", "tem_fused_addmm",
              "tem_fused_bmm")),
    ("head element-wise", ("chunk_kernel", "logprob")),
    # Before inductor's kinds: compiled flex attention is an inductor template kernel
    # (triton_tem_fused_flex_attention_0, and its backward); _grouped_decode is our decode kernel.
    ("attention", ("flex_attention", "flex_decoding", "flash", "fmha", "cudnn", "attn", "sdpa", "_grouped_decode")),
    ("compiled element-wise (inductor)", ("triton_poi", "triton_per", "triton_red", "triton_tem")),
    ("optimizer and clipping", ("adam", "multi_tensor", "foreach", "lpnorm")),
    ("Liger layer kernels", ("rms_norm", "swiglu", "rope", "liger")),
)
OTHER = "other (copies, casts, reductions, eager element-wise)"


def kernel_kind(name: str) -> str:
    low = name.lower()
    for kind, needles in KERNEL_KINDS:
        if any(n in low for n in needles):
            return kind
    return OTHER


def by_kind(kernels) -> list[tuple[str, float, int]]:
    """(kind, ms, calls) summed over `kernels`, (name, ms, calls) each, largest time first."""
    kinds: dict[str, tuple[float, int]] = {}
    for name, ms, calls in kernels:
        total, count = kinds.get(kernel_kind(name), (0.0, 0))
        kinds[kernel_kind(name)] = (total + ms, count + calls)
    return sorted(((k, ms, n) for k, (ms, n) in kinds.items()), key=lambda row: -row[1])


# Host calls that wait for the GPU (or make it wait for the host), by the name the profiler gives them:
# a read-back of a value (`.item()`, `int(t)`, `bool(t)`, `nonzero`, a boolean mask's indexing) runs
# aten::_local_scalar_dense or aten::nonzero and a stream synchronisation; the GPU idles from the end of
# its queue until the host has launched the next kernels.
HOST_WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "aten::_local_scalar_dense",
              "aten::nonzero", "cudaMemcpy")
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx", "cudaGraphLaunch")


def host_side(events) -> dict:
    """What the host did in the profiled step: its waits for the GPU (calls and milliseconds, by the
    names in HOST_WAITS, prefix match), its kernel launches, and its top operators by their own time."""
    cpu = [e for e in events if e.device_type.name == "CPU"]
    waits: dict[str, list] = {}
    launches = [0, 0.0]
    for e in cpu:
        if any(e.key.startswith(w) for w in HOST_WAITS):
            row = waits.setdefault(e.key, [0, 0.0])
            row[0] += e.count
            row[1] += e.self_cpu_time_total / 1e3
        if e.key in LAUNCHES:
            launches[0] += e.count
            launches[1] += e.self_cpu_time_total / 1e3
    ops = sorted(((e.key, e.self_cpu_time_total / 1e3, e.count) for e in cpu if e.key.startswith("aten::")),
                 key=lambda x: -x[1])
    return {"waits": [{"call": k, "calls": n, "ms": round(ms, 3)} for k, (n, ms) in
                      sorted(waits.items(), key=lambda kv: -kv[1][1])],
            "launches": {"calls": launches[0], "ms": round(launches[1], 3)},
            "top_ops": [{"op": k[:60], "ms": round(ms, 3), "calls": c} for k, ms, c in ops[:10]]}


def summarise_profile(prof, step_s: float) -> dict:
    """The profiled step's top CUDA kernels, their time by kind, how busy the GPU was, and what the
    host did meanwhile (`host_side`)."""
    averages = list(prof.key_averages())
    events = [e for e in averages if e.device_type.name == "CUDA"]  # kernels, not the ops launching them
    kernels = sorted(((e.key, e.self_device_time_total / 1e3, e.count) for e in events
                      if e.self_device_time_total > 0), key=lambda x: -x[1])
    return {"step_ms": step_s * 1e3, "gpu_busy_ms": sum(ms for _, ms, _ in kernels),
            "by_kind": {k: round(ms, 3) for k, ms, _ in by_kind(kernels)},
            "top": [{"kernel": k[:110], "ms": round(ms, 3), "calls": c} for k, ms, c in kernels[:40]],
            "host": host_side(averages)}


def write_trace(prof, path: str) -> None:
    """The profiler's Chrome trace, gzipped at `path` (ending in .json.gz)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    raw = path[: -len(".gz")]
    prof.export_chrome_trace(raw)
    with open(raw, "rb") as src, gzip.open(path, "wb") as dst:
        shutil.copyfileobj(src, dst)
    os.remove(raw)


class ProfileStep:
    """A StepTimer hook: profiles step `step` (0-based) with torch.profiler; with `trace`,
    writes its Chrome trace there. The summary is in `.result` afterwards."""

    def __init__(self, step: int, trace: str | None = None):
        self.step, self.trace = step, trace
        self.profiler = None
        self.result: dict | None = None

    def begin(self, step: int) -> None:
        if step == self.step:
            import torch.profiler as tp

            self.profiler = tp.profile(activities=[tp.ProfilerActivity.CPU, tp.ProfilerActivity.CUDA])
            self.profiler.start()

    def end(self, step: int, seconds: float) -> None:
        if self.profiler is None:
            return
        self.profiler.stop()
        self.result = summarise_profile(self.profiler, seconds)
        if self.trace:
            write_trace(self.profiler, self.trace)
            self.result["trace"] = self.trace
        self.profiler = None


class MemoryPeakStep:
    """A StepTimer hook: records the CUDA allocator's history over step `step` (0-based)
    and keeps what is alive at its peak (memory_peak.peak_breakdown, per `tokens`)."""

    def __init__(self, step: int, tokens: int | None):
        self.step, self.tokens = step, tokens
        self.baseline: int | None = None
        self.result: dict | None = None

    def begin(self, step: int) -> None:
        if step == self.step:
            import torch

            torch.cuda.memory._record_memory_history(max_entries=5_000_000, stacks="python")
            self.baseline = torch.cuda.memory_allocated()

    def end(self, step: int, seconds: float) -> None:
        if self.baseline is None:
            return
        import torch

        from benchmarks.memory_peak import peak_breakdown

        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        self.result = peak_breakdown(snap["device_traces"][torch.cuda.current_device()], self.baseline, self.tokens)
        self.baseline = None


def format_profile(prof: dict, top: int = 25) -> list[str]:
    lines = [f"profile (one extra step): {prof['step_ms']:.1f} ms wall, GPU kernels {prof['gpu_busy_ms']:.1f} ms; "
             "by kind: " + ", ".join(f"{k} {v:.1f}" for k, v in prof.get("by_kind", {}).items()) + "; top kernels:"]
    lines += [f"  {row['ms']:9.3f} ms {row['calls']:6d}x  {row['kernel']}" for row in prof["top"][:top]]
    host = prof.get("host")
    if host:
        launches = host["launches"]
        lines.append(f"host: {launches['calls']} kernel launches ({launches['ms']:.1f} ms); waits for the GPU: "
                     + (", ".join(f"{w['call']} {w['calls']}x {w['ms']:.1f} ms" for w in host["waits"]) or "none")
                     + "; top operators by own host time:")
        lines += [f"  {row['ms']:9.3f} ms {row['calls']:6d}x  {row['op']}" for row in host["top_ops"]]
    return lines
