"""Backends of `head_logprobs`, by name.

A backend is a function `(hidden, weight, labels, bias, low_rank, opts) -> HeadOutput`
computing the definition in docs/internals.md. Built-in backends register themselves
when their module is imported; optional ones (a CUDA Triton kernel in
`ops/triton_head.py`) are imported only when asked for, so a missing dependency costs
nothing until someone requests that backend by name — and then fails loudly, never
swapping in another computation. Only "auto" moves on to the next backend that can run
(the same function; `HeadOutput.backend` says which one ran). A statistic that not every
backend computes (`OPTIONAL_STATISTICS`) is a need of the call: "auto" passes over a backend
that lacks it (on CUDA the Triton head, whose kernels do not compute `log_sum_sq_probs`, so
a call asking for it runs the chunked torch backend), and a backend named explicitly that
lacks it is refused.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from fusedalign.ops.blocks import BlockMath
from fusedalign.ops.options import HeadOptions, HeadOutput, LowRank

# Statistics a backend computes only if it says so (`Backend.statistics`); entropy, logit_mean
# and argmax every backend computes.
OPTIONAL_STATISTICS = frozenset({"log_sum_sq_probs"})

BackendFn = Callable[
    [Tensor, Tensor, Tensor, "Tensor | None", "LowRank | None", HeadOptions], HeadOutput
]


class BackendUnavailableError(RuntimeError):
    """A backend was requested by name but cannot run here."""


@dataclass(frozen=True)
class Backend:
    """One implementation of the op.

    Attributes:
        key: what callers pass as `backend=` ("torch", "reference", "triton").
        name: what `HeadOutput.backend` reports ("torch-chunked", ...).
        run: the implementation.
        unavailable_reason: returns None when the backend can run on `device`, else a
            sentence saying why not.
        dtype_reason: likewise for the dtype of `hidden`.
        blocks: the backend's block math for the loss-aware mode (the `BlockMath`
            protocol of `ops/blocks.py`), or None when it has none (the op then runs the
            ordinary path).
        statistics: which of `OPTIONAL_STATISTICS` its `run` computes.
    """

    key: str
    name: str
    run: BackendFn
    unavailable_reason: Callable[[torch.device], str | None] = lambda device: None
    dtype_reason: Callable[[torch.dtype], str | None] = lambda dtype: None
    blocks: BlockMath | None = None
    statistics: frozenset[str] = frozenset()

    def reason(self, device: torch.device, dtype: torch.dtype | None,
               needs: frozenset[str] = frozenset()) -> str | None:
        """Why this backend cannot run here (or compute the statistics `needs` names), or None when it can."""
        why = self.unavailable_reason(device)
        if why is None and dtype is not None:
            why = self.dtype_reason(dtype)
        missing = sorted(needs - self.statistics)
        if why is None and missing:
            why = f"it does not compute {', '.join(missing)}"
        return why


_BACKENDS: dict[str, Backend] = {}
# Backends living in optional modules, imported on first request.
_LAZY_MODULES = {"triton": "fusedalign.ops.triton_head"}
# Device types a lazily imported backend can run on: "auto" does not even import it
# elsewhere (importing Triton on a CPU box costs time and proves nothing).
_LAZY_DEVICE_TYPES = {"triton": ("cuda",)}
# What backend="auto" tries, in order: the first that can run on the device and dtype.
_AUTO_ORDER = ("triton", "torch")


def register_backend(backend: Backend) -> None:
    """Make `backend` selectable as `head_logprobs(..., backend=backend.key)`."""
    existing = _BACKENDS.get(backend.key)
    if existing is not None and existing.run is not backend.run:
        raise ValueError(f"a different backend is already registered as {backend.key!r}")
    _BACKENDS[backend.key] = backend


def known_backends() -> list[str]:
    """Every key `backend=` accepts (some may be unavailable on this machine)."""
    return sorted({"auto", *_BACKENDS, *_LAZY_MODULES})


def _lookup(key: str) -> Backend:
    if key not in _BACKENDS and key in _LAZY_MODULES:
        module = _LAZY_MODULES[key]
        try:
            importlib.import_module(module)
        except ImportError as err:
            raise BackendUnavailableError(
                f"backend {key!r} is not available: importing {module} failed ({err}). "
                "Use backend='torch' (or 'auto')."
            ) from err
    if key not in _BACKENDS:
        raise ValueError(f"unknown backend {key!r}; choose one of {known_backends()}")
    return _BACKENDS[key]


def resolve_backend(
    requested: str, device: torch.device, dtype: torch.dtype | None = None,
    needs: frozenset[str] = frozenset(),
) -> Backend:
    """The backend to run for `backend=requested` on `device` with `hidden` of `dtype`.

    "auto" takes the first of `_AUTO_ORDER` that imports and can run here; "triton" on
    CUDA when Triton is installed, else "torch". `needs`: the optional statistics the call
    asks for (`OPTIONAL_STATISTICS`); "auto" passes over a backend that lacks one.

    Raises:
        ValueError: `requested` names no backend.
        BackendUnavailableError: it names one that cannot run on `device`.
    """
    if not isinstance(requested, str):
        raise TypeError(f"backend must be a string, got {type(requested).__name__}")
    if requested == "auto":
        for key in _AUTO_ORDER:
            if device.type not in _LAZY_DEVICE_TYPES.get(key, (device.type,)):
                continue
            try:
                backend = _lookup(key)
            except BackendUnavailableError:  # e.g. Triton not installed: try the next
                continue
            if backend.reason(device, dtype, needs) is None:
                return backend
        raise BackendUnavailableError(f"no backend of {_AUTO_ORDER} can run on {device}")
    backend = _lookup(requested)
    reason = backend.reason(device, dtype, needs)
    if reason is not None:
        raise BackendUnavailableError(
            f"backend {requested!r} cannot run on {device}: {reason}. "
            "Use backend='torch' (or 'auto')."
        )
    return backend
