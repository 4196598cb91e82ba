"""Diagnostic: error of the triton and torch backends against float64 as logits grow (CUDA)."""

import torch

from tests.unit.test_ops import make_problem, opts_of, rel_err, run_oracle, run_op
from tests.unit.test_ops_triton import GRAD_NAMES, on

for std in (1.0, 30.0, 300.0):
    p = make_problem(33, 70, 8, dtype=torch.float32, ignore_frac=0.3, logit_std=std)
    want, want_grads, z = run_oracle(p, opts_of())
    row = [f"std {std:6.1f} max|z| {z.abs().max().item():8.1f}"]
    for backend in ("torch", "triton"):
        out, grads = run_op(on(p, "cuda"), opts_of(), backend, chunk_size=7)
        errs = [rel_err(out.logps.cpu(), want)] + [
            rel_err(g.cpu(), r) for g, r in zip(grads, want_grads) if g is not None and r is not None
        ]
        row.append(f"{backend}: " + " ".join(f"{e:.1e}" for e in errs))
    print(" | ".join(row), flush=True)
