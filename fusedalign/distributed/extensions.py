"""DeepSpeed's CPU extension: built once, visibly, before the first CPU launch needs it.

On a machine without a GPU, `deepspeed.init_distributed` builds its shared-memory
communication kernels (`deepspeed_shm_comm`, for its CPU collectives) with torch's C++
JIT the first time it runs: 0.5 to 4 minutes on a 2-core machine (34 s measured on
2026-12-03 on an idle one), with no word while it compiles. The result is cached in
`$TORCH_EXTENSIONS_DIR` (default `~/.cache/torch_extensions`) under
`py<version>_cpu/deepspeed_shm_comm`; torch rebuilds it when the compile command changes,
and that command names the environment's site-packages, so each environment (each path)
builds it once. `scripts/setup.sh` runs `build()` at install time, so neither the demo
nor the tests pay it silently; a launch that still has to build says so first.
"""

from __future__ import annotations

import contextlib
import io
import sys
import time
from pathlib import Path
from typing import Iterator

NAME = "deepspeed_shm_comm"
BUILT_LINE = "DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully"


def build_directory() -> Path:
    """Where torch's JIT keeps the extension (torch.utils.cpp_extension's layout)."""
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    flavour = "cpu" if torch.version.cuda is None else f"cu{torch.version.cuda.replace('.', '')}"
    return Path(get_default_build_root()) / f"py{sys.version_info.major}{sys.version_info.minor}_{flavour}" / NAME


def _builder():
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().create_op_builder("ShareMemCommBuilder")


def needs_build() -> bool:
    """Whether the next CPU `init_distributed` will compile the extension (False if DeepSpeed would not use it)."""
    builder = _builder()
    if builder is None or not builder.is_compatible():
        return False
    directory = build_directory()
    ninja = directory / "build.ninja"
    sources = [builder.deepspeed_src_path(p) for p in builder.strip_empty_entries(builder.sources())]
    if not (directory / f"{NAME}.so").is_file() or not ninja.is_file():
        return True
    text = ninja.read_text()
    return not all(source in text for source in sources)  # built from this environment's sources


def announce(is_main: bool) -> None:
    """Says, before DeepSpeed starts compiling, what it compiles, why, and for how long."""
    if is_main and needs_build():
        print(f"[fusedalign] DeepSpeed on CPU: compiling its shared-memory communication extension ({NAME}) for "
              f"this environment, once: 0.5-4 minutes on 2 cores. It is cached in {build_directory()}; "
              "`bash scripts/setup.sh` builds it ahead of time.", file=sys.stderr, flush=True)


class _DropLine(io.TextIOBase):
    """A stream that forwards everything but one exact line."""

    def __init__(self, stream, line: str):
        self.stream, self.line, self.buffer_ = stream, line, ""

    def write(self, text: str) -> int:
        self.buffer_ += text
        *lines, self.buffer_ = self.buffer_.split("\n")
        for line in lines:
            if line != self.line:
                self.stream.write(line + "\n")
        return len(text)

    def flush(self) -> None:
        if self.buffer_ and self.buffer_ != self.line:
            self.stream.write(self.buffer_)
        self.buffer_ = ""
        self.stream.flush()


@contextlib.contextmanager
def quiet_build_report() -> Iterator[None]:
    """Drops DeepSpeed's "... built successfully" line, printed on every process at every launch."""
    stream = _DropLine(sys.stdout, BUILT_LINE)
    with contextlib.redirect_stdout(stream):
        try:
            yield
        finally:
            stream.flush()


def build() -> None:
    """Builds the extension now, saying so (`python -m fusedalign.distributed.extensions`)."""
    builder = _builder()
    if builder is None or not builder.is_compatible():
        print(f"[fusedalign] DeepSpeed does not use {NAME} here; nothing to build.", file=sys.stderr)
        return
    if not needs_build():
        print(f"[fusedalign] DeepSpeed's {NAME} is already built in {build_directory()}.", file=sys.stderr)
        return
    print(f"[fusedalign] building DeepSpeed's CPU communication extension ({NAME}) once, into "
          f"{build_directory()}: 0.5-4 minutes on 2 cores ...", file=sys.stderr, flush=True)
    start = time.monotonic()
    builder.load(verbose=False)
    print(f"[fusedalign] built in {time.monotonic() - start:.0f} s.", file=sys.stderr)


if __name__ == "__main__":
    from fusedalign.cli.noise import quiet_known_noise

    quiet_known_noise()  # DeepSpeed's "Setting accelerator to CPU" is what is meant here
    build()
