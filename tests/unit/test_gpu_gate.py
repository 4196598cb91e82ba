"""scripts/gpu_tests.sh runs the tests marked `gpu` or `cuda_path` in tests/unit. A test that CI
skips for want of CUDA (or Triton) and that has neither mark runs nowhere: this finds such tests,
and shows what the finding sees (tests/gate_coverage.py). A test marked gpu that skips on the GPU
machine fails the gate's run (tests/gate_skips.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA present: the skips this looks for do not happen here")
def test_every_test_skipped_for_want_of_cuda_is_in_the_gpu_gate(tmp_path):
    report = tmp_path / "orphans.txt"
    env = {**os.environ, "FUSEDALIGN_GATE_REPORT": str(report), "PYTHONWARNINGS": "ignore"}
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "tests.gate_coverage",
                           "-p", "no:cacheprovider", "tests"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    orphans = report.read_text()
    assert orphans == "", "skipped in CI for want of CUDA, and not marked gpu or cuda_path:\n" + orphans


# ------------------------------------------------------------------ what the gate check finds


def _orphans(tmp_path, files: dict[str, str], block: tuple[str, ...] = ()) -> dict[str, str]:
    """The plugin's report on `files`, collected in a fresh pytest on a machine seen as CI sees it: no
    CUDA, and the packages in `block` not installed. Returns {node id: what skips it}."""
    conftest = ("import sys\n\nimport torch\n\ntorch.cuda.is_available = lambda: False\n"
                f"for name in {block!r}:\n    sys.modules[name] = None  # import name: ImportError\n")
    (tmp_path / "conftest.py").write_text(conftest)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: x\n    cuda_path: x\n")
    for name, text in files.items():
        (tmp_path / name).write_text(textwrap.dedent(text))
    report = tmp_path / "orphans.txt"
    env = {**os.environ, "FUSEDALIGN_GATE_REPORT": str(report), "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"}
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "tests.gate_coverage",
                           "-p", "no:cacheprovider", "-c", str(tmp_path / "pytest.ini"), "--rootdir", str(tmp_path),
                           str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode in (0, 5), done.stdout[-3000:] + done.stderr[-3000:]  # 5: nothing collected
    lines = [line for line in report.read_text().splitlines() if line]
    return {line.split(" (", 1)[0]: line.split(" (", 1)[1] for line in lines}


def test_a_module_skipped_whole_for_want_of_triton_or_cuda_is_found(tmp_path):
    """A module-level importorskip("triton") without Triton, or a module-level skip without CUDA, leaves
    no test to collect; unless the module's pytestmark puts it in the gate, it is reported."""
    found = _orphans(tmp_path, {
        "test_triton_interpreter.py": """
            import pytest
            pytest.importorskip("triton")
            def test_kernel(): pass
            """,
        "test_module_cuda.py": """
            import pytest, torch
            if not torch.cuda.is_available():
                pytest.skip("needs a CUDA device", allow_module_level=True)
            def test_kernel(): pass
            """,
        "test_triton_in_the_gate.py": """
            import pytest
            pytestmark = [pytest.mark.gpu]
            pytest.importorskip("triton")
            def test_kernel(): pass
            """,
        "test_needs_another_package.py": """
            import pytest
            pytest.importorskip("no_such_package_here")
            def test_other(): pass
            """,
    }, block=("triton",))
    assert set(found) == {"test_triton_interpreter.py", "test_module_cuda.py"}, found
    assert "triton" in found["test_triton_interpreter.py"] and "needs a CUDA device" in found["test_module_cuda.py"]


def test_skips_in_a_tests_body_or_its_fixtures_are_found_where_they_can_happen(tmp_path):
    """pytest.skip / importorskip for want of CUDA or Triton in the test, in a fixture or a helper it
    calls, in an `except` of a failing import, or under an `if` that holds here or cannot be evaluated
    (per parametrisation); not where the `if` is false here (a skip when CUDA is present), the import
    succeeds, the reason is another, or the test is in the gate."""
    found = _orphans(tmp_path, {"test_bodies.py": """
        import pytest, torch

        HAS_TRITON = False

        def _needs_cuda():
            if not torch.cuda.is_available():
                pytest.skip("needs a CUDA device")

        @pytest.fixture
        def device():
            _needs_cuda()
            return "cuda"

        def test_in_the_body():
            if not torch.cuda.is_available():
                pytest.skip("needs a CUDA device")

        def test_through_a_fixture(device): pass

        def test_importorskip_in_the_body():
            pytest.importorskip("triton")

        def test_in_an_except():
            try:
                import triton  # noqa: F401
            except ImportError:
                pytest.skip("needs Triton")

        @pytest.mark.parametrize("backend", ["triton", "torch"])
        def test_per_parameter(backend):
            if backend == "triton" and not HAS_TRITON:
                pytest.skip("needs Triton")

        def test_under_a_local_condition():
            cards = torch.cuda.device_count()
            if cards == 0:
                pytest.skip("needs a GPU")

        def test_only_when_cuda_is_present():
            if torch.cuda.is_available():
                pytest.skip("a machine with a GPU runs it")

        def test_another_reason():
            pytest.skip("no ninja")

        def test_an_import_that_succeeds():
            try:
                import json  # noqa: F401
            except ImportError:
                pytest.skip("needs Triton")

        @pytest.mark.gpu
        def test_in_the_gate():
            if not torch.cuda.is_available():
                pytest.skip("needs a CUDA device")
        """}, block=("triton",))
    assert set(found) == {f"test_bodies.py::{name}" for name in (
        "test_in_the_body", "test_through_a_fixture", "test_importorskip_in_the_body", "test_in_an_except",
        "test_per_parameter[triton]", "test_under_a_local_condition")}, found
    assert "in _needs_cuda" in found["test_bodies.py::test_through_a_fixture"]


