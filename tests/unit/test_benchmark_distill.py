"""benchmarks/e2e_distill.py on the CPU: the teacher shares the student's vocabulary and
tokenizer, a worker trains ours on completions of the stated lengths, and the table sets
each configuration against TRL's completions/s and peak memory."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks import e2e_distill  # noqa: E402
from benchmarks.builders import distill  # noqa: E402
from benchmarks.harness import rollout  # noqa: E402
from benchmarks.builders.model import QWEN05B, QWEN15B, model_config  # noqa: E402


def test_teacher_shape_is_larger_with_the_students_vocabulary():
    assert QWEN15B["vocab_size"] == QWEN05B["vocab_size"]
    for tiny in (False, True):
        student, teacher = model_config(tiny), model_config(tiny, shape="1.5b")
        assert teacher.vocab_size == student.vocab_size and teacher.tie_word_embeddings
        assert teacher.hidden_size > student.hidden_size and teacher.num_hidden_layers > student.num_hidden_layers


def test_table_sets_speed_and_memory_against_trl():
    args = e2e_distill.parse_args(["--device", "cpu", "--tiny", "--dtype", "bf16"])
    args.configs = ["trl", "ours", "ours_generate"]
    ok = dict(status="ok", median_step_s=2.0, generation_share=0.75, mean_completion_length=300.0)
    results = {"trl": {**ok, "completions_per_s": 2.0, "peak_gib": 40.0, "resident_gib": 6.0, "step_gib": 34.0},
               "ours": {**ok, "completions_per_s": 7.0, "peak_gib": 10.0, "resident_gib": 6.0, "step_gib": 4.0},
               "ours_generate": {"status": "OOM", "error": "CUDA out of memory"}}
    rows = [line for line in e2e_distill.table(args, results).splitlines() if line.startswith("| ")][1:]
    assert rows[0].split(" | ")[-3:] == ["1.00x", "1.00x", "1.00x |"]
    assert rows[1].split(" | ")[1:] == ["7.00", "2.00", "75", "25", "300", "10.0", "6.0", "4.0", "3.50x", "0.25x",
                                        "0.12x |"]
    assert "OOM: CUDA out of memory" in rows[2]
    assert args.loss_atol == 2e-2 and args.new_tokens == 16 and args.fit is not None
    assert ", no gradient checkpointing," in e2e_distill.table(args, results).splitlines()[0]
    packed = e2e_distill.parse_args(["--device", "cpu", "--tiny", "--gradient_checkpointing",
                                     "--max_tokens_per_batch", "0"])
    packed.configs = ["trl", "ours_padding_free"]
    title = e2e_distill.table(packed, results).splitlines()[0]
    assert ", gradient checkpointing, ours_padding_free in rows of one sequence," in title


def test_memory_snapshot_and_profile_take_one_more_step_each_and_need_a_gpu(capsys):
    from benchmarks import e2e_grpo

    for script in (e2e_distill, e2e_grpo):
        for flag, said in (("--memory_snapshot", "records the CUDA allocator's history"),
                           ("--profile", "lists the step's CUDA kernels")):
            with pytest.raises(SystemExit):
                script.parse_args(["--device", "cpu", "--tiny", flag])
            assert f"{flag} {said}: it needs --device cuda" in capsys.readouterr().err
        plain = script.parse_args(["--device", "cuda", "--tiny", "--timed_steps", "2"])
        recorded = script.parse_args(["--device", "cuda", "--tiny", "--timed_steps", "2", "--memory_snapshot"])
        assert recorded.total_steps == plain.total_steps + 1 == plain.warmup_steps + 3
        both = script.parse_args(["--device", "cuda", "--tiny", "--timed_steps", "2", "--memory_snapshot",
                                  "--profile"])
        assert both.total_steps == plain.total_steps + 2


def test_the_snapshot_and_the_profile_record_the_steps_after_the_timed_ones_in_turn():
    from types import SimpleNamespace

    from benchmarks.harness.profiling import MemoryPeakStep, ProfileStep
    from benchmarks.harness.rollout import step_records

    snapshot, profile = step_records(SimpleNamespace(memory_snapshot=True, profile=True), True, 5)
    assert isinstance(snapshot, MemoryPeakStep) and isinstance(profile, ProfileStep)
    assert (snapshot.step, profile.step) == (5, 6)
    snapshot, profile = step_records(SimpleNamespace(memory_snapshot=False, profile=True), True, 5)
    assert snapshot is None and profile.step == 5
    assert step_records(SimpleNamespace(memory_snapshot=True, profile=True), False, 5) == (None, None)


def test_the_on_policy_benchmarks_print_each_profiled_step_under_its_configuration():
    from benchmarks.harness.rollout import profiles

    prof = {"step_ms": 812.5, "gpu_busy_ms": 301.25, "by_kind": {"GEMM": 200.0, "attention": 101.25},
            "top": [{"kernel": "nvjet_tst_128x256", "ms": 150.0, "calls": 48},
                    {"kernel": "flex_attention_backward", "ms": 90.5, "calls": 24}]}
    texts = profiles({"ours": {"status": "ok"}, "ours_shared_prompt": {"status": "ok", "profile": prof},
                      "trl": {"status": "OOM", "profile": None}}, top=1)
    assert len(texts) == 1 and texts[0].startswith("#### the profiled step, ours_shared_prompt\n\n```\n")
    body = texts[0].splitlines()
    assert "812.5 ms wall, GPU kernels 301.2 ms; by kind: GEMM 200.0, attention 101.2;" in body[3]
    assert body[4].split() == ["150.000", "ms", "48x", "nvjet_tst_128x256"] and body[5] == "```"


@pytest.mark.slow
def test_worker_trains_ours_on_completions_of_the_stated_lengths(tmp_path):
    from benchmarks.builders.model import build_model

    student, teacher = tmp_path / "student", tmp_path / "teacher"
    build_model(str(student), tiny=True, dtype="fp32", seed=0)
    build_model(str(teacher), tiny=True, dtype="fp32", seed=1, shape="1.5b")
    result = tmp_path / "ours.json"
    rc = e2e_distill.main(["--device", "cpu", "--tiny", "--worker", "ours", "--timed_steps", "1",
                           "--model_dir", str(student), "--teacher_dir", str(teacher), "--result", str(result)])
    r = json.loads(result.read_text())
    assert rc == 0 and r["status"] == "ok", r
    assert len(r["logs"]) == 2 and all(e["loss"] > 0 for e in r["logs"])
    assert 0 < r["generation_share"] < 1 and r["completions_per_s"] > 0
    # The hook ends completions early (median 4 tokens); without it every one runs to 16.
    assert 1 <= r["mean_completion_length"] < 16
    # ours_padding_free under the smallest budget (one sequence a row: micro-batches trained in
    # parts) samples the same completions on the CPU (generate, one seed) and must train the same.
    packed = tmp_path / "packed.json"
    rc = e2e_distill.main(["--device", "cpu", "--tiny", "--worker", "ours_padding_free", "--timed_steps", "1",
                           "--max_tokens_per_batch", "0", "--model_dir", str(student), "--teacher_dir", str(teacher),
                           "--result", str(packed), "--log_parts"])
    p = json.loads(packed.read_text())
    assert rc == 0 and p["status"] == "ok", p
    for key in ("loss", "completions/mean_length", "grad_norm"):
        assert [e[key] for e in p["logs"]] == pytest.approx([e[key] for e in r["logs"]], rel=1e-4, abs=1e-6), key
    # --log_parts: each part's divergence sum and tokens; a step's sums over its tokens are its logged loss.
    parts = [json.loads(line) for line in (tmp_path / "out-ours_padding_free" / distill.PARTS_FILE).open()]
    # What the parent prints after the table: one line a step, found where the worker wrote.
    lines = distill.part_lines(rollout.output_dir(str(tmp_path), "ours_padding_free"))
    assert [line.split(" parts")[0] for line in lines] == [f"step {n}" for n in sorted({x["step"] for x in parts})]
    for step, entry in enumerate((e for e in p["logs"] if "loss" in e), start=1):
        mine = [x for x in parts if x["step"] == step]
        assert len(mine) > 1 and all(x["dtype"] == "torch.float32" for x in mine)
        assert sum(x["sum"] for x in mine) / sum(x["tokens"] for x in mine) == pytest.approx(entry["loss"], rel=1e-5)
