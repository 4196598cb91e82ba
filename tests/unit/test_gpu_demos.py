"""Each command's embedded demo, as the README gives it, trains on a GPU (skipped without CUDA):
`fusedalign <command> --max_steps 2` with the demo's defaults (a float32 builtin model; on CUDA
`bf16` on, and GRPO's default generator StaticDecode), every logged loss finite, the model
written. The first run of the GPU tests that reached GRPO found its demo crashing there."""

from __future__ import annotations

import json
import math

import pytest
import torch

from fusedalign.cli import main
from fusedalign.generation import StaticDecode

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("command", ["dpo", "kto", "sft", "grpo"])
def test_the_demo_trains_on_cuda(tmp_path, monkeypatch, command):
    calls = []
    generate = StaticDecode.generate

    def recorded(self, *args, **kwargs):
        out = generate(self, *args, **kwargs)
        calls.append(dict(self.last_call))
        return out

    monkeypatch.setattr(StaticDecode, "generate", recorded)
    out = tmp_path / command
    assert main([command, "--output_dir", str(out), "--max_steps", "2"]) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(math.isfinite(r["loss"]) for r in steps), steps
    assert (out / "model.safetensors").is_file()
    if command == "grpo":  # the default generator on CUDA, its own decoding loop, ran
        assert calls and all(c["path"] == "static" for c in calls), calls
