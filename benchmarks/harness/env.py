"""The environment of a benchmark run: paths, logging, versions, the GPU it uses."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # this working tree's fusedalign, however it is installed

PACKAGES = ("torch", "transformers", "accelerate", "datasets", "trl", "liger-kernel", "triton")


def log(*parts) -> None:
    print(*parts, flush=True)


def versions(packages: tuple[str, ...] = PACKAGES) -> dict[str, str | None]:
    """Installed version of each package (None: not installed)."""
    from importlib import metadata

    out: dict[str, str | None] = {}
    for name in packages:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def versions_line(found: dict[str, str | None]) -> str:
    return ", ".join(f"{k} {v or '(not installed)'}" for k, v in found.items()) + f"; python {sys.version.split()[0]}"


def one_gpu(index: int) -> str:
    """CUDA_VISIBLE_DEVICES for a worker: one GPU (several would make Trainer use DataParallel)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        devices = [d.strip() for d in visible.split(",") if d.strip()]
        return devices[index] if index < len(devices) else devices[0]
    return str(index)


def gpu_info(index: int) -> str:
    """The GPU's name and memory, read in a subprocess so that this process never holds a CUDA context."""
    code = ("import torch; p = torch.cuda.get_device_properties(0); "
            "print(f'{p.name}, {p.total_memory / 2**30:.0f} GiB, CUDA {torch.version.cuda}')")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=one_gpu(index))
    try:
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        return out.stdout.strip() or f"(unknown: {out.stderr.strip().splitlines()[-1:]})"
    except Exception as e:  # noqa: BLE001 - only a label
        return f"(unknown: {e})"


def worker_env(device: str, gpu: int) -> dict[str, str]:
    """A worker's environment: offline, quiet, one GPU."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", TQDM_DISABLE="1",
               HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_NO_ADVISORY_WARNINGS="1")
    if device == "cuda":
        env["CUDA_VISIBLE_DEVICES"] = one_gpu(gpu)
    return env
