"""A pytest plugin for tests/unit/test_gpu_gate.py: at collection, writes to the file named by
FUSEDALIGN_GATE_REPORT every test that is skipped here for want of CUDA (a `skipif` whose
condition holds and whose reason names CUDA, a GPU or an accelerator) and that carries neither
the `gpu` nor the `cuda_path` mark, so that scripts/gpu_tests.sh (`-m "gpu or cuda_path"`)
would never run it either."""

from __future__ import annotations

import os
import re

WANTS_A_DEVICE = re.compile(r"cuda|gpu|accelerator", re.IGNORECASE)


def pytest_collection_modifyitems(items):
    orphans = []
    for item in items:
        if any(item.iter_markers("gpu")) or any(item.iter_markers("cuda_path")):
            continue
        for mark in item.iter_markers("skipif"):
            condition = mark.args[0] if mark.args else mark.kwargs.get("condition")
            if condition is True and WANTS_A_DEVICE.search(str(mark.kwargs.get("reason", ""))):
                orphans.append(f"{item.nodeid} (skipped: {mark.kwargs.get('reason')})")
    with open(os.environ["FUSEDALIGN_GATE_REPORT"], "w") as report:
        report.write("\n".join(orphans))
