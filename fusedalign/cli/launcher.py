"""`fusedalign launch [accelerate launch options] COMMAND [flags]`: check once, then launch.

Under a bare `accelerate launch -m fusedalign ...`, a bad flag or row is found by every
process after the process group exists, and the user's one line is followed by the
launcher's `ChildFailedError` traceback (and, when one rank stopped first, preceded by the
other's gloo "Connection reset by peer" traceback), exit 1. This command:

1. checks the accelerate config against this machine (a GPU config without a GPU), the
   flags, the output directory, the names of the models (policy, reference, teacher, reward
   models), the reward functions' imports and the data (row by row) in this one process,
   before any process group exists (`cli.precheck`): a mistake is one line, exit 2;
2. starts `accelerate launch OPTIONS -m fusedalign COMMAND FLAGS` itself, passing its
   output through, except the tracebacks that follow a fusedalign error (the other ranks'
   and the launcher's), which are held back;
3. when the run failed with a fusedalign error, prints that line last and exits 2; any
   other failure shows everything it held, and the launcher's exit code.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from typing import Any, Callable

from fusedalign.cli.commands import TRAINING_COMMANDS
from fusedalign.errors import CLIError

USAGE = (f"usage: fusedalign launch [accelerate launch options] {{{','.join(TRAINING_COMMANDS)}}} [flags]\n"
         "  e.g. fusedalign launch --config_file configs/accelerate/cpu/zero3.yaml dpo --max_steps 6")

ERROR_LINE = re.compile(r"fusedalign \w+( \(rank \d+\))?: error: ")  # anywhere: ranks share the pipe
TRACEBACK = re.compile(r"^(\[rank\d+\]:\s*)?Traceback \(most recent call last\):")
CHAINED = re.compile(r"^(\[rank\d+\]:\s*)?(During handling of the above exception|The above exception was)")
EXCEPTION = re.compile(r"^(\[rank\d+\]:\s*)?[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b")
CLOSING = re.compile(r"^\[fusedalign\] (interrupted|resume with)")  # an interrupted run's last words
LAUNCHER_LOG = re.compile(r"^[WE]\d{4} ")  # torch elastic's glog lines (a child failed, others are stopped)


def split_argv(argv: list[str]) -> tuple[list[str], str, list[str]]:
    """(accelerate launch options, training command, its flags)."""
    for i, token in enumerate(argv):
        if token in TRAINING_COMMANDS:
            return argv[:i], token, argv[i + 1:]
        if token in ("-m", "--module") or (not token.startswith("-") and token.endswith(".py")):
            raise CLIError(f"fusedalign launch runs `-m fusedalign COMMAND` itself; give the command "
                           f"({', '.join(TRAINING_COMMANDS)}) after the launch options, not {token!r}.")
    raise CLIError(f"fusedalign launch: no training command ({', '.join(TRAINING_COMMANDS)}) given. {USAGE}")


def validate(launch_args: list[str], command: str, argv: list[str]) -> str | None:
    """Everything a run checks before training that one process can check: the accelerate config
    against this machine, then flags, output dir, the checkpoint resumed from, models and reward
    functions, data (`cli.precheck`). Returns the line saying the run is already complete, or None."""
    from fusedalign.cli.precheck import check_launch_config, check_run

    check_launch_config(launch_args, command)
    return check_run(command, argv)


class HeldOutput:
    """Passes a run's stderr through, holding back what a fusedalign error would make noise:
    tracebacks and the launcher's log lines until the end, everything once the error is seen.
    At the end a failed run with an error line shows that line alone, last; any other run
    shows what was held, then an interrupted run's resume command."""

    def __init__(self, write: Callable[[str], Any]):
        self.write, self.held, self.closing, self.in_traceback, self.rest = write, [], [], False, ""
        self.error_line: str | None = None

    def feed(self, text: str) -> None:
        *lines, self.rest = (self.rest + text).split("\n")
        for line in lines:
            self._line(line)
        if "\r" in self.rest and not (self.in_traceback or self.error_line or ERROR_LINE.search(self.rest)):
            # A progress bar's redraws, forwarded as they come; an unfinished line that holds an error
            # (another rank's bar may redraw after it before the newline) waits for its end.
            shown, self.rest = self.rest.rsplit("\r", 1)
            self.write(shown + "\r")

    def _line(self, line: str) -> None:
        bare = line.rsplit("\r", 1)[-1]
        if found := ERROR_LINE.search(line):
            # Another rank's progress bar may share the error's line, before it or redrawn after it.
            said = line[found.start():].split("\r", 1)[0]
            if self.error_line is None or ("(rank" in self.error_line and "(rank" not in said):
                self.error_line = said  # rank 0's, when it speaks
            self.held.append(line)
        elif self.error_line is not None or TRACEBACK.match(bare) or CHAINED.match(bare) or self.in_traceback:
            self.held.append(line)
            self.in_traceback = bool(TRACEBACK.match(bare)) or (self.in_traceback and not EXCEPTION.match(bare))
        elif LAUNCHER_LOG.match(bare):
            self.held.append(line)
        elif CLOSING.match(bare):
            self.closing.append(line)
        else:
            self.write(line + "\n")

    def finish(self, failed: bool) -> str | None:
        """The error line to print last (failed runs with one), or None after writing what was held."""
        if self.rest:
            self._line(self.rest)
            self.rest = ""
        if failed and self.error_line:
            return self.error_line
        for line in self.held + self.closing:  # an interrupted run's resume command stays last
            self.write(line + "\n")
        return None


def run_launch(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    options, command, flags = split_argv(argv)
    complete = validate(options, command, flags)
    if complete is not None:  # a requeued job of a finished run: no process is started
        print(complete, file=sys.stderr)
        return 0
    cmd = [sys.executable, "-m", "accelerate.commands.launch", *options, "-m", "fusedalign", command, *flags]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "FUSEDALIGN_LAUNCHED": "1"}
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, env=env)
    output = HeldOutput(lambda text: (sys.stderr.write(text), sys.stderr.flush()))
    # Ctrl-C reaches the training processes from the terminal, which stop between checkpoints and
    # say how to resume; this process waits for them. SIGTERM sent to it alone is passed on.
    previous = {signal.SIGINT: signal.signal(signal.SIGINT, signal.SIG_IGN),
                signal.SIGTERM: signal.signal(signal.SIGTERM, lambda signum, _: proc.send_signal(signum))}
    try:
        while chunk := os.read(proc.stderr.fileno(), 65536):
            output.feed(chunk.decode(errors="replace"))
        code = proc.wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    last = output.finish(failed=code != 0)
    if last is not None:
        print(last, file=sys.stderr)
        return 2
    return code
