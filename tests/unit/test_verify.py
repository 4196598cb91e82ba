"""`fusedalign verify` without launching anything: its flags, its plan, the comparison and its
tolerances, the exit codes, and that the self-test's injections undo themselves."""

from __future__ import annotations

import math

import pytest
import torch

from fusedalign.cli import main
from fusedalign.errors import CLIError
from fusedalign.verify.compare import TOLERANCES, Comparison, compare_steps, compare_weights, tolerance_for
from fusedalign.verify.plan import REPO_CPU_CONFIGS, parse_options, plan

STEPS = [{"loss": 0.69, "grad_norm": 2.0, "rewards/margins": 0.0}, {"loss": 0.65, "grad_norm": 1.5, "rewards/margins": 0.2}]
FP32 = TOLERANCES["float32"]


def _steps(**changes) -> list[dict[str, float]]:
    out = [dict(step) for step in STEPS]
    for key, (index, value) in changes.items():
        out[index][key.replace("__", "/")] = value
    return out


def test_same_values_agree_and_report_zero():
    cmp = Comparison("run")
    compare_steps(cmp, _steps(), STEPS, FP32)
    assert cmp.agrees and cmp.kinds["loss"].value == 0.0


@pytest.mark.parametrize("changes,first", [
    ({"loss": (1, 0.65 * (1 + 2e-4))}, "loss at step 2"),
    ({"grad_norm": (0, 2.0 * 1.01)}, "grad_norm at step 1"),
    ({"rewards__margins": (0, 1e-3)}, "rewards/margins at step 1"),  # 0 in the oracle: relative to the run's scale
    ({"loss": (0, math.nan)}, "loss at step 1"),
])
def test_the_first_value_out_of_tolerance_is_named(changes, first):
    cmp = Comparison("run")
    compare_steps(cmp, _steps(**changes), STEPS, FP32)
    assert not cmp.agrees and cmp.first.startswith(first), cmp.first


def test_rounding_within_tolerance_agrees():
    cmp = Comparison("run")
    compare_steps(cmp, _steps(loss=(1, 0.65 * (1 + 5e-6)), rewards__margins=(0, 1e-9)), STEPS, FP32)
    assert cmp.agrees and 0 < cmp.kinds["loss"].value < FP32.values


def test_metrics_have_a_looser_tolerance_than_the_loss():
    """Metrics such as DPO's rewards are small differences of large sums: their rounding is larger."""
    cmp = Comparison("run")
    compare_steps(cmp, _steps(rewards__margins=(1, 0.2 * (1 + 5e-4))), STEPS, FP32)
    assert cmp.agrees and cmp.kinds["metrics"].value == pytest.approx(5e-4, rel=1e-3)
    cmp = Comparison("run")
    compare_steps(cmp, _steps(loss=(1, 0.65 * (1 + 5e-4))), STEPS, FP32)
    assert cmp.first.startswith("loss at step 2")


def test_a_value_logged_by_one_side_only_disagrees():
    got = _steps()
    del got[1]["grad_norm"]
    cmp = Comparison("run")
    compare_steps(cmp, got, STEPS, FP32)
    assert cmp.first == "grad_norm at step 2: logged by the oracle only"
    cmp = Comparison("run")
    compare_steps(cmp, STEPS[:1], STEPS, FP32)
    assert cmp.first == "logged 1 steps, the oracle 2"


def test_a_value_logged_at_some_steps_only_is_compared_where_logged():
    """GRPO with num_iterations 2 logs its completion metrics at the steps that generate only."""
    want = [{"loss": 0.69, "completions/clipped_ratio": 0.5}, {"loss": 0.65}, {"loss": 0.6, "completions/clipped_ratio": 1.0}]
    cmp = Comparison("run")
    compare_steps(cmp, [dict(step) for step in want], want, FP32)
    assert cmp.agrees, cmp.first
    got = [dict(step) for step in want]
    got[2]["completions/clipped_ratio"] = 0.75
    cmp = Comparison("run")
    compare_steps(cmp, got, want, FP32)
    assert cmp.first.startswith("completions/clipped_ratio at step 3"), cmp.first
    got = [dict(step) for step in want]
    got[1]["completions/clipped_ratio"] = 0.5
    cmp = Comparison("run")
    compare_steps(cmp, got, want, FP32)
    assert cmp.first == "completions/clipped_ratio at step 2: logged by this run only"


