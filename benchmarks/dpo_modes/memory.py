"""The memory-snapshot mode (--memory_snapshot): when it is recorded, and how it is printed."""

from __future__ import annotations

from benchmarks.builders.dpo_configs import DPORun
from benchmarks.harness.env import log


def snapshot_unsupported(args, run: DPORun) -> str | None:
    """Why --memory_snapshot is not recorded for this run (None: it is)."""
    if run.compile_layers and args.gradient_checkpointing:
        # Seen on the H200 (torch 2.11, 2026-12-03): with the allocator's history recorded,
        # the checkpoint's recompute of a compiled layer failed in the backward with
        # "SystemError: <built-in method apply of FunctionMeta object> returned NULL".
        return "recording crashed the checkpointed recompute of compiled layers (torch 2.11)"
    return None


def log_memory(config: str, length: int, result: dict) -> None:
    """With --memory_snapshot: what was alive at the recorded step's peak."""
    if result.get("memory"):
        from benchmarks.memory_peak import format_breakdown

        log(f"\n  memory at the peak of the recorded step, {config} at length {length}:\n"
            + "\n".join("    " + line for line in format_breakdown(result["memory"]).splitlines()) + "\n")
