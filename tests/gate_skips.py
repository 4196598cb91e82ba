"""The GPU gate's skipped tests: a pytest plugin, and the check scripts/gpu_tests.sh makes with it.

A test marked `gpu` that skips on a machine with CUDA proves nothing, and the run would still
read as passed (a transformers without `prompt_ignore_length`, say, skips a proof test). As a
plugin (`-p tests.gate_skips`), this writes each skipped test marked `gpu` to the file named by
FUSEDALIGN_GPU_SKIPS, one line each: node id, a tab, the reason. As a program,

    python -m tests.gate_skips FILE [ALLOWED_REGEX ...]

it prints every skip whose reason matches none of the allowed patterns and exits 1 if there is
one (0 otherwise, also when FILE does not exist: nothing was skipped).
"""

from __future__ import annotations

import os
import re
import sys

_skipped: list[str] = []


def pytest_runtest_logreport(report):
    if not report.skipped or hasattr(report, "wasxfail") or "gpu" not in report.keywords:
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    reason = " ".join(str(reason).removeprefix("Skipped: ").split())
    _skipped.append(f"{report.nodeid}\t{reason}")


def pytest_sessionfinish(session):
    path = os.environ.get("FUSEDALIGN_GPU_SKIPS")
    if path:
        with open(path, "w") as f:
            f.write("".join(line + "\n" for line in _skipped))


def unexpected(path: str, allowed: list[str]) -> list[str]:
    """The lines of `path` whose reason matches none of `allowed` (regular expressions)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        lines = [line.rstrip("\n") for line in f if line.strip()]
    return [line for line in lines if not any(re.search(p, line.split("\t", 1)[-1]) for p in allowed)]


def main(argv: list[str]) -> int:
    bad = unexpected(argv[0], argv[1:])
    for line in bad:
        nodeid, _, reason = line.partition("\t")
        print(f"  skipped: {nodeid} ({reason})", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