def test_weights_are_compared_relative_to_the_oracles_update():
    torch.manual_seed(0)
    initial = {"a": torch.randn(8, 4, dtype=torch.float64), "head": torch.randn(16, 4, dtype=torch.float64)}
    update = {k: 0.01 * torch.randn_like(v) for k, v in initial.items()}
    want = {k: initial[k] + update[k] for k in initial}
    close = {k: v + 1e-6 * update[k] for k, v in want.items()}
    cmp = Comparison("run")
    compare_weights(cmp, close, want, initial, FP32)
    assert cmp.agrees and cmp.kinds["weights"].value == pytest.approx(1e-6, rel=1e-3)
    no_head_gradient = {**want, "head": initial["head"]}
    cmp = Comparison("run")
    compare_weights(cmp, no_head_gradient, want, initial, FP32)
    assert cmp.first.startswith("final weights, head: rel 1.0e+00"), cmp.first
    cmp = Comparison("run")
    compare_weights(cmp, {"a": want["a"]}, want, initial, FP32)
    assert cmp.first == "weights: head saved by the oracle only"


def test_low_precision_runs_get_the_loose_tolerance():
    assert tolerance_for({"dtype": "float32", "mixed_precision": "bf16"})[0] == "bfloat16"
    assert tolerance_for({"dtype": "bfloat16", "mixed_precision": "no"})[0] == "bfloat16"
    assert tolerance_for({"dtype": "float32", "mixed_precision": "no"})[0] == "float32"
    assert TOLERANCES["bfloat16"].values > TOLERANCES["float32"].values


def test_verify_flags_are_split_from_the_trainers():
    options = parse_options(["dpo", "--beta", "0.2", "--backends", "ddp", "zero3", "--num_processes", "2",
                             "--verify_steps", "4", "--learning_rate", "1e-5", "--verify_learning_rate=0.05"])
    assert options.argv == ["--beta", "0.2", "--learning_rate", "1e-5"]
    assert [label for label, _ in options.configs] == ["ddp", "zero3"]
    assert (options.num_processes, options.steps, options.learning_rate) == (2, 4, 0.05)


def test_the_plan_gives_the_oracle_the_whole_global_batch():
    options = parse_options(["grpo", "--per_device_train_batch_size", "4", "--num_generations", "4",
                             "--gradient_accumulation_steps", "2", "--config_file", str(REPO_CPU_CONFIGS / "fsdp2.yaml")])
    single, fsdp2 = plan(options)
    oracle, fused = single.runs
    flags = lambda run: dict(zip(run["overrides"][::2], run["overrides"][1::2]))  # noqa: E731
    assert flags(oracle)["--per_device_train_batch_size"] == "8" and flags(oracle)["--fused_head"] == "false"
    assert flags(oracle)["--dtype"] == "float32" and flags(fused)["--fused_head"] == "true"
    assert [flags(run)["--fused_head"] for run in fsdp2.runs] == ["true", "false"]
    assert all("--per_device_train_batch_size" not in run["overrides"] for run in fsdp2.runs)
    assert all(flags(run)["--keyed_sampling"] == "true" and flags(run)["--optim"] == "sgd" for run in fsdp2.runs)
    assert fsdp2.num_processes == 2 and fsdp2.runs[0]["distributed_type"] == "DistributedType.FSDP"
    assert oracle["rows"] == 4 * 2 * 2 * 3


