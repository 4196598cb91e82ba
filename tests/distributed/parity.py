"""Helpers of the distributed parity tests: launch scenarios, compare results."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]
RUNNER = ROOT / "tests" / "distributed" / "run_scenarios.py"
CPU_CONFIGS = ROOT / "configs" / "accelerate" / "cpu"
BACKENDS = ["ddp", "zero2", "zero3", "fsdp2"]

# What each backend must really run as (accelerate can fall back to DDP silently).
EXPECTED_WRAPPER = {
    "ddp": ("DistributedType.MULTI_CPU", "DistributedDataParallel"),
    "zero2": ("DistributedType.DEEPSPEED", "DeepSpeedEngine"),
    "zero3": ("DistributedType.DEEPSPEED", "DeepSpeedEngine"),
    "fsdp2": ("DistributedType.FSDP", None),  # FSDP2 changes the model's class in place
}

RTOL = 1e-5
WEIGHT_ATOL = 1e-6  # the final weights' absolute tolerance, beside RTOL


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_scenarios(specs: list[dict], out: Path, backend: str | None, timeout: int = 900) -> None:
    """Runs `specs` single-process (`backend=None`) or as 2 processes under `backend`."""
    out.mkdir(parents=True, exist_ok=True)
    spec_file = out / "specs.json"
    spec_file.write_text(json.dumps(specs))
    if backend is None:
        cmd = [sys.executable, str(RUNNER)]
    else:
        cmd = [
            sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CPU_CONFIGS / f"{backend}.yaml"),
            "--main_process_port", str(_free_port()), str(RUNNER),
        ]
    cmd += ["--spec", str(spec_file), "--out", str(out)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, cwd=str(ROOT), env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")


def result(out: Path, name: str) -> dict:
    return json.loads((out / name / "result.json").read_text())


def weights(out: Path, name: str) -> dict[str, torch.Tensor]:
    model_dir = out / name / "model"
    for file in ("model.safetensors", "adapter_model.safetensors"):
        if (model_dir / file).exists():
            return load_file(str(model_dir / file))
    raise AssertionError(f"no safetensors in {model_dir}: {sorted(os.listdir(model_dir))}")


def assert_same_training(got_out: Path, got: str, want_out: Path, want: str, *, backend: str | None) -> None:
    """Per-step losses, eval metrics and final weights equal those of the baseline."""
    got_res, want_res = result(got_out, got), result(want_out, want)
    if backend is not None:
        dist_type, wrapper = EXPECTED_WRAPPER[backend]
        assert got_res["world_size"] == 2 and got_res["distributed_type"] == dist_type, got_res
        if wrapper:
            assert got_res["wrapper"] == wrapper, got_res
        # A separate frozen model (reference, teacher) and a reward model are split over the ranks
        # where the backend splits the policy.
        split = backend in ("zero3", "fsdp2")
        if got_res["frozen_partitioned"] is not None:
            assert got_res["frozen_partitioned"] == split, got_res
        assert all(p == split for p in got_res["reward_models_partitioned"]), got_res
    # A compiled scenario must really have compiled (and an eager one must not have).
    assert (got_res["compiled_graphs"] > 0) == got_res["compile_layers"], got_res
    # The loss-aware head ran in every training forward where the trainer declared its loss,
    # and its declaration always matched (no mismatch, never over budget).
    calls = got_res["head_calls"]
    assert calls["mismatch"] == 0 and calls["over_budget"] == 0, calls
    if got_res["loss_aware_expected"]:
        assert calls["forward"] >= len(got_res["losses"]) and calls["backward"] == calls["forward"], calls
    else:
        assert calls["forward"] == 0, calls
    assert len(got_res["losses"]) == len(want_res["losses"]) >= 3
    torch.testing.assert_close(torch.tensor(got_res["losses"]), torch.tensor(want_res["losses"]), rtol=RTOL, atol=1e-7)
    if "eval" in got_res:  # scenarios that evaluated compare every eval metric
        for key, value in want_res["eval"].items():
            if key == "epoch":
                continue
            assert abs(got_res["eval"][key] - value) <= RTOL * abs(value) + 1e-6, (key, got_res["eval"][key], value)
    got_w, want_w = weights(got_out, got), weights(want_out, want)
    # FSDP2's full state dict also writes the tied head; it must be the embedding itself.
    if "lm_head.weight" in set(got_w) - set(want_w):
        torch.testing.assert_close(got_w.pop("lm_head.weight"), got_w["model.embed_tokens.weight"], rtol=0, atol=0)
    if any("lora_" in k for k in want_w):
        # A saved adapter: every LoRA tensor must be there. ZeRO-3 does not write the
        # frozen base copy PEFT adds for a targeted lm_head (merging reloads the base).
        assert {k for k in got_w if "lora_" in k} == {k for k in want_w if "lora_" in k}
        want_w = {k: v for k, v in want_w.items() if k in got_w}
    assert set(got_w) == set(want_w), set(got_w) ^ set(want_w)
    for key, value in want_w.items():
        torch.testing.assert_close(got_w[key], value, rtol=RTOL, atol=WEIGHT_ATOL, msg=lambda m, k=key: f"{k}: {m}")


def assert_weights_changed(out: Path, name: str, initial: dict[str, torch.Tensor]) -> None:
    """Guards against a vacuous comparison: training must have moved the weights."""
    final = weights(out, name)
    moved = [k for k in final if k in initial and not torch.allclose(final[k], initial[k], rtol=0, atol=1e-5)]
    assert moved, f"{name}: no weight changed in training; the parity comparison would be vacuous"


def lazy_runs(root: Path, baseline: list[dict], scenarios: dict[str, list[tuple[dict, str]]]):
    """Returns get(backend): launches the baseline (None) or a backend once, on first use."""
    done: dict[str | None, Path] = {}

    def get(backend: str | None) -> Path:
        if backend not in done:
            out = root / (backend or "single")
            specs = baseline if backend is None else [spec for spec, _ in scenarios[backend]]
            run_scenarios(specs, out, backend)
            done[backend] = out
        return done[backend]

    return get
