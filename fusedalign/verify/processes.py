"""Starts verify's workers: one plain process, or `accelerate launch` with the user's config.

The launcher is accelerate's own (`python -m accelerate.commands.launch`, what the
`accelerate launch` command runs), started with this Python so that the workers import
the same fusedalign. A launch writes its output to `DIR/<label>.log`; when it fails, the
runs it did not finish are reported as crashed with the error it ended on.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time

from fusedalign.verify.plan import Launch

_ERROR_LINE = re.compile(r"^(\[rank\d+\]: )?((\w+\.)*\w*(Error|Exception): .*|fusedalign .*error: .*)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(launch: Launch, spec_file: str) -> list[str]:
    worker = ["-m", "fusedalign.verify.worker", spec_file]
    if launch.config is None:
        return [sys.executable, *worker]
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", launch.config,
            "--num_processes", str(launch.num_processes), "--main_process_port", str(_free_port()),
            *launch.launch_args, *worker]


def last_error(log: str) -> str:
    """The error a failed launch stopped on: the first a training process raised (the launcher's
    own, naming only a failed child, comes after), else the last line of its output."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    for line in lines:
        match = _ERROR_LINE.match(line)
        if match and "ChildFailedError" not in line:
            return match.group(2)[:300]
    return (lines or ["no output"])[-1][:300]


def execute(launches: list[Launch], workdir: str, timeout: int | None = None) -> dict[str, str | None]:
    """Runs every launch in turn; returns, per run name, the error that stopped it (None: it finished)."""
    errors: dict[str, str | None] = {}
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    for index, launch in enumerate(launches, start=1):
        for run in launch.runs:
            run["dir"] = os.path.join(workdir, run["name"])
            os.makedirs(run["dir"], exist_ok=True)
        spec_file = os.path.join(workdir, f"launch{index}.json")
        with open(spec_file, "w") as f:
            json.dump(launch.runs, f)
        names = ", ".join(run["name"] for run in launch.runs)
        where = "one process" if launch.config is None else f"{launch.num_processes} processes, {launch.label}"
        print(f"[verify] {index}/{len(launches)}: {where}: {names} ...", file=sys.stderr, flush=True)
        start = time.monotonic()
        log_path = os.path.join(workdir, f"launch{index}.log")
        with open(log_path, "w") as log:
            try:
                code = subprocess.run(command(launch, spec_file), stdout=log, stderr=subprocess.STDOUT, env=env,
                                      timeout=timeout).returncode
            except subprocess.TimeoutExpired:
                code = -1
        with open(log_path) as log:
            text = log.read()
        error = None if code == 0 else (f"timed out after {timeout} s" if code == -1 else last_error(text))
        for run in launch.runs:
            finished = os.path.isfile(os.path.join(run["dir"], "result.json"))
            errors[run["name"]] = None if finished else (error or "no result written")
        took = f"{time.monotonic() - start:.0f} s"
        status = f"done in {took}" if code == 0 else f"failed after {took} (exit {code}): {error}"
        print(f"[verify]   {status}", file=sys.stderr, flush=True)
    return errors
