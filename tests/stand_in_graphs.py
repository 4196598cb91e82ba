"""CUDA graphs replaced, on the CPU, by a replay of StaticDecode's step with the window it was
captured with, as a graph would replay it: the loop's graph bookkeeping, tested without a GPU.

Every run of the step (the warm-up, and each replay standing in for the capture's recording) is
held to what a CUDA graph's capture accepts, as far as the CPU can see it: no value read back to
the host (`.item()`, `bool(tensor)`, `nonzero`) and no tensor made from host data
(`torch.tensor([...])`, which on CUDA is a host-to-device copy). Either fails the capture on a GPU
with an error the CPU run would never show. Not seen here: `.tolist()` (it reads the data without
dispatching an op), and a 0-dim tensor from host data, which the CPU cannot tell apart from a
Python scalar assigned into a tensor (`x[..., -1] = False`, a fill on CUDA, which capture accepts).
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

REFUSED_IN_CAPTURE = {
    aten._local_scalar_dense.default: "reads a value back to the host (.item(), bool(), int() of a tensor)",
    aten.lift_fresh.default: "makes a tensor from host data (torch.tensor(...): a host-to-device copy on CUDA)",
    aten.nonzero.default: "waits for the device to size its output (nonzero)",
    aten.masked_select.default: "waits for the device to size its output (masked_select)",
}


class CaptureRules(TorchDispatchMode):
    """Raises on an op that CUDA graph capture refuses (`REFUSED_IN_CAPTURE`)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is aten.lift_fresh.default and args[0].dim() == 0:
            return func(*args, **(kwargs or {}))  # a Python scalar assigned into a tensor (see above)
        if func in REFUSED_IN_CAPTURE:
            raise AssertionError(f"{func} in a captured decoding step {REFUSED_IN_CAPTURE[func]}: a CUDA graph's "
                                 "capture fails on it")
        return func(*args, **(kwargs or {}))


def stand_in_graphs(monkeypatch, *, rules: bool = True) -> list[int]:
    """Makes StaticDecode capture stand-in graphs; returns the list the captured windows go to.

    Args:
        rules: run each step under `CaptureRules` (off only for a compiled step: inductor's own
            code runs beneath the dispatcher, so a mode would see only what dynamo left eager).
    """
    from fusedalign.generation import static

    captured = []

    def run(step, slots):
        if not rules:
            return step(slots)
        with CaptureRules():
            return step(slots)

    class Graph:
        def __init__(self, step, slots):
            self.step, self.slots = step, slots

        def replay(self):
            run(self.step, self.slots)

    def capture(step, device, slots):
        run(step, slots)  # the warm-up is a real step
        captured.append(slots)
        return Graph(step, slots)

    monkeypatch.setattr(static, "graphs_possible", lambda device: True)
    monkeypatch.setattr(static, "capture_step", capture)
    return captured
