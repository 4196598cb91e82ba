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

Which ninja runs matters: torch runs the first `ninja` on PATH, and ninja rebuilds
everything when the build log was written by another version ("command line changed";
1.13 even discards a 1.11 log). `setup.sh` runs the venv's python without activating the
venv, so it found the system's ninja, while a launch with `.venv/bin` on PATH found the
venv's, and rebuilt, silently, for 35-57 s (2026-12-04, f9b5da6). So every build and every
launch puts the environment's own ninja (next to its python) first on PATH, and whether a
build is due is asked of that ninja itself (`ninja -n`), not guessed from file names.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

NAME = "deepspeed_shm_comm"
BUILT_LINE = "DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully"


def build_directory() -> Path:
    """Where torch's JIT keeps the extension (torch.utils.cpp_extension's layout): directly under
    `$TORCH_EXTENSIONS_DIR` when it is set, else under the default root's py<version>_<flavour>."""
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"]) / NAME
    flavour = "cpu" if torch.version.cuda is None else f"cu{torch.version.cuda.replace('.', '')}"
    return Path(get_default_build_root()) / f"py{sys.version_info.major}{sys.version_info.minor}_{flavour}" / NAME


def use_environment_ninja() -> str | None:
    """Puts the ninja installed beside this python first on PATH (for torch's JIT and its
    children); returns the ninja that torch will run."""
    here = os.path.dirname(sys.executable)  # not resolved: a venv's bin, not the base python's
    if os.path.isfile(os.path.join(here, "ninja")):
        path = os.environ.get("PATH", "")
        if path.split(os.pathsep)[0] != here:
            os.environ["PATH"] = here + (os.pathsep + path if path else "")
    return shutil.which("ninja")


def ninja_has_work(directory: Path) -> bool:
    """Whether the ninja torch will run would run any command in `directory` (a dry run)."""
    ninja = use_environment_ninja()
    if ninja is None:
        return True  # torch cannot build without one; DeepSpeed will say so
    done = subprocess.run([ninja, "-n", "-C", str(directory)], capture_output=True, text=True)
    return done.returncode != 0 or "no work to do" not in done.stdout


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
    if not all(source in ninja.read_text() for source in sources):
        return True  # built from another environment's sources
    return ninja_has_work(directory)


def announce(is_main: bool) -> bool:
    """Says, before DeepSpeed starts compiling, what it compiles, why, and for how long.

    Returns whether a build is due (on every rank; only the main one speaks)."""
    due = needs_build()
    if is_main and due:
        print(f"[fusedalign] DeepSpeed on CPU: compiling its shared-memory communication extension ({NAME}) for "
              f"this environment, once: 0.5-4 minutes on 2 cores. It is cached in {build_directory()}; "
              "`bash scripts/setup.sh` builds it ahead of time.", file=sys.stderr, flush=True)
    return due


def _built_at() -> float | None:
    library = build_directory() / f"{NAME}.so"
    return library.stat().st_mtime if library.is_file() else None


@contextlib.contextmanager
def visible_build(is_main: bool) -> Iterator[None]:
    """Around DeepSpeed's `init_distributed` on CPU: the environment's ninja, a notice before
    a build that is due, and, after, a line saying that the extension was (re)built and how
    long it took whenever its library changed, announced or not."""
    use_environment_ninja()
    before, start = _built_at(), time.monotonic()
    announce(is_main)
    with quiet_build_report():
        yield
    if is_main and _built_at() != before:
        print(f"[fusedalign] DeepSpeed's {NAME} was built in {time.monotonic() - start:.0f} s "
              f"(by {shutil.which('ninja')}); later launches from this environment reuse it.",
              file=sys.stderr, flush=True)


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
    use_environment_ninja()  # the ninja every launch from this environment will use
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
