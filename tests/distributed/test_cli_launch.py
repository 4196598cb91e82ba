"""The historical reproducer, in our terms: fused-head DPO through the CLI under ZeRO-3.

In TRL this command crashed (`size mismatch ... vec (0)`) until patched. Here it must
train, save a whole model, and log the same losses as the same command in one process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from tests.distributed.parity import CPU_CONFIGS, ROOT, _free_port

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

COMMON = [
    "dpo", "--model_name_or_path", "builtin:tiny-qwen2", "--dataset_name", "builtin:zen",
    "--dataset_config", "standard_preference", "--use_liger_kernel", "--max_steps", "3", "--logging_steps", "1",
    "--train_sampling_strategy", "sequential", "--eval_strategy", "no", "--save_strategy", "no",
    "--learning_rate", "1e-3", "--max_grad_norm", "0",
]


def _run(cmd, out):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd + ["--output_dir", str(out)], cwd=str(ROOT), env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]


def test_zero3_fused_dpo_cli_trains_and_equals_one_process(tmp_path):
    launched = _run(
        [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CPU_CONFIGS / "zero3.yaml"),
         "--main_process_port", str(_free_port()), "-m", "fusedalign", *COMMON, "--per_device_train_batch_size", "4"],
        tmp_path / "zero3",
    )
    single = _run([sys.executable, "-m", "fusedalign", *COMMON, "--per_device_train_batch_size", "8"], tmp_path / "single")
    assert len(launched) == len(single) == 3
    torch.testing.assert_close(torch.tensor(launched), torch.tensor(single), rtol=1e-5, atol=1e-6)
    got = load_file(str(tmp_path / "zero3" / "model.safetensors"))
    want = load_file(str(tmp_path / "single" / "model.safetensors"))
    initial = load_file(str(ROOT / "fusedalign" / "resources" / "models" / "tiny-qwen2" / "model.safetensors"))
    assert set(got) == set(want)
    assert any(not torch.allclose(want[k], initial[k]) for k in want)
    for key in want:  # Adam amplifies rounding; still far below any real difference
        torch.testing.assert_close(got[key], want[key], rtol=1e-4, atol=1e-5, msg=key)
    assert (tmp_path / "zero3" / "tokenizer.json").is_file() and (tmp_path / "zero3" / "training_curves.png").is_file()


def test_zero3_refuses_compiled_layers_with_a_clear_error(tmp_path):
    """--torch_compile under ZeRO-3 stops before training, naming the flag and what to use."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CPU_CONFIGS / "zero3.yaml"),
           "--main_process_port", str(_free_port()), "-m", "fusedalign", *COMMON, "--per_device_train_batch_size", "4",
           "--torch_compile", "--output_dir", str(tmp_path / "out")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, cwd=str(ROOT), env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0
    assert "not supported under DeepSpeed ZeRO-3" in proc.stderr + proc.stdout, proc.stderr[-3000:]
    assert not (tmp_path / "out" / "metrics.jsonl").exists()
