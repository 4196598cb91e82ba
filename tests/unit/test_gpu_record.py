"""benchmarks/gpu_record.sh, the GPU records' one command: every part it can run is a command
its script accepts, with the GPU's flags (DRY=1 prints the commands; nothing runs)."""

from __future__ import annotations

import importlib
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_record.sh"


def _parts() -> list[str]:
    text = SCRIPT.read_text()
    named = re.findall(r"^part (\w+) \d+ ", text, re.M)
    looped = (["dpo_flex", "dpo_flex16"] if "NAME=dpo_flex" in text else [])  # `part $NAME` in a loop
    looped += [f"generation_{n}" for n in (128, 512)] if "part generation_$PROMPT" in text else []
    if "part generation_real$SUFFIX" in text:  # realistic lengths: 128-token prompts unsuffixed
        looped += [f"generation_real{s}{static}" for s in ("", "_512") for static in ("", "_static")]
    return named + looped


def _commands(tmp_path, tiny: bool) -> dict[str, list[str]]:
    env = dict(os.environ, DRY="1", PARTS=" ".join(_parts()), OUT=str(tmp_path / "out"),
               MODEL=str(tmp_path / "model"), TEACHER=str(tmp_path / "teacher"), TINY="1" if tiny else "0",
               BASELINE=str(ROOT))  # the baseline_* parts' earlier tree: here this one's scripts parse their flags
    done = subprocess.run(["bash", str(SCRIPT)], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("DRY ")]
    commands = {}
    for line in lines:
        _, name, limit, *argv = shlex.split(line)
        assert 0 < int(limit) <= 560, (name, limit)  # a part fits a ten-minute command with the model's build
        commands[name] = argv
    return commands


@pytest.mark.parametrize("tiny", [False, True], ids=["gpu", "tiny"])
def test_every_part_is_a_command_its_script_accepts(tmp_path, tiny):
    commands = _commands(tmp_path, tiny)
    assert set(commands) == set(_parts()) | {"model", "teacher"}
    parsed = 0
    for name, argv in commands.items():
        assert argv[0] == "python3", (name, argv)
        if argv[1] == "-c":
            compile(argv[2], f"<{name}>", "exec")
            continue
        script = Path(argv[1])
        if script.is_absolute():  # a baseline_* part: $BASELINE/benchmarks/...
            assert name.startswith("baseline_"), (name, argv)
            script = script.relative_to(ROOT)
        assert script.parent == Path("benchmarks") and (ROOT / script).exists(), (name, argv)
        module = importlib.import_module(f"benchmarks.{script.stem}")
        flags = argv[2:] + ([] if "--device" in argv else ["--device", "cuda"])  # what the GPU run defaults to
        try:
            module.parse_args(flags)
        except SystemExit as exit_:  # argparse's error: the part would fail on the GPU at once
            pytest.fail(f"part {name}: {shlex.join(argv)} is refused (exit {exit_.code})")
        parsed += 1
    assert parsed == len(commands) - 2  # every part but the two model builds
    if not tiny:
        assert "--memory_snapshot" in commands["distill_memory"] and "--profile" in commands["grpo_profile"]
        assert commands["grpo_checkpointing"][commands["grpo_checkpointing"].index("--max_tokens_per_batch") + 1] \
            == "32768"


def test_a_dry_run_removes_no_model(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    _commands(tmp_path, tiny=False)
    assert model.exists()
