"""`fusedalign launch`: checks once in one process, then runs `accelerate launch`, and leaves
a fusedalign error as the last line a user reads (exit 2), the launcher's and other ranks'
tracebacks held back; any other failure shows everything."""

from __future__ import annotations

import subprocess
import sys

import pytest

from fusedalign.cli import main
from fusedalign.cli import launcher
from fusedalign.cli.launcher import HeldOutput, split_argv
from fusedalign.errors import CLIError

GLOO_TRACEBACK = """Traceback (most recent call last):
  File "/x/fusedalign/cli/__init__.py", line 120, in main
    return COMMANDS[command](rest) or 0
  File "/x/torch/distributed/distributed_c10d.py", line 4000, in barrier
    work.wait()
RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection reset by peer
"""
LAUNCHER_TRACEBACK = """W1204 14:02:11.123000 1234 torch/distributed/elastic/multiprocessing/api.py:900] Sending process 5 closing signal SIGTERM
E1204 14:02:11.456000 1234 torch/distributed/elastic/multiprocessing/api.py:874] failed (exitcode: 2) local_rank: 0
Traceback (most recent call last):
  File "/x/accelerate/commands/launch.py", line 1200, in <module>
    main()
torch.distributed.elastic.multiprocessing.errors.ChildFailedError: 
============================================================
fusedalign FAILED
------------------------------------------------------------
Failures:
  <NO_OTHER_FAILURES>
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-04_14:02:11
  rank      : 0 (local_rank: 0)
  exitcode  : 2 (pid: 5)
============================================================
"""
ERROR = "fusedalign dpo: error: --lora_target_modules: Target modules {'no_such_proj'} not found in the base model."


def _run(chunks, failed):
    written = []
    out = HeldOutput(written.append)
    for chunk in chunks:
        out.feed(chunk)
    last = out.finish(failed=failed)
    return "".join(written), last


def test_an_error_line_is_last_and_the_tracebacks_around_it_are_held():
    progress = "\r  0%|          | 0/3 [00:00<?, ?it/s]"
    text = "[fusedalign] no --model_name_or_path: training builtin:tiny-qwen2\n" + progress + "\n" + GLOO_TRACEBACK \
        + ERROR + "\n" + LAUNCHER_TRACEBACK
    # Fed in odd pieces, as a pipe delivers it.
    written, last = _run([text[i:i + 37] for i in range(0, len(text), 37)], failed=True)
    assert last == ERROR
    assert "[fusedalign] no --model_name_or_path" in written and "0/3" in written
    assert "Traceback" not in written and "Connection reset" not in written and "FAILED" not in written
    assert "W1204" not in written and ERROR not in written  # said once, last, by run_launch


def test_rank_zeros_line_is_preferred():
    written, last = _run(["fusedalign dpo (rank 1): error: x\n", "fusedalign dpo: error: x\n"], failed=True)
    assert last == "fusedalign dpo: error: x"


def test_an_error_line_after_another_ranks_unfinished_progress_bar_is_held_and_said_last():
    # Two ranks write to one pipe: rank 1's bar had not ended its line when rank 0 said the error.
    bar = "Loading weights: 100%|##########| 27/27 [00:00<00:00, 1456.37it/s]"
    written, last = _run(["\r" + bar[:20], bar[20:] + ERROR + "\n", bar + "\n"], failed=True)
    assert last == ERROR and "error:" not in written


