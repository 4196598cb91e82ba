"""Launch checks: an `accelerate launch` that would not run what its config asks for is refused."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fusedalign.errors import CLIError, LaunchError
from fusedalign.launch import accelerate_options, check_launch

ROOT = Path(__file__).resolve().parents[2]
GPU_ZERO3 = str(ROOT / "configs" / "accelerate" / "zero3.yaml")
CPU_ZERO3 = str(ROOT / "configs" / "accelerate" / "cpu" / "zero3.yaml")


def launch(*flags: str, config: str = GPU_ZERO3) -> list[str]:
    return ["/venv/bin/python", "/venv/bin/accelerate", "launch", "--config_file", config, *flags,
            "-m", "fusedalign", "dpo", "--max_steps", "3"]


def test_launch_options_are_read_with_accelerates_parser():
    options = accelerate_options(["python", "-m", "accelerate.commands.launch", "--config_file=x.yaml", "--cpu",
                                  "--main_process_port", "1234", "-m", "fusedalign", "dpo", "--cpu_thing"])
    assert options["config_file"] == "x.yaml" and options["cpu"] is True and options["num_processes"] is None
    assert options["launch_args"] == ["--config_file=x.yaml", "--cpu", "--main_process_port", "1234"]
    assert accelerate_options(["python", "-m", "fusedalign", "dpo"]) is None


def test_cpu_flag_with_a_two_process_config_is_refused_naming_the_cpu_config():
    with pytest.raises(LaunchError) as info:
        check_launch({"ACCELERATE_USE_CPU": "True"}, launch("--cpu", "--mixed_precision", "no"), cuda_available=False)
    message = str(info.value)
    assert "--cpu started 1 plain process, but" in message and "asks for 2 (DEEPSPEED)" in message
    assert "accelerate launch --config_file configs/accelerate/cpu/zero3.yaml -m fusedalign" in message
    assert "--mixed_precision" not in message.split("instead: ", 1)[1]


def test_gpu_config_without_a_gpu_names_the_cpu_config():
    with pytest.raises(LaunchError, match=r"zero3\.yaml is a GPU config .* no CUDA GPU; use .*cpu/zero3\.yaml"):
        check_launch({"WORLD_SIZE": "2"}, launch(), cuda_available=False)
    check_launch({"WORLD_SIZE": "2"}, launch(), cuda_available=True)  # with GPUs it is what was meant


def test_the_cpu_config_and_an_explicit_process_count_pass():
    check_launch({"WORLD_SIZE": "2", "ACCELERATE_USE_CPU": "True"}, launch(config=CPU_ZERO3), cuda_available=False)
    check_launch({"WORLD_SIZE": "1"}, launch("--num_processes", "1", config=CPU_ZERO3), cuda_available=False)
    check_launch({}, ["python", "-m", "fusedalign", "dpo"], cuda_available=False)  # not launched at all


def test_fewer_processes_than_the_config_is_refused():
    with pytest.raises(LaunchError, match="started 1 process.* asks for 2"):
        check_launch({"WORLD_SIZE": "1"}, launch(config=CPU_ZERO3), cuda_available=False)


# ----------------------------------------------------- DeepSpeed's CPU extension (item 6)


def test_deepspeed_cpu_build_is_announced_before_it_starts(tmp_path, monkeypatch, capsys):
    pytest.importorskip("deepspeed")
    from fusedalign.distributed import extensions

    monkeypatch.setattr(extensions, "build_directory", lambda: tmp_path / "deepspeed_shm_comm")  # nothing built there
    assert extensions.needs_build()
    extensions.announce(is_main=False)
    assert capsys.readouterr().err == ""
    extensions.announce(is_main=True)
    err = capsys.readouterr().err
    assert "compiling its shared-memory communication extension (deepspeed_shm_comm)" in err
    assert "0.5-4 minutes" in err and str(tmp_path) in err and "scripts/setup.sh" in err


def test_only_deepspeeds_build_report_line_is_dropped(capsys):
    from fusedalign.distributed.extensions import BUILT_LINE, quiet_build_report

    with quiet_build_report():
        print(BUILT_LINE)
        print("DeepSpeed says something else")
        print("partial", end="")
    assert capsys.readouterr().out == "DeepSpeed says something else\npartial"


def _environment(tmp_path, monkeypatch):
    """A fake environment whose bin holds python and the real ninja of this one (a link)."""
    from fusedalign.distributed import extensions

    real = shutil.which("ninja", path=os.path.dirname(sys.executable)) or shutil.which("ninja")
    if real is None:
        pytest.skip("no ninja")
    bin_dir = tmp_path / "env" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "ninja").symlink_to(real)
    monkeypatch.setattr(sys, "executable", str(bin_dir / "python"))
    monkeypatch.setenv("PATH", os.pathsep.join(["/usr/local/bin", "/usr/bin", "/bin"]))
    return extensions, bin_dir


def test_builds_and_launches_use_the_environments_own_ninja(tmp_path, monkeypatch):
    extensions, bin_dir = _environment(tmp_path, monkeypatch)
    assert extensions.use_environment_ninja() == str(bin_dir / "ninja")  # first, whatever the system has
    assert os.environ["PATH"].split(os.pathsep)[0] == str(bin_dir)
    extensions.use_environment_ninja()
    assert os.environ["PATH"].count(str(bin_dir)) == 1


def _fake_ninja(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    ninja = directory / "ninja"
    ninja.write_text("#!/bin/sh\nexit 0\n")
    ninja.chmod(0o755)
    return ninja


def test_a_build_and_a_launch_each_put_the_environments_ninja_first(tmp_path, monkeypatch):
    """Under a PATH whose first ninja is another one (setup.sh runs the venv's python without its bin on
    PATH): `build()` (setup.sh) and `visible_build()` (every CPU launch) each run what they wrap with the
    environment's ninja first on PATH, even where nothing else asks ninja whether a build is due."""
    from fusedalign.distributed import extensions

    ours, other = _fake_ninja(tmp_path / "env" / "bin"), _fake_ninja(tmp_path / "other")
    monkeypatch.setattr(sys, "executable", str(ours.parent / "python"))
    system = os.pathsep.join([str(other.parent), "/usr/local/bin", "/usr/bin", "/bin"])
    monkeypatch.setattr(extensions, "build_directory", lambda: tmp_path / extensions.NAME)
    seen = {}

    class Builder:  # DeepSpeed's op builder, as far as build() uses it
        def is_compatible(self):
            return True

        def load(self, verbose):
            seen["build"] = shutil.which("ninja")

    monkeypatch.setattr(extensions, "_builder", Builder)
    monkeypatch.setattr(extensions, "needs_build", lambda: True)  # due, without asking any ninja
    monkeypatch.setenv("PATH", system)
    assert shutil.which("ninja") == str(other)
    extensions.build()
    monkeypatch.setattr(extensions, "needs_build", lambda: False)
    monkeypatch.setenv("PATH", system)
    with extensions.visible_build(is_main=True):
        seen["launch"] = shutil.which("ninja")
    assert seen == {"build": str(ours), "launch": str(ours)}