def test_skip_marks_for_triton_or_bf16_are_found(tmp_path):
    """skipif reasons that name Triton or bf16 (not only CUDA, a GPU or an accelerator), a string
    condition evaluated as pytest does, and a plain skip mark, when they skip here."""
    found = _orphans(tmp_path, {"test_marks.py": """
        import pytest, torch

        @pytest.mark.skipif(True, reason="needs a CUDA device")
        def test_cuda(): pass

        @pytest.mark.skipif(True, reason="needs Triton")
        def test_triton(): pass

        @pytest.mark.skipif(True, reason="no bf16 here")
        def test_bf16(): pass

        @pytest.mark.skipif("not torch.cuda.is_available()", reason="no device")
        def test_string_condition(): pass

        @pytest.mark.skip(reason="waits for an NVIDIA card")
        def test_skip_mark(): pass

        @pytest.mark.skipif(True, reason="too slow here")
        def test_another_reason(): pass

        @pytest.mark.skipif(False, reason="needs Triton")
        def test_not_skipped(): pass

        @pytest.mark.cuda_path
        @pytest.mark.skipif(True, reason="needs Triton")
        def test_in_the_gate(): pass
        """})
    assert set(found) == {f"test_marks.py::{name}" for name in (
        "test_cuda", "test_triton", "test_bf16", "test_string_condition", "test_skip_mark")}, found


# ------------------------------------------------------------------ skips in the gate's own run


def _gate_run(tmp_path, tests: str) -> subprocess.CompletedProcess:
    """scripts/gpu_tests.sh on a copy of the repository holding `tests` as its only test file, run by
    a python3 that answers the script's CUDA and package checks as a GPU machine would."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    (repo / "tests" / "unit").mkdir(parents=True)
    shutil.copy(REPO / "scripts" / "gpu_tests.sh", repo / "scripts")
    shutil.copy(REPO / "tests" / "gate_skips.py", repo / "tests")
    (repo / "tests" / "__init__.py").write_text("")
    (repo / "tests" / "unit" / "__init__.py").write_text("")
    (repo / "tests" / "unit" / "test_fake.py").write_text(textwrap.dedent(tests))
    (repo / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: x\n    cuda_path: x\n")
    shim = tmp_path / "bin" / "python3"
    shim.parent.mkdir()
    shim.write_text(f"""#!/usr/bin/env bash
case "$2" in  # the script's checks for a CUDA device and for the packages: as on a GPU machine
    *torch.cuda.is_available*|"import accelerate, datasets, deepspeed, peft, transformers, triton") exit 0;;
esac
exec {sys.executable} "$@"
""")
    shim.chmod(0o755)
    env = {**os.environ, "PATH": f"{shim.parent}{os.pathsep}{os.environ['PATH']}", "OUT": str(tmp_path / "out"),
           "PYTHONWARNINGS": "ignore"}
    return subprocess.run(["bash", str(repo / "scripts" / "gpu_tests.sh")], env=env, capture_output=True, text=True,
                          timeout=300)


def test_a_gpu_test_skipped_with_cuda_present_fails_the_gate_run(tmp_path):
    """A test marked gpu that skips on the GPU machine (a transformers without what it needs, say) fails
    the run: exit 1 and a final line saying so, with the test named; pytest's closing line stays the
    last line of the output, and a skip whose reason is allowed ("CUDA present: ...") passes."""
    tests = """
        import pytest

        @pytest.mark.gpu
        def test_runs(): pass

        @pytest.mark.gpu
        def test_twin_tested_compiled():
            pytest.skip("CUDA present: the kernels are tested compiled, above")

        @pytest.mark.cuda_path
        def test_cuda_path_skip():
            pytest.skip("not a gpu test: not checked")
        """
    bad = tests + """
        @pytest.mark.gpu
        def test_proof():
            pytest.skip("this transformers' generate lacks prompt_ignore_length")
        """
    done = _gate_run(tmp_path / "bad", bad)
    out, err = done.stdout.strip().splitlines(), done.stderr.strip().splitlines()
    assert done.returncode == 1, done.stdout + done.stderr
    assert "1 passed, 3 skipped" in out[-1], out[-1]  # pytest's closing line, as before
    assert err[-1].startswith("gpu_tests.sh: FAILED: 1 test(s) marked gpu skipped with CUDA present"), err
    assert any("test_fake.py::test_proof" in line and "prompt_ignore_length" in line for line in err), err
    assert not any("test_twin_tested_compiled" in line or "test_cuda_path_skip" in line for line in err), err
    done = _gate_run(tmp_path / "good", tests)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 passed, 2 skipped" in done.stdout.strip().splitlines()[-1]
    assert "FAILED" not in done.stderr