def test_an_error_line_with_another_ranks_bar_redrawn_after_it_on_the_same_line_is_said_once_last():
    # Rank 1's bar redraws (a carriage return, no newline) after rank 0's error, before any newline:
    # the pipe's unfinished line then holds the error between two redraws.
    bar = "Loading weights:   0%|          | 0/27 [00:00<?, ?it/s]"
    for cut in (5, len(ERROR) // 2, len(ERROR)):
        chunks = ["\r" + bar, "\r" + ERROR[:cut], ERROR[cut:] + "\r" + bar[:10], bar[10:] + "\n"]
        written, last = _run(chunks, failed=True)
        assert last == ERROR and "error:" not in written, (cut, written)


def test_a_failure_without_our_line_shows_everything_it_held():
    written, last = _run(["step 1\n", GLOO_TRACEBACK, LAUNCHER_TRACEBACK], failed=True)
    assert last is None
    assert written.startswith("step 1\n") and "Connection reset by peer" in written and "ChildFailedError" in written


def test_an_interrupted_runs_resume_command_stays_last():
    written, last = _run([" 15%|#5   | 61/400\r", "W1204 14:52:38.567000 1 api.py:753] Received 2 death signal\n",
                          "[fusedalign] interrupted (SIGINT); the last one is out/checkpoint-60.\n",
                          "[fusedalign] resume with: fusedalign launch dpo --resume_from_checkpoint last\n",
                          "W1204 14:52:38.568000 1 api.py:1028] Sending process 2 closing signal SIGINT\n"], failed=True)
    assert last is None
    lines = written.strip().splitlines()
    assert lines[-1].startswith("[fusedalign] resume with:") and lines[-2].startswith("[fusedalign] interrupted")
    assert "Sending process 2" in written


def test_a_progress_bar_is_forwarded_as_it_redraws():
    written = []
    out = HeldOutput(written.append)
    out.feed("\r 10%|#")
    out.feed("\r 20%|##")
    assert "".join(written) == "\r 10%|#\r"  # the latest redraw follows with the next


def test_split_argv_takes_the_launch_options_then_the_command():
    assert split_argv(["--config_file", "c.yaml", "--num_processes", "2", "dpo", "--beta", "0.2"]) == \
        (["--config_file", "c.yaml", "--num_processes", "2"], "dpo", ["--beta", "0.2"])
    with pytest.raises(CLIError, match="no training command"):
        split_argv(["--config_file", "c.yaml"])
    with pytest.raises(CLIError, match="runs `-m fusedalign COMMAND` itself"):
        split_argv(["--config_file", "c.yaml", "-m", "fusedalign", "dpo"])


@pytest.mark.parametrize("flags,expected", [
    (["--beta", "0"], "beta must be > 0"),
    (["--dataset_config", "standard_nothing"], "standard_preference"),
    (["--model_name_or_path", "builtin:tiny-nothing", "--dataset_name", "builtin:zen", "--dataset_config",
      "standard_preference"], "tiny-qwen2"),
    (["--lora_rr", "3"], "did you mean --lora_r"),
])
def test_bad_input_is_one_line_before_any_process_starts(flags, expected, tmp_path, monkeypatch, capsys):
    started = []
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: started.append(a))
    assert main(["launch", "--config_file", "configs/accelerate/cpu/ddp.yaml", "dpo", *flags,
                 "--output_dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "error:" in err and expected in err and "Traceback" not in err, err
    assert started == [] and not (tmp_path / "run").exists()


def test_a_valid_run_is_handed_to_accelerate_launch_and_its_exit_code_kept(tmp_path, monkeypatch, capsys):
    seen = {}

    class FakeLaunch:
        def __init__(self, cmd, stderr, env):
            seen["cmd"], seen["env"] = cmd, env
            self.read, write = __import__("os").pipe()
            __import__("os").write(write, b"[fusedalign] trained\n")
            __import__("os").close(write)
            self.stderr = __import__("io").FileIO(self.read, closefd=True)

        def wait(self):
            return 0

    monkeypatch.setattr(launcher.subprocess, "Popen", FakeLaunch)
    out, config = str(tmp_path / "run"), "configs/accelerate/cpu/ddp.yaml"
    assert main(["launch", "--config_file", config, "dpo", "--max_steps", "1", "--output_dir", out]) == 0
    assert seen["cmd"] == [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config, "-m",
                           "fusedalign", "dpo", "--max_steps", "1", "--output_dir", out]
    assert "[fusedalign] trained" in capsys.readouterr().err


def test_other_ranks_stay_quiet_about_an_error_found_before_training(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("RANK", "1")
    assert main(["dpo", "--beta", "0", "--output_dir", str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "0")
    assert main(["dpo", "--beta", "0", "--output_dir", str(tmp_path / "run")]) == 2
    assert "beta must be > 0" in capsys.readouterr().err


def test_the_resume_command_of_a_run_started_by_fusedalign_launch_says_fusedalign_launch(monkeypatch):
    from fusedalign import launch
    from fusedalign.cli.training import resume_command

    parent = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "c.yaml", "-m", "fusedalign", "dpo"]
    monkeypatch.setattr(launch, "parent_argv", lambda: parent)
    monkeypatch.setenv("FUSEDALIGN_LAUNCHED", "1")
    assert resume_command("dpo", ["--save_steps", "5"]) == \
        "fusedalign launch --config_file c.yaml dpo --save_steps 5 --resume_from_checkpoint last"
    monkeypatch.delenv("FUSEDALIGN_LAUNCHED")
    assert resume_command("dpo", []).startswith("accelerate launch --config_file c.yaml -m fusedalign dpo")