def _built_extension(tmp_path, command):
    """A build directory laid out as torch's JIT leaves it, built by the environment's ninja."""
    from fusedalign.distributed import extensions

    builder = extensions._builder()
    if builder is None or not builder.is_compatible():
        pytest.skip("DeepSpeed does not use its CPU extension here")
    directory = tmp_path / extensions.NAME
    directory.mkdir()
    sources = [builder.deepspeed_src_path(p) for p in builder.strip_empty_entries(builder.sources())]
    (directory / "src.cpp").write_text("int x;\n")
    (directory / "build.ninja").write_text("".join(f"# {s}\n" for s in sources) + f"rule cc\n  command = {command}\n"
                                           f"build {extensions.NAME}.so: cc src.cpp\n")
    subprocess.run([extensions.use_environment_ninja(), "-C", str(directory)], check=True, capture_output=True)
    return extensions, directory


def test_a_build_is_due_when_the_ninja_that_will_run_says_so(tmp_path, monkeypatch):
    pytest.importorskip("deepspeed")
    _environment(tmp_path, monkeypatch)
    extensions, directory = _built_extension(tmp_path, "cp $in $out")
    monkeypatch.setattr(extensions, "build_directory", lambda: directory)
    assert not extensions.needs_build()  # built, and this ninja agrees
    # Same sources, another command line (as another ninja version, or other flags, sees it):
    text = (directory / "build.ninja").read_text().replace("cp $in $out", "cp -p $in $out")
    (directory / "build.ninja").write_text(text)
    assert extensions.needs_build()


def test_a_rebuild_is_reported_even_when_it_was_not_predicted(tmp_path, monkeypatch, capsys):
    pytest.importorskip("deepspeed")
    from fusedalign.distributed import extensions

    library = tmp_path / f"{extensions.NAME}.so"
    monkeypatch.setattr(extensions, "build_directory", lambda: tmp_path)
    monkeypatch.setattr(extensions, "needs_build", lambda: False)
    with extensions.visible_build(is_main=True):
        pass  # nothing built: nothing said
    assert capsys.readouterr().err == ""
    with extensions.visible_build(is_main=True):
        library.write_bytes(b"built")
    err = capsys.readouterr().err
    assert f"DeepSpeed's {extensions.NAME} was built in" in err and "ninja" in err
    with extensions.visible_build(is_main=False):
        library.write_bytes(b"built again")
    assert capsys.readouterr().err == ""


def test_build_directory_follows_torch_extensions_dir_as_torch_does(tmp_path, monkeypatch):
    pytest.importorskip("deepspeed")
    from torch.utils.cpp_extension import _get_build_directory

    from fusedalign.distributed import extensions

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert extensions.build_directory() == Path(_get_build_directory(extensions.NAME, verbose=False))
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    assert extensions.build_directory().parent.parent == Path(__import__("torch").utils.cpp_extension.get_default_build_root())


# ----------------------------------------------------- who says a launch's error


@pytest.mark.parametrize("error", [LaunchError("a GPU config"), CLIError("--beta must be positive")])
@pytest.mark.parametrize("rank", ["0", "1"])
def test_other_ranks_wait_for_the_main_one_to_say_an_error_found_before_training(monkeypatch, capsys, error, rank):
    """Every rank finds the same error before training; the main one prints it. The others wait before
    exiting: the launcher stops every rank when the first one exits, and rank 0 must have spoken."""
    import fusedalign.cli as cli

    def failing(rest):
        raise error

    waits = []
    monkeypatch.setitem(cli.COMMANDS, "dpo", failing)
    monkeypatch.setattr(cli, "_wait_for_the_main_process", lambda: waits.append(rank))
    import fusedalign.cli.training as training

    monkeypatch.setitem(training.STATE, "training", True)  # as an earlier command of the process left it
    monkeypatch.setenv("RANK", rank)
    monkeypatch.delenv("FUSEDALIGN_LAUNCHED", raising=False)
    assert cli.main(["dpo"]) == 2
    err = capsys.readouterr().err
    if rank == "0":
        assert waits == [] and f"fusedalign dpo: error: {error}" in err
    else:
        assert waits == ["1"] and err == ""
