"""`fusedalign verify` on CPU: the issue's proof (sft, dpo, kto, and grpo, rloo and distillation with
keyed sampling, on DDP, ZeRO-2, ZeRO-3 and FSDP2, 2 processes each) and its self-test (every injected
bug caught).

The six trainers' runs share launches (one process for the oracles and the one-process
fused runs, then one launch per backend): 5 launches of tiny runs, 2 SGD steps each.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from fusedalign.verify.command import run_plan
from fusedalign.verify.plan import BACKENDS, backend_config, merged, parse_options, plan

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

DATA = ["--model_name_or_path", "builtin:tiny-qwen2", "--dataset_name", "builtin:zen", "--per_device_train_batch_size", "2"]
TRAINERS = {
    "sft": [*DATA, "--dataset_config", "standard_language_modeling", "--max_length", "32"],
    "dpo": [*DATA, "--dataset_config", "standard_preference", "--max_length", "48", "--max_prompt_length", "24"],
    "kto": [*DATA, "--dataset_config", "standard_unpaired_preference", "--max_length", "48", "--max_prompt_length", "24"],
    # Two optimizer steps a generation: step 2 logs no completion metrics, in any run.
    "grpo": [*DATA, "--dataset_config", "standard_prompt_only", "--num_generations", "2", "--max_completion_length", "8",
             "--reward_funcs", "zen_words", "--num_iterations", "2"],
    "rloo": [*DATA, "--dataset_config", "standard_prompt_only", "--num_generations", "2", "--max_completion_length", "8",
             "--reward_funcs", "zen_words"],
    "distillation": [*DATA, "--dataset_config", "standard_prompt_only", "--max_completion_length", "8",
                     "--teacher_model_name_or_path", "builtin:tiny-zen-teacher"],
}
GENERATING = ("grpo", "rloo", "distillation")


def test_every_trainer_agrees_on_every_backend(tmp_path):
    user_outputs = tmp_path / "users_output_dir"
    plans = [plan(parse_options([trainer, *argv, "--backends", *BACKENDS, "--verify_steps", "2",
                                 "--output_dir", str(user_outputs / trainer)]), f"{trainer}_")
             for trainer, argv in TRAINERS.items()]
    launches = merged(plans)
    assert [launch.config for launch in launches] == [None, *(backend_config(b) for b in BACKENDS)]
    results = run_plan(launches, str(tmp_path))
    # Per trainer: one process fused, and fused + unfused on each backend, each against its oracle.
    assert len(results) == len(TRAINERS) * (1 + 2 * len(BACKENDS))
    for run, cmp in results:
        assert cmp.agrees, (run["name"], cmp.crashed, cmp.first)
        assert "keyed_sampling" in " ".join(run["overrides"]) or run["trainer"] not in GENERATING
    assert not user_outputs.exists()  # every run wrote in its own directory only
    # Not vacuous: the runs checked their backend (check_run), and the oracles trained.
    for trainer in TRAINERS:
        from fusedalign.verify.compare import load_weights

        initial = load_weights(str(tmp_path / f"{trainer}_oracle" / "initial"))
        final = load_weights(str(tmp_path / f"{trainer}_oracle" / "model"))
        assert any(not (final[k] - initial[k]).abs().max() < 1e-4 for k in final), f"{trainer}: weights did not move"


def test_self_test_catches_every_injection(tmp_path):
    # Run where a default --output_dir (outputs/sft) would land: verify must write nothing there.
    proc = subprocess.run([sys.executable, "-m", "fusedalign", "verify", "--self_test"], cwd=str(tmp_path),
                          capture_output=True, text=True, timeout=1200)
    assert not any(tmp_path.iterdir()), sorted(tmp_path.iterdir())
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ") and "injection" not in line]
    assert [row.split(" | ")[0][2:] for row in rows] == ["head_by_attribute", "per_micro_batch", "softcap_dropped",
                                                        "lora_head_no_grad"]
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split(" | ")]
        assert cells[2] == "agrees" and cells[3].startswith(("DIFFERS", "CRASHED")) and cells[4] == "yes", row
