"""One subprocess per configuration, and the result it leaves as JSON.

The parent calls `launch(argv, tag, ...)`; the worker process, started with that argv,
does its run inside `worker_result(path)` and returns. Whatever happens in the worker
(an OOM, an exception, a crash that never reaches Python) the parent gets a dict with
a `status` of "ok", "OOM" or "error".
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
import traceback
from pathlib import Path

from benchmarks.harness.env import REPO, log, worker_env


def launch(argv: list[str], tag: str, *, log_dir: str, device: str, gpu: int = 0, timeout: int = 1200,
           result_flag: str = "--result", quiet_errors: bool = False) -> dict:
    """Runs `argv + [result_flag, <log_dir>/<tag>.json]` with its output in `<log_dir>/<tag>.log`.

    Returns:
        The worker's result dict, plus `log` (its path) and `wall_s`. A worker that left
        no result is "OOM" when its log says so, else "error".
    """
    result_path = os.path.join(log_dir, f"{tag}.json")
    log_path = os.path.join(log_dir, f"{tag}.log")
    if os.path.exists(result_path):
        os.remove(result_path)
    t0 = time.perf_counter()
    with open(log_path, "w") as out:
        try:
            proc = subprocess.run(argv + [result_flag, result_path], stdout=out, stderr=subprocess.STDOUT,
                                  env=worker_env(device, gpu), timeout=timeout, cwd=REPO)
            rc: int | str = proc.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    wall = time.perf_counter() - t0
    if os.path.exists(result_path):
        with open(result_path) as f:
            result = json.load(f)
    else:
        text = Path(log_path).read_text(errors="replace")
        oom = "OutOfMemoryError" in text or "out of memory" in text.lower()
        result = {"status": "OOM" if oom else "error", "error": f"worker ended (rc={rc}) without a result"}
    result.update(log=log_path, wall_s=wall)
    if result["status"] == "error" and not quiet_errors:
        tail = Path(log_path).read_text(errors="replace").splitlines()[-25:]
        log(f"  !! {tag}: {result.get('error')} (rc={rc}); log {log_path}; its tail:")
        for line in tail:
            log("     | " + line)
    return result


def is_oom(error: BaseException) -> bool:
    import torch

    return isinstance(error, torch.cuda.OutOfMemoryError) or "out of memory" in str(error).lower()


@contextlib.contextmanager
def worker_result(path: str, peak=lambda: None):
    """Yields the result dict a worker fills; writes it to `path` however the run ends.

    An exception inside sets status "OOM" (CUDA out of memory) or "error" with a one-line
    message (and the traceback in the log); `peak()` is recorded either way.
    """
    result: dict = {"status": "error"}
    try:
        yield result
    except Exception as e:  # noqa: BLE001 - reported in the table, with the log's path
        first_line = str(e).splitlines()[0] if str(e) else ""
        result.update(status="OOM" if is_oom(e) else "error", peak_gib=peak(),
                      error=f"{type(e).__name__}: {first_line}"[:300])
        traceback.print_exc()
    finally:
        with open(path, "w") as f:
            json.dump(result, f, indent=1, default=str)
