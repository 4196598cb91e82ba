"""A run against the oracle: the largest relative differences, per dtype tolerances, a verdict.

What is compared, per optimizer step: the loss, the gradient norm (logged by Trainer when
`max_grad_norm` > 0) and every other value the trainer logs, its metrics (rewards,
log-probs, KL, clip ratios, token counts...; timings left out). A value's difference is
relative to the largest magnitude that value takes over the oracle's steps, floored (at
1e-3 for the loss and gradient norm, 1e-2 for metrics) so that a value that is ~0 at
step 1, as DPO's rewards are, is not divided by ~0. Metrics get a looser tolerance than
the loss: several are small differences of large sums (DPO's rewards are beta times a
difference of summed log-probs), whose rounding scales with the sums. A key logged at a
step by one run and not the other is a disagreement; a key neither logs at that step is
not (GRPO logs its completion metrics at the steps that generate).

The final weights are compared tensor by tensor, relative to how far the oracle moved
that tensor in training (floored at a fraction of the tensor's norm, so a tensor that
barely moves is not held to its own rounding): a run whose head got no gradient, or a
wrong one, differs by about its whole update. verify trains with plain SGD, so a
weight's update is the learning rate times its (summed) gradients: no optimizer state
amplifies rounding, and a wrong gradient shows in the weights as it is.

Tolerances, by the dtype the compared run trains in (the oracle is always float32):
- float32: 1e-4 on the loss and gradient norm, 1e-3 on metrics, 1e-3 of the update on
  weights. Parity on CPU holds to about 1e-6 (metrics 1e-5); the margin covers GPU
  reductions in a different order.
- bfloat16 / float16 (weights or mixed precision): 5e-2 on the loss and gradient norm,
  1e-1 on metrics, 2e-1 of the update on weights: these runs differ from the float32 oracle by their own rounding,
  which grows with the model; a bug of the classes verify looks for (a dropped soft-cap,
  a per-micro-batch normalisation, a missing gradient) moves values by more than that
  on a run of a few steps at verify's learning rate.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Tolerance:
    values: float  # per-step loss and gradient norm, relative
    metrics: float  # every other logged value, relative
    weights: float  # final weights, relative to the oracle's update of the tensor
    weight_floor: float  # the update is floored at this fraction of the tensor's norm


TOLERANCES = {
    "float32": Tolerance(values=1e-4, metrics=1e-3, weights=1e-3, weight_floor=1e-3),
    "bfloat16": Tolerance(values=5e-2, metrics=1e-1, weights=2e-1, weight_floor=3e-2),
}
FLOORS = {"loss": 1e-3, "grad_norm": 1e-3, "metrics": 1e-2}


def tolerance_for(result: dict[str, Any]) -> tuple[str, Tolerance]:
    low = result.get("mixed_precision") in ("bf16", "fp16") or result.get("dtype") in ("bfloat16", "float16")
    name = "bfloat16" if low else "float32"
    return name, TOLERANCES[name]


@dataclass
class Difference:
    """The largest relative difference of one kind, and where it is."""

    value: float = 0.0
    where: str = ""

    def update(self, value: float, where: str) -> None:
        if math.isnan(self.value):  # NaN counts as larger than anything
            return
        if math.isnan(value) or value > self.value:
            self.value, self.where = value, where


@dataclass
class Comparison:
    """One run against the oracle: differences by kind, and the first disagreement, if any."""

    name: str
    dtype: str = "float32"
    kinds: dict[str, Difference] = field(default_factory=lambda: {k: Difference() for k in KINDS})
    first: str | None = None  # "loss at step 2: 0.6931 vs 0.6925 (rel 8.7e-04 > 1e-04)"
    crashed: str | None = None  # the error that ended the run

    @property
    def agrees(self) -> bool:
        return self.crashed is None and self.first is None


KINDS = ("loss", "grad_norm", "metrics", "weights")


def _kind(key: str) -> str:
    return key if key in ("loss", "grad_norm") else "metrics"


def _relative(got: float, want: float, scale: float) -> float:
    if math.isnan(got) or math.isnan(want):
        return 0.0 if math.isnan(got) and math.isnan(want) else float("inf")
    return abs(got - want) / scale


def compare_steps(cmp: Comparison, got: list[dict[str, float]], want: list[dict[str, float]], tol: Tolerance) -> None:
    if len(got) != len(want):
        cmp.first = cmp.first or f"logged {len(got)} steps, the oracle {len(want)}"
    keys = sorted({k for step in want for k in step}, key=lambda k: (k != "loss", k != "grad_norm", k))
    scales = {k: max((abs(s[k]) for s in want if k in s and not math.isnan(s[k])), default=0.0) for k in keys}
    for index, (g, w) in enumerate(zip(got, want), start=1):
        # A step's own keys: a value logged at some steps only (GRPO's completion metrics, at the
        # steps that generate) is compared where either run logged it.
        for key in [k for k in keys if k in g or k in w] + sorted(set(g) - set(keys)):
            if key not in g or key not in w:
                side = "the oracle" if key in w else "this run"
                cmp.first = cmp.first or f"{key} at step {index}: logged by {side} only"
                continue
            kind = _kind(key)
            rel = _relative(g[key], w[key], max(scales[key], FLOORS[kind]))
            cmp.kinds[kind].update(rel, f"{key}@{index}")
            limit = tol.metrics if kind == "metrics" else tol.values
            if not rel <= limit and cmp.first is None:
                cmp.first = (f"{key} at step {index}: {g[key]:.6g} vs oracle {w[key]:.6g} "
                             f"(rel {rel:.1e} > {limit:.0e})")


def load_weights(model_dir: str) -> dict[str, Any]:
    from safetensors.torch import load_file

    for name in ("model.safetensors", "adapter_model.safetensors"):
        path = os.path.join(model_dir, name)
        if os.path.isfile(path):
            return load_file(path)
    raise FileNotFoundError(f"no model.safetensors or adapter_model.safetensors in {model_dir}")


def compare_weights(cmp: Comparison, got: dict, want: dict, initial: dict, tol: Tolerance) -> None:
    # A whole FSDP2 state dict also holds a tied head; it must be the embedding itself.
    if "lm_head.weight" in set(got) - set(want) and "model.embed_tokens.weight" in got:
        got = {k: v for k, v in got.items() if k != "lm_head.weight"}
    missing = sorted(set(want) ^ set(got))
    if missing:
        side = "the oracle" if missing[0] in want else "this run"
        cmp.first = cmp.first or f"weights: {missing[0]} saved by {side} only"
    for key in sorted(set(want) & set(got)):
        w, g = want[key].double(), got[key].double()
        start = initial[key].double() if key in initial else w
        scale = max(float((w - start).norm()), tol.weight_floor * float(w.norm()), 1e-12)
        rel = float((g - w).norm()) / scale if g.shape == w.shape else float("inf")
        cmp.kinds["weights"].update(rel, key)
        if not rel <= tol.weights and cmp.first is None:
            cmp.first = f"final weights, {key}: rel {rel:.1e} of the oracle's update (> {tol.weights:.0e})"


def compare_run(name: str, run_dir: str, oracle_dir: str, error: str | None = None) -> Comparison:
    """Compares the run written in `run_dir` with the oracle's; `error`: why its launch failed, if it did."""
    import json

    cmp = Comparison(name)
    result_file = os.path.join(run_dir, "result.json")
    if not os.path.isfile(result_file):
        cmp.crashed = error or "no result written"
        return cmp
    with open(result_file) as f:
        got = json.load(f)
    with open(os.path.join(oracle_dir, "result.json")) as f:
        want = json.load(f)
    cmp.dtype, tol = tolerance_for(got)
    compare_steps(cmp, got["steps"], want["steps"], tol)
    compare_weights(cmp, load_weights(os.path.join(run_dir, "model")), load_weights(os.path.join(oracle_dir, "model")),
                    load_weights(os.path.join(oracle_dir, "initial")), tol)
    return cmp
