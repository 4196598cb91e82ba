"""`fusedalign verify`: check the input (exit 2), run the plan, compare every run with its oracle,
print the table, exit 0 or 1."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from typing import Any

from fusedalign.verify.compare import Comparison
from fusedalign.verify.plan import Launch
from fusedalign.verify.processes import execute
from fusedalign.verify.report import check_run, table, tolerance_note, verdict


def run_plan(launches: list[Launch], workdir: str) -> list[tuple[dict[str, Any], Comparison]]:
    """Runs the launches and compares every run that names an oracle with it."""
    errors = execute(launches, workdir)
    runs = {run["name"]: run for launch in launches for run in launch.runs}
    out = []
    for run in runs.values():
        if "oracle" not in run:
            continue
        oracle = runs[run["oracle"]]
        if errors[oracle["name"]] is not None:
            cmp = Comparison(run["label"], crashed=f"the oracle did not finish: {errors[oracle['name']]}")
        else:
            cmp = check_run(run, oracle["dir"], errors[run["name"]])
        out.append((run, cmp))
    return out


def workspace(keep: bool) -> str:
    path = tempfile.mkdtemp(prefix="fusedalign-verify-")
    if keep:
        print(f"[verify] runs kept in {path}", file=sys.stderr)
    return path


def run_verify(argv: list[str]) -> int:
    """`fusedalign verify TRAINER [flags]`: 0 when every run agrees with the oracle, 1 when one
    disagrees or crashes; bad input raises (one line, exit 2) before anything is launched."""
    from fusedalign.errors import CLIError
    from fusedalign.verify.plan import HELP, check_inputs, parse_options, plan

    if any(flag in argv for flag in ("-h", "--help")):
        print(HELP)
        return 0
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise CLIError("run `fusedalign verify` itself, not under accelerate launch or torchrun: it starts its own "
                       "processes with the configs given by --backends or --config_file.")
    if argv and argv[0] == "--self_test":
        from fusedalign.verify.selftest import run_self_test

        return run_self_test(argv[1:])
    options = parse_options(argv)
    launches = plan(options)
    check_inputs(launches)
    workdir = workspace(options.keep_outputs)
    try:
        results = run_plan(launches, workdir)
    finally:
        if not options.keep_outputs:
            shutil.rmtree(workdir, ignore_errors=True)
    print(table(launches[0].runs[0]["label"], [cmp for _, cmp in results]))
    print(tolerance_note())
    failed = [cmp for _, cmp in results if not cmp.agrees]
    if failed:
        print(f"fusedalign verify {options.trainer}: {failed[0].name}: {verdict(failed[0])}", file=sys.stderr)
        return 1
    print(f"fusedalign verify {options.trainer}: every run agrees with the oracle.", file=sys.stderr)
    return 0
