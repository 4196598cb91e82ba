"""CUDA graphs replaced, on the CPU, by a replay of StaticDecode's step with the window it was
captured with, as a graph would replay it: the loop's graph bookkeeping, tested without a GPU.

Every run of the step (the warm-up, and each replay standing in for the capture's recording) is
held to what a CUDA graph's capture accepts, as far as the CPU can see it: no value read back to
the host (`.item()`, `bool(tensor)`, `nonzero`, `.tolist()`, `.cpu()`, `.numpy()`; the last three
refused by name, since on a CPU tensor they dispatch nothing) and no tensor made from host data
(`torch.tensor([...])`, which on CUDA is a host-to-device copy). Each fails the capture on a GPU
with an error the CPU run would never show. Not seen here: a 0-dim tensor from host data, which
the CPU cannot tell apart from a Python scalar assigned into a tensor (`x[..., -1] = False`, a
fill on CUDA, which capture accepts).
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


# Tensor methods that copy to the host without an op the dispatcher sees on a CPU tensor.
HOST_READS = ("tolist", "cpu", "numpy")


class CaptureRules(TorchDispatchMode):
    """Raises on an op that CUDA graph capture refuses (`REFUSED_IN_CAPTURE`), or a `HOST_READS` call."""

    def __enter__(self):
        self._methods = {name: getattr(torch.Tensor, name) for name in HOST_READS}
        for name in HOST_READS:
            setattr(torch.Tensor, name, _refused(name))
        return super().__enter__()

    def __exit__(self, *exc):
        for name, method in self._methods.items():
            setattr(torch.Tensor, name, method)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is aten.lift_fresh.default and args[0].dim() == 0:
            return func(*args, **(kwargs or {}))  # a Python scalar assigned into a tensor (see above)
        if func in REFUSED_IN_CAPTURE:
            raise AssertionError(f"{func} in a captured decoding step {REFUSED_IN_CAPTURE[func]}: a CUDA graph's "
                                 "capture fails on it")
        return func(*args, **(kwargs or {}))


def _refused(name: str):
    def method(*args, **kwargs):
        raise AssertionError(f"Tensor.{name}() in a captured decoding step copies to the host: a CUDA graph's "
                             "capture fails on it")
    return method


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


def eager_and_stand_in(monkeypatch, model, prompts, keys, seed: int, **kwargs):
    """One StaticDecode(**kwargs) call from `seed`, eager (no graphs), then the same in stand-in graphs
    under the capture's rules. Returns (eager output, stand-in output, the stand-in's StaticDecode,
    the windows it captured)."""
    from fusedalign.generation import StaticDecode

    torch.manual_seed(seed)
    want = StaticDecode(**kwargs, cuda_graphs=False).generate(model, prompts, keys)
    captured = stand_in_graphs(monkeypatch)
    torch.manual_seed(seed)
    decode = StaticDecode(**kwargs)
    return want, decode.generate(model, prompts, keys), decode, captured