@pytest.mark.parametrize("argv,message", [
    (["verify", "ppo"], "unknown trainer 'ppo'"),
    (["verify"], "expected a trainer first"),
    (["verify", "dpo", "--config_file", "missing.yaml"], "--config_file missing.yaml: no such file."),
    (["verify", "dpo", "--backends", "zero4"], "--backends zero4: unknown backend"),
    (["verify", "dpo", "--verify_steps", "0"], "--verify_steps 0: expected a positive int."),
    (["verify", "dpo", "--beta", "x"], "--beta"),
])
def test_bad_input_is_one_line_and_exit_2(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


def test_a_multi_node_config_is_refused(tmp_path):
    config = tmp_path / "nodes.yaml"
    config.write_text("distributed_type: MULTI_GPU\nnum_machines: 2\nnum_processes: 16\nuse_cpu: true\n")
    with pytest.raises(CLIError, match="2 machines; verify launches on this machine only"):
        parse_options(["dpo", "--config_file", str(config)])


def test_verify_started_by_a_launcher_is_refused(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["verify", "sft"]) == 2
    assert "not under accelerate launch" in capsys.readouterr().err


def test_a_gpu_config_without_a_gpu_is_refused(capsys):
    if torch.cuda.is_available():
        pytest.skip("a machine with a GPU runs it")
    with pytest.raises(CLIError, match="is a GPU config .* use .*cpu/zero3.yaml"):
        parse_options(["dpo", "--config_file", str(REPO_CPU_CONFIGS.parent / "zero3.yaml")])


def test_help_lists_every_trainer_verify_accepts(capsys):
    from fusedalign.cli.commands import TRAINING_COMMANDS

    assert main(["verify", "--help"]) == 0
    assert f"Trains a few steps of TRAINER ({', '.join(TRAINING_COMMANDS)})" in capsys.readouterr().out
    assert main(["verify", "ppo"]) == 2
    assert f"expected one of {', '.join(TRAINING_COMMANDS)}." in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["distillation", "--dataset_name", "{tmp}/bad.jsonl", "--teacher_model_name_or_path", "builtin:tiny-zen-teacher"],
     "bad.jsonl, line 2, column 12: not valid JSON"),
    (["grpo", "--model_name_or_path", "builtin:tiny-qwen2", "--dataset_name", "{tmp}/text.jsonl"],
     "missing column(s) ['prompt']"),
    (["sft", "--dataset_name", "{tmp}/nowhere.jsonl"], "nowhere.jsonl' does not exist"),
    (["distillation", "--teacher_model_name_or_path", "{tmp}/noteacher"],
     "--teacher_model_name_or_path: model path"),
    (["rloo", "--reward_funcs", "nosuch.fn"], "--reward_funcs 'nosuch.fn': cannot import module 'nosuch'"),
    (["rloo", "--model_name_or_path", "builtin:tiny-qwen2"], "--dataset_name is required with --model_name_or_path"),
])
def test_bad_input_is_one_line_and_exit_2_before_any_run_starts(argv, message, tmp_path, monkeypatch, capsys):
    """A typo is not a parity failure: exit 2, not a CRASHED oracle and exit 1."""
    import fusedalign.verify.command as command

    monkeypatch.setattr(command, "run_plan", lambda *args: pytest.fail("a run was started"))
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a"}\n{"prompt": \n')
    (tmp_path / "text.jsonl").write_text('{"text": "a"}\n')
    assert main(["verify", *[a.replace("{tmp}", str(tmp_path)) for a in argv]]) == 2
    err = capsys.readouterr().err
    said = [line for line in err.splitlines() if "error:" in line]
    assert said == [err.strip().splitlines()[-1]] and said[0].startswith("fusedalign verify: error: "), err
    assert message in said[0] and "CRASHED" not in err and "Traceback" not in err, err


@pytest.mark.parametrize("agree,code", [(True, 0), (False, 1)])
def test_exit_code_is_0_only_when_every_run_agrees(monkeypatch, capsys, agree, code):
    import fusedalign.verify.command as command
    import fusedalign.verify.plan as verify_plan
    from fusedalign.verify.plan import Launch

    runs = [{"label": "oracle: 1 process, unfused, float32", "name": "oracle"}]
    monkeypatch.setattr(verify_plan, "plan", lambda options: [Launch("1 process", None, 1, runs)])
    monkeypatch.setattr(verify_plan, "check_inputs", lambda launches: None)
    good, bad = Comparison("zero3 fused"), Comparison("fsdp2 fused", first="loss at step 2: 1 vs oracle 2")
    monkeypatch.setattr(command, "run_plan", lambda launches, workdir: [({}, good)] + ([] if agree else [({}, bad)]))
    assert main(["verify", "sft"]) == code
    out, err = capsys.readouterr()
    assert out.count("\n| ") == (2 if agree else 3)
    assert ("fsdp2 fused: DIFFERS: loss at step 2" in err) == (not agree)


def test_injections_undo_themselves():
    import fusedalign.architectures as architectures
    import fusedalign.head as head
    import fusedalign.head_forward as head_forward
    from fusedalign.trainers.base import FusedAlignTrainer
    from fusedalign.verify.inject import INJECTIONS, injected

    def patched():
        return (head.fused_head, head_forward.LowRank, FusedAlignTrainer.compute_loss,
                dict(architectures.POST_PROCESSING))

    before = patched()
    for name in INJECTIONS:
        with injected(name):
            assert patched() != before, name
        assert patched() == before, name
