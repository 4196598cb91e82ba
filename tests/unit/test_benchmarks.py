"""The benchmarks' harness and DPO builders, and the end-to-end script's CPU smoke run.

The GPU numbers live in docs/benchmarks.md; these keep the scripts working between GPU
runs: the agreement check must void runs that differ, tables must hold one cell per
column, the configuration table must refuse options a trainer does not have, and the
real-length sampler must match the fits it is drawn from.
"""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "e2e_dpo.py"
sys.path.insert(0, str(ROOT))

from benchmarks.builders import dpo_configs, lengths  # noqa: E402
from benchmarks.builders.dpo_configs import DPORun  # noqa: E402
from benchmarks.harness import agreement, tables  # noqa: E402
from benchmarks.harness.profiling import kernel_kind  # noqa: E402
from benchmarks.harness.timing import steady  # noqa: E402


def _run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *argv], cwd=str(ROOT), capture_output=True, text=True,
                          timeout=900)


@pytest.mark.slow
def test_e2e_dpo_cpu_smoke_agrees_and_rechecks(tmp_path):
    proc = _run("--device", "cpu", "--tiny", "--configs", "ours_fused", "ours_unfused", "--log_dir", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "  agree" in proc.stdout and "COMPARISON VOID" not in proc.stdout, proc.stdout[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())["results"]["64"]
    assert {r["status"] for r in results.values()} == {"ok"}
    assert all(r["tokens_per_s"] > 0 and len(r["logs"]) == 3 for r in results.values())

    again = _run("--device", "cpu", "--recheck", str(tmp_path / "results.json"))
    assert again.returncode == 0 and "  agree" in again.stdout, again.stdout[-3000:]
    # A tolerance no difference can meet voids the comparison, and says so.
    strict = _run("--device", "cpu", "--recheck", str(tmp_path / "results.json"), "--loss_atol", "-1")
    assert strict.returncode == 1 and "COMPARISON VOID" in strict.stdout, strict.stdout[-3000:]


def _e2e_fit():
    from benchmarks.dpo_modes import fit

    return fit


@pytest.mark.parametrize("limit, start, want_probes, want", [
    (3072, 2048, [2048, 3072, 4096], (3072, 4096)),  # the prediction fits: walk up to the first OOM
    (2048, 3072, [3072, 2048], (2048, 3072)),        # the prediction does not fit: walk down
    (9999, 2048, [2048, 3072, 4096], (4096, None)),  # out of probes before an OOM: no bracket claimed
])
def test_verify_boundary_brackets_the_longest_length(monkeypatch, limit, start, want_probes, want):
    from benchmarks.dpo_modes.args import parse_args

    fit = _e2e_fit()
    calls = []

    def fake_launch(args, config, length, tag, **steps):
        calls.append(length)
        return {"status": "ok" if length <= limit else "OOM", "peak_gib": 1.0}

    monkeypatch.setattr(fit, "launch", fake_launch)
    args = parse_args(["--device", "cpu", "--tiny", "--search_step", "1024", "--verify_probes", "3"])
    out = fit.verify_boundary(args, "ours_fused", start)
    assert calls == want_probes
    assert (out["longest_fit"], out["shortest_oom"]) == want


def test_memory_fit_line_recovers_slope_and_intercept():
    from benchmarks.harness.bisect import line_fit

    slope, intercept, worst = line_fit([(4096, 10.0 + 4096e-3), (8192, 10.0 + 8192e-3), (16384, 26.384)])
    assert slope == pytest.approx(1e-3) and intercept == pytest.approx(10.0) and worst < 1e-9


def test_kernel_kinds_of_a_profile():
    assert kernel_kind("nvjet_hsh_256x128_64x4_2x1_v_bz_coopB_TNT") == "GEMM"
    assert kernel_kind("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma") == "attention"
    assert kernel_kind("bwd_chunk_kernel") == "head element-wise"
    assert kernel_kind("triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_0") == "compiled element-wise (inductor)"
    # Compiled flex attention is an inductor template kernel: attention all the same, and ours too.
    assert kernel_kind("triton_tem_fused_flex_attention_0") == "attention"
    assert kernel_kind("triton_tem_fused_flex_attention_backward_1") == "attention"
    assert kernel_kind("triton_tem_fused_addmm_0") == "GEMM"  # inductor's own matmul template
    assert kernel_kind("_grouped_decode") == "attention"
    assert kernel_kind("void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor>") == "optimizer and clipping"
    assert kernel_kind("void at::native::vectorized_elementwise_kernel<4, copy>").startswith("other")


# ------------------------------------------------------------------------------- harness


def _result(losses, chosen):
    return {"status": "ok", "logs": [{"loss": a, "logps/chosen": b} for a, b in zip(losses, chosen)]}


CHECKS = [agreement.Check("loss", 0.05), agreement.Check("logps/chosen", 2.0)]


def test_agreement_within_tolerance_agrees_and_reports_the_worst_difference():
    results = {"a": _result([0.69, 0.68, 0.70], [-100.0, -101.0, -99.0]),
               "b": _result([0.70, 0.67, 0.71], [-100.5, -101.2, -98.0])}
    found = agreement.compare(results, ["a", "b"], CHECKS)
    assert found.verdict == "agree"
    assert found.worst["loss"] == pytest.approx(0.01) and found.worst["logps/chosen"] == pytest.approx(1.0)


def test_agreement_voids_a_difference_beyond_tolerance_and_a_missing_step():
    base = _result([0.69, 0.68, 0.70], [-100.0, -101.0, -99.0])
    far = _result([0.69, 0.68, 0.70], [-100.0, -104.0, -99.0])  # another row at step 2
    short = _result([0.69, 0.68], [-100.0, -101.0])
    assert agreement.compare({"a": base, "b": far}, ["a", "b"], CHECKS).verdict == "void"
    found = agreement.compare({"a": base, "b": short}, ["a", "b"], CHECKS)
    assert found.verdict == "void" and any("logged 2 values" in line for line in found.lines)


def test_agreement_skips_a_stand_in_on_one_key_only():
    base = _result([0.69, 0.68, 0.70], [-100.0, -101.0, -99.0])
    liger = _result([0.72, 0.70, 0.69], [-100.1, -101.0, -99.0])  # other first loss, same tokens
    skip_loss = [agreement.Check("loss", 0.01, skip=("liger",)), agreement.Check("logps/chosen", 2.0)]
    assert agreement.compare({"a": base, "liger": liger}, ["a", "liger"], skip_loss).verdict == "agree"
    held = [agreement.Check("loss", 0.01)]
    assert agreement.compare({"a": base, "liger": liger}, ["a", "liger"], held).verdict == "void"


def test_agreement_needs_two_runs_that_ran():
    results = {"a": _result([0.69], [-1.0]), "b": {"status": "OOM"}}
    assert agreement.compare(results, ["a", "b", "c"], CHECKS).verdict == "incomplete"


def test_markdown_table_aligns_numbers_and_refuses_ragged_rows():
    text = tables.markdown(["config", "tok/s"], [["ours", "1,000"], ["trl", "900"]], numeric={1})
    assert text.splitlines() == ["| config | tok/s |", "|---|---:|", "| ours | 1,000 |", "| trl | 900 |"]
    with pytest.raises(ValueError, match="2 cells for 3 columns"):
        tables.markdown(["a", "b", "c"], [["x", "y"]])
    assert tables.ratio(3.0, 2.0) == "1.50x" and tables.ratio(None, 2.0) == "—" and tables.fmt(None, ".1f") == "—"


def test_steady_takes_the_timed_steps_only():
    begin, end = [0.0, 10.0, 11.0, 12.5], [5.0, 10.5, 12.0, 13.0]  # step 0 (warm-up) is slow
    out = steady(begin, end, warmup=1, timed=3)
    assert out["step_times"] == [0.5, 1.0, 0.5] and out["median_step_s"] == 0.5 and out["total_step_s"] == 2.0
    with pytest.raises(RuntimeError, match="expected at least 5 steps"):
        steady(begin, end, warmup=1, timed=4)


# ----------------------------------------------------------------------- configurations


def test_configuration_names_cited_in_docs_keep_their_options():
    fixed = dpo_configs.FIXED
    assert list(fixed) == ["ours_fused", "ours_fused_liger", "ours_fused_compile", "ours_fused_compile_liger",
                           "ours_fused_compile_pertoken", "ours_unfused", "trl", "trl_liger"]
    pertoken = fixed["ours_fused_compile_pertoken"]
    assert pertoken.compile_layers and not pertoken.loss_aware_head
    assert not fixed["ours_unfused"].fused_head and fixed["trl_liger"].liger_layers and fixed["trl"].is_trl
    assert {c for c, r in fixed.items() if r.checked} == {"ours_fused", "ours_fused_compile",
                                                           "ours_fused_compile_pertoken", "ours_unfused", "trl"}
    real = dpo_configs.REAL
    assert real["ours_shared_prompt"].share_prompt and real["ours_shared_prompt"].padding_free
    assert real["trl_liger_grouped"].order == "grouped" and real["trl_liger"].order == "random"
    for name in ("ours_padding_free_flex", "ours_shared_prompt_flex"):  # the real-length runs of record
        run = real[name]
        assert run.attn == "flex_attention" and run.pad_to_multiple_of == 1024 and run.token_budget
        assert run.share_prompt == (name == "ours_shared_prompt_flex")
    for name in ("ours_padding_free_fixed_flex", "ours_shared_prompt_fixed_flex"):  # like for like with TRL + Liger
        run = real[name]
        assert run.attn == "flex_attention" and run.pad_to_multiple_of == 1024 and not run.token_budget
        assert run.padding_free and run.share_prompt == (name == "ours_shared_prompt_fixed_flex")
    assert real["ours_padding_free_fixed_sdpa"].attn == "sdpa" and not real["ours_padding_free_fixed_sdpa"].token_budget


@pytest.mark.parametrize("options, message", [
    (dict(trainer="trl", compile_layers=True), "options of ours"),
    (dict(trainer="ours", order="grouped"), "TRL's length-grouped"),
    (dict(trainer="ours", share_prompt=True), "need padding_free"),
    (dict(trainer="ours", token_budget=True), "need padding_free"),
    (dict(trainer="deepspeed"), "trainer must be"),
    (dict(trainer="trl", attn="flex_attention"), "options of ours"),
])
def test_configuration_refuses_options_its_trainer_lacks(options, message):
    with pytest.raises(ValueError, match=message):
        DPORun("x", **options)


def test_unavailable_ours_options_are_reported_not_dropped(monkeypatch):
    from benchmarks.builders import dpo

    monkeypatch.setattr(dpo, "ours_config_fields", lambda: {"padding_free", "max_tokens_per_batch"})
    reasons = dpo.availability(list(dpo_configs.REAL.values()), "cpu")
    assert reasons["ours_padding_free"] is None and reasons["ours_padding_free_fixed"] is None
    assert reasons["ours_shared_prompt"] == "fusedalign's DPOConfig has no share_prompt yet"
    assert reasons["ours_fused_compile"] is None
    monkeypatch.setattr(dpo, "ours_config_fields", lambda: {"padding_free"})
    reasons = dpo.availability(list(dpo_configs.REAL.values()), "cpu")
    assert reasons["ours_padding_free"] == "fusedalign's DPOConfig has no max_tokens_per_batch yet"
    assert "GPU" in reasons["trl_liger"] or "trl" in reasons["trl_liger"]
    monkeypatch.undo()
    reasons = dpo.availability([dpo_configs.REAL["ours_shared_prompt_flex"]], "cpu")
    assert "CUDA only" in reasons["ours_shared_prompt_flex"]


# ------------------------------------------------------------------------ real lengths


@pytest.mark.parametrize("name", sorted(lengths.DATASETS))
def test_length_sampler_matches_the_fitted_median_and_p95(name):
    import numpy as np

    fits = lengths.DATASETS[name]
    draw = lengths.sample_pairs(fits, 200_000, seed=0, max_length=None)
    for part in ("prompt", "chosen", "rejected"):
        fit = getattr(fits, part)
        values = np.asarray(draw[part])
        assert np.median(values) == pytest.approx(fit.median, rel=0.03), part
        assert np.percentile(values, 95) == pytest.approx(fit.p95, rel=0.03), part
    assert draw["dropped"] == 0 and draw["truncated"] == 0


def test_length_sampler_truncates_as_trl_does():
    fits = lengths.DATASETS["ultrafeedback"]
    draw = lengths.sample_pairs(fits, 20_000, seed=1, max_length=256)
    p, c, r = draw["prompt"], draw["chosen"], draw["rejected"]
    assert len(p) == 20_000 and max(p) < 256  # a prompt that fills max_length drops the pair
    assert all(a + b <= 256 and a + d <= 256 for a, b, d in zip(p, c, r))
    assert draw["dropped"] > 0 and draw["truncated"] > 0
    # Same seed, same pairs: every configuration trains the same data, and a run that needs
    # more pairs (a token budget) trains the same first ones.
    assert lengths.sample_pairs(fits, 20_000, seed=1, max_length=256)["chosen"] == c
    assert lengths.sample_pairs(fits, 30_000, seed=1, max_length=256)["chosen"][:20_000] == c
    assert lengths.token_rows(draw, 100, 0)["prompt_ids"][7] == lengths.token_rows(
        {k: v[:10] for k, v in draw.items() if k in ("prompt", "chosen", "rejected")}, 100, 0)["prompt_ids"][7]


def test_log_normal_fit_and_token_counts():
    fit = lengths.LengthFit(100, 500)
    assert math.exp(fit.mu + lengths.Z95 * fit.sigma) == pytest.approx(500)
    pairs = {"prompt": [3, 5], "chosen": [2, 1], "rejected": [4, 1]}
    assert lengths.unique_tokens(pairs, [0, 1]) == 16
    assert lengths.padded_tokens(pairs, [0, 1], micro_batch=2) == 2 * 2 * 7  # 4 rows at the longest, 3 + 4
    rows = lengths.token_rows(pairs, vocab=10, seed=0)
    assert [len(x) for x in rows["chosen_ids"]] == [2, 1] and all(0 < t < 5 for t in rows["chosen_ids"][0])
    assert all(5 <= t < 10 for row in rows["rejected_ids"] for t in row)


def test_dpo_run_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        dpo_configs.FIXED["trl"].name = "x"


def test_real_length_measures_count_the_timed_steps_batches_as_collated():
    import argparse

    import torch

    from benchmarks.dpo_modes.worker import CountingCollator, real_measures

    def collate(examples):  # padded: 2 rows a pair at the longest prompt + completion
        longest = max(len(e["prompt_ids"]) + max(len(e["chosen_ids"]), len(e["rejected_ids"])) for e in examples)
        return {"input_ids": torch.zeros(2 * len(examples), longest)}

    counter = CountingCollator(collate)
    pair = lambda p, c, r: {"prompt_ids": [1] * p, "chosen_ids": [2] * c, "rejected_ids": [3] * r}  # noqa: E731
    for batch in ([pair(2, 1, 1)], [pair(3, 2, 1), pair(1, 1, 1)], [pair(1, 1, 4)], [pair(5, 5, 5)]):
        counter(batch)
    assert counter.batches == [(1, 4, 6), (2, 9, 20), (1, 6, 10), (1, 15, 20)]
    args = argparse.Namespace(warmup_steps=1, timed_steps=1, total_steps=2)
    out = real_measures(args, counter.batches, accumulation=2, stats={"total_step_s": 2.0})
    assert out["timed_pairs"] == 2 and out["unique_tokens"] == 21 and out["backbone_tokens"] == 30
    assert out["pairs_per_s"] == 1.0 and out["unique_tokens_per_s"] == 10.5
    with pytest.raises(RuntimeError, match="fewer than"):
        real_measures(argparse.Namespace(warmup_steps=1, timed_steps=2, total_steps=3), counter.batches, 2,
                      {"total_step_s": 1.0})


def test_step_clock_starts_when_the_trainer_fetches_the_steps_batches():
    # fusedalign's trainers run the reference forwards (DPO) and generation (GRPO) while the
    # Trainer fetches a step's micro-batches, before on_step_begin: the clock must see them.
    import time

    from benchmarks.harness.timing import step_timer, time_from_batch_fetch

    class Trainer:
        def get_batch_samples(self, *args):
            time.sleep(0.05)  # the step's preparation
            return [], 0

    trainer, timer = Trainer(), step_timer(lambda: None)
    time_from_batch_fetch(trainer, timer)
    trainer.get_batch_samples()
    timer.on_step_begin(None, None, None)
    timer.on_step_end(None, None, None)
    timer.on_step_begin(None, None, None)  # a step with no fetch starts here
    timer.on_step_end(None, None, None)
    assert len(timer.begin) == len(timer.end) == 2
    assert timer.end[0] - timer.begin[0] >= 0.05 > timer.end[1] - timer.begin[1]


def test_step_memory_splits_the_peak_into_the_rest_and_each_steps_rise():
    # A fake allocator: the rest grows once (the optimizer's state after the first step), each
    # step rises above its start, and the largest allocation of the run falls between two steps.
    from benchmarks.harness.step_memory import GiB, StepMemory

    state = {"now": 0, "peak": 0}

    def allocate(n):
        state["now"] += n
        state["peak"] = max(state["peak"], state["now"])

    def reset():
        state["peak"] = state["now"]

    memory = StepMemory(lambda: state["now"], lambda: state["peak"], reset)
    allocate(5 * GiB)  # the models
    plan = [(6, 2), (3, 0), (4, 0)]  # per step: its rise (GiB), then what stays after it (GiB)
    for step, (rise, stays) in enumerate(plan):
        memory.begin(step)
        allocate(rise * GiB)
        allocate(-(rise - stays) * GiB)
        memory.end(step, 1.0)
        if step == 1:
            allocate(9 * GiB)  # between steps: a checkpoint's copy, say
            allocate(-9 * GiB)
    assert [r / GiB for r in memory.rest] == [5, 7, 7] and [p / GiB for p in memory.peaks] == [11, 10, 11]
    timed = memory.summary(slice(1, 3))
    assert timed["resident_gib"] == 7 and timed["step_gib"] == 4
    assert memory.overall() == 16 * GiB  # the between-steps peak, though each step restarted the reading
    assert memory.summary(slice(3, 5)) == {}


def test_one_decoding_steps_floor_by_hand():
    """The floor of one step is the larger of its bytes over the bandwidth and its flops over the
    peak; the limit over several steps adds a prefill and those floors."""
    from benchmarks.harness.decode_limit import Peaks, Shape, limit_tokens_per_s, step_seconds

    shape = Shape(params=1000, layers=2, heads=4, kv_heads=2, head_dim=8, hidden=32, vocab=10, dtype_bytes=2)
    peaks = Peaks("test", tb_per_s=1e-9, tflops=1e-9)  # 1000 bytes/s, 1000 flop/s
    # bytes: 1000 * 2 + 3 rows * 5 tokens * (2 * 2 * 2 * 8 * 2) = 2000 + 1920; flops: 2*3*1000 + 4*3*5*2*4*8
    assert step_seconds(shape, peaks, 3, 5) == pytest.approx(max(3920 / 1000, (6000 + 3840) / 1000), rel=1e-12)
    prefill = 2 * 3 * 4 * 1000 / 1000
    want = (3 + 3) / (prefill + step_seconds(shape, peaks, 3, 5))
    assert limit_tokens_per_s(shape, peaks, 4, [3, 3]) == pytest.approx(want, rel=1e-12)


def _held_to_capture_rules(monkeypatch):
    """What decode_profile's Clock captures as a CUDA graph on a GPU runs, on the CPU, under the
    rules of a capture (tests/stand_in_graphs.py): no host read, no tensor made from host data."""
    from benchmarks import decode_profile
    from tests.stand_in_graphs import CaptureRules

    eager_ms = decode_profile.Clock.eager_ms
    captured = []

    def graph_ms(self, fn):
        with CaptureRules():
            fn()  # the recorded call
        captured.append(fn)
        return eager_ms(self, fn)

    monkeypatch.setattr(decode_profile.Clock, "graph_ms", graph_ms)
    return captured


def test_decode_profile_cpu_smoke_lists_each_part_and_the_attention_it_decoded_with(tmp_path, monkeypatch):
    from benchmarks import decode_profile

    captured = _held_to_capture_rules(monkeypatch)
    out = tmp_path / "profile.md"
    assert decode_profile.main(["--device", "cpu", "--tiny", "--repeats", "1", "--markdown_out", str(out)]) == 0
    text = out.read_text()
    assert "fusedalign_grouped_sdpa attention" in text
    for part in decode_profile.PARTS + ("step, one graph", "step, eager"):
        assert f"| {part} |" in text
    out2 = tmp_path / "transformers.md"
    decode_profile.main(["--device", "cpu", "--tiny", "--repeats", "1", "--transformers_attention",
                         "--markdown_out", str(out2)])
    assert "; sdpa attention," in out2.read_text()
    assert len(captured) >= 2 * (len(decode_profile.PARTS) + 1)  # each part and the whole step, both runs


def test_decode_profile_times_the_step_with_the_draw_in_the_head_under_capture_rules(tmp_path, monkeypatch):
    """--fused_sampling adds the whole step as StaticDecode(fused_sampling=True) runs it, held to
    the rules of a capture; filtering flags the sampling head cannot serve are refused in one line."""
    from benchmarks import decode_profile

    captured = _held_to_capture_rules(monkeypatch)
    out = tmp_path / "fused.md"
    assert decode_profile.main(["--device", "cpu", "--tiny", "--repeats", "1", "--fused_sampling",
                                "--markdown_out", str(out)]) == 0
    assert "| step, draw in the head, one graph |" in out.read_text()
    assert len(captured) == len(decode_profile.PARTS) + 2  # each part, the whole step, the fused step
    with pytest.raises(SystemExit, match="--fused_sampling: .*top-k"):
        decode_profile.main(["--device", "cpu", "--tiny", "--repeats", "1", "--fused_sampling", "--top_k", "5"])


def test_decode_profile_times_the_step_with_fused_projections_under_capture_rules(tmp_path, monkeypatch):
    """--fuse_projections adds the whole step with the fused projections installed, held to the
    rules of a capture; the model is as it was afterwards."""
    from benchmarks import decode_profile
    from fusedalign.generation import fused_projections as fp

    captured = _held_to_capture_rules(monkeypatch)
    entered = []
    real = fp.fused_projections

    def counting(model):
        entered.append(type(model).__name__)
        return real(model)

    monkeypatch.setattr(fp, "fused_projections", counting)
    out = tmp_path / "fused.md"
    assert decode_profile.main(["--device", "cpu", "--tiny", "--repeats", "1", "--fuse_projections",
                                "--markdown_out", str(out)]) == 0
    assert "| step, projections fused, one graph |" in out.read_text()
    assert entered == ["Qwen2ForCausalLM"]
    assert len(captured) == len(decode_profile.PARTS) + 2  # each part, the whole step, the fused step


def test_decode_profile_kernel_list_is_the_top_then_every_kernel_by_kind():
    # On the CPU the same function lists CPU operators: the top `count` by time, in order, then
    # each kind's total over every operator, which holds at least the top rows' time.
    import torch

    from benchmarks.decode_profile import top_kernels

    a = torch.randn(128, 128)
    rows = top_kernels(lambda: (a @ a).relu().float().sum(), 2, "cpu")
    top, kinds = rows[:2], rows[2:]
    assert [r[0].startswith("all ") for r in rows] == [False, False] + [True] * len(kinds) and kinds
    assert top[0][1] >= top[1][1] and all(n >= 1 for _, _, n in rows)
    assert sum(ms for _, ms, _ in kinds) >= sum(ms for _, ms, _ in top) - 1e-9
    assert sum(n for _, _, n in kinds) >= sum(n for _, _, n in top)


def test_decode_attention_triton_configs_add_one_row_per_launch_of_the_grid(tmp_path):
    """--triton_configs adds the kernel under each of the 27 launches (block of slots x warps x
    stages), each row named by its launch; off CUDA each says why it did not run."""
    from benchmarks import decode_attention

    out = tmp_path / "configs.md"
    assert decode_attention.main(["--device", "cpu", "--tiny", "--repeats", "1", "--batches", "3",
                                  "--variants", "grouped_sdpa", "--triton_configs", "--markdown_out", str(out)]) == 0
    rows = [line for line in out.read_text().splitlines() if line.startswith("| 3 |")]
    names = [row.split(" | ")[2] for row in rows]
    assert len(rows) == 1 + 27 and len(set(names)) == 28
    assert "triton bn32 w2 s2" in names and "triton bn128 w8 s4" in names
    assert all("RuntimeError" in row for row in rows[1:]) and "RuntimeError" not in rows[0]
    # --split_fills: the default launch split to fill N programs a multiprocessor, a row each.
    assert decode_attention.main(["--device", "cpu", "--tiny", "--repeats", "1", "--batches", "3",
                                  "--variants", "grouped_sdpa", "--split_fills", "8", "16",
                                  "--markdown_out", str(out)]) == 0
    rows = [line for line in out.read_text().splitlines() if line.startswith("| 3 |")]
    assert [row.split(" | ")[2] for row in rows] == ["grouped_sdpa", "triton fill8", "triton fill16"]
    assert all("RuntimeError" in row for row in rows[1:])


def test_decode_attention_cpu_smoke_times_every_variant_and_checks_it_against_float32(tmp_path, monkeypatch):
    """Each variant's row holds its time and its error against float32 arithmetic, which is
    small for every variant the CPU runs; flex attention's row says why it did not run."""
    from benchmarks import decode_attention

    captured = _held_to_capture_rules(monkeypatch)
    out = tmp_path / "attention.md"
    assert decode_attention.main(["--device", "cpu", "--tiny", "--repeats", "1", "--batches", "3",
                                  "--slots", "12", "20", "--markdown_out", str(out)]) == 0
    rows = [line.split("|")[1:-1] for line in out.read_text().splitlines() if line.startswith("| 3 |")]
    assert len(rows) == 2 * len(decode_attention.VARIANTS)
    for batch, slots, variant, ms, read_mb, rate, error, step_ms in (map(str.strip, r) for r in rows):
        if variant in ("flex_compiled", "triton_grouped", "triton_loads_masked"):
            assert (ms, error) == ("—", "RuntimeError")
            continue
        assert float(ms) > 0 and float(error) < 1e-5, (variant, slots, ms, error)
    assert captured  # the variants were timed as captured graphs


def test_decode_attention_step_like_calls_each_layers_cache_once_a_step(tmp_path, monkeypatch):
    """--step_like: one timed graph calls the variant once on each of --layers distinct caches
    (no layer finds another's keys in the L2 cache), every row seeing the first --written slots;
    the time reported is a layer's."""
    from benchmarks import decode_attention

    seen = []
    real = decode_attention.variants

    def spying(names, device, triton_configs=False, split_fills=()):
        fns = real(names, device, triton_configs, split_fills)
        return {name: (lambda q, k, v, visible, additive, fn=fn: seen.append((k.data_ptr(), visible.clone()))
                       or fn(q, k, v, visible, additive)) for name, fn in fns.items()}

    monkeypatch.setattr(decode_attention, "variants", spying)
    clock_calls = []
    monkeypatch.setattr(decode_attention.Clock, "graph_ms", lambda self, fn: clock_calls.append(fn()) or 6.0)
    out = tmp_path / "step.md"
    assert decode_attention.main(["--device", "cpu", "--tiny", "--repeats", "1", "--batches", "3", "--slots", "12",
                                  "--variants", "matmul", "--step_like", "--layers", "3", "--written", "5",
                                  "--markdown_out", str(out)]) == 0
    timed = seen[1:]  # the first call checks the error on the first layer's cache
    assert len(clock_calls) == 1 and len(timed) == 3 and len({ptr for ptr, _ in timed}) == 3
    assert all(v.sum(1).tolist() == [5, 5, 5] and v[:, :5].all() for _, v in timed)
    row = [line.split("|")[1:-1] for line in out.read_text().splitlines() if line.startswith("| 3 |")][0]
    assert float(row[3]) == 2.0  # 6 ms for the graph of 3 layers


def test_generation_benchmark_hands_its_compaction_share_to_static_decode(tmp_path):
    """`--compact_below` reaches StaticDecode: with completions of log-normal lengths, 0.9
    compacts the batch as rows finish, 0 never does."""
    import json

    from benchmarks import generation

    sizes = {}
    for share in ("0.9", "0"):
        out = tmp_path / share
        assert generation.main(["--device", "cpu", "--tiny", "--methods", "ours", "--batches", "8", "--repeats", "1",
                                "--new_tokens", "64", "--completion_lengths", "lognormal:20:60",
                                "--compact_below", share, "--log_dir", str(out),
                                "--markdown_out", str(out / "table.md")]) == 0
        result = json.loads((out / "results.json").read_text())["results"]["ours"]
        sizes[share] = result["batches"]["8"]["last_call"]["batch_sizes"]
        assert f"compacting at {float(share):g} of the rows live" in (out / "table.md").read_text()
    assert len(sizes["0.9"]) >= 2 and sizes["0.9"][0] == 8 and sizes["0"] == [8], sizes



def test_grpo_checkpoint_offload_reaches_both_trainers_arguments_and_is_refused_without_a_gpu(monkeypatch, capsys):
    from benchmarks import e2e_grpo
    from benchmarks.builders import grpo

    assert "needs a GPU" in grpo.offload_unavailable("cpu")  # transformers 5.25 has it; a CPU cannot pin memory
    with pytest.raises(SystemExit):
        e2e_grpo.parse_args(["--device", "cpu", "--tiny", "--checkpoint_offload"])
    assert "--checkpoint_offload: checkpoint offload pins host memory" in capsys.readouterr().err
    monkeypatch.setattr(grpo, "offload_unavailable", lambda device: None)
    args = e2e_grpo.parse_args(["--device", "cpu", "--tiny", "--checkpoint_offload"])
    assert args.gradient_checkpointing
    kwargs = grpo.grpo_args(args, "/tmp/x")  # the same arguments build TRL's config and ours
    assert kwargs["gradient_checkpointing"] and kwargs["gradient_checkpointing_kwargs"] == {
        "use_reentrant": False, "offload": True}
    assert grpo.checkpointing_words(args) == "gradient checkpointing on, its layers' inputs in host memory"
    plain = e2e_grpo.parse_args(["--device", "cpu", "--tiny"])
    assert "gradient_checkpointing_kwargs" not in grpo.grpo_args(plain, "/tmp/x")
    assert grpo.checkpointing_words(plain) == "gradient checkpointing off"


def test_grpo_ours_fast_gives_every_decoding_lever_to_the_loop(tmp_path):
    """`ours_fast` builds our trainer with the compiled step, the draw in the head and the Triton
    kernel in its StaticDecode; off CUDA the configuration says why it cannot run (the kernel)."""
    import dataclasses

    from benchmarks import e2e_grpo
    from benchmarks.builders import grpo
    from benchmarks.builders.model import build_model
    from transformers import TrainerCallback

    from fusedalign.generation import StaticDecode
    from fusedalign.models import load_tokenizer

    assert grpo.availability("cpu")["ours_fast"] == "CUDA only (the Triton decode kernel)"
    build_model(str(tmp_path / "m"), tiny=True, dtype="fp32", seed=0)
    args = e2e_grpo.parse_args(["--device", "cpu", "--tiny", "--model_dir", str(tmp_path / "m")])
    args.draw = None
    # The kernel needs CUDA; the rest of the configuration builds here as it would there.
    run = dataclasses.replace(grpo.RUNS["ours_fast"], decode_kernel="sdpa")
    trainer = grpo.build_ours(run, args, str(tmp_path / "out"), [[5, 6, 7]] * 16,
                              load_tokenizer("builtin:tiny-qwen2"), TrainerCallback(), None, lambda **kw: [0.0])
    decode = trainer.generator
    assert isinstance(decode, StaticDecode) and decode.fused_sampling is True and decode.compile_step is True
    assert grpo.RUNS["ours_fast"].decode_kernel == "triton" and grpo.RUNS["ours_fast"].compile_generation
    # The fastest step measured: compiled, the kernel, the draw from the logits (not in the head).
    fastest = grpo.RUNS["ours_compiled_triton"]
    assert (fastest.compile_generation, fastest.decode_kernel, fastest.fused_sampling) == (True, "triton", False)
    assert grpo.availability("cpu")["ours_compiled_triton"] == "CUDA only (the Triton decode kernel)"
    # The same with the fused projections: they reach the trainer's StaticDecode.
    fused = grpo.RUNS["ours_compiled_triton_fused_projections"]
    assert dataclasses.replace(fused, fuse_projections=False) == dataclasses.replace(
        fastest, name=fused.name, about=fused.about)
    trainer = grpo.build_ours(dataclasses.replace(fused, decode_kernel="sdpa"), args, str(tmp_path / "out2"),
                              [[5, 6, 7]] * 16, load_tokenizer("builtin:tiny-qwen2"), TrainerCallback(), None,
                              lambda **kw: [0.0])
    assert trainer.generator.fuse_projections is True and trainer.generator.compile_step is True
    # ours_fastest: the same decoding levers by the default kernel choice, and the layers compiled.
    best = grpo.RUNS["ours_fastest"]
    assert dataclasses.replace(best, compile_layers=False, decode_kernel="triton") == dataclasses.replace(
        fused, name=best.name, about=best.about)
    assert grpo.availability("cpu")["ours_fastest"] is None  # "auto" is the grouped sdpa off CUDA
    trainer = grpo.build_ours(best, args, str(tmp_path / "out3"), [[5, 6, 7]] * 16,
                              load_tokenizer("builtin:tiny-qwen2"), TrainerCallback(), None, lambda **kw: [0.0])
    assert trainer.args.compile_layers is True and trainer.generator.decode_kernel == "auto"
    from fusedalign.backbone import decoder_layers

    assert [layer._fusedalign_compiled for layer in decoder_layers(trainer.model)] == [True, True]
    assert trainer.generator.fuse_projections is True and trainer.generator.compile_step is True


def test_packed_attention_cpu_smoke_agrees_across_layouts(tmp_path):
    """Every variant's row holds its time and its largest difference from flex_repeat's output on
    the same tokens: tiny for flex with enable_gqa and for the padded layout (each completion
    seeing its own prompt copy), so the packed row's mask keeps exactly each completion's
    prompt and itself. Flex attention's backward does not run on the CPU: its column says so."""
    from benchmarks import packed_attention

    out = tmp_path / "packed.md"
    assert packed_attention.main(["--device", "cpu", "--tiny", "--repeats", "1", "--warmup", "1",
                                  "--groups", "1", "3", "--markdown_out", str(out)]) == 0
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in out.read_text().splitlines()
            if line.startswith("| 1 |") or line.startswith("| 3 |")]
    assert [(r[0], r[3]) for r in rows] == [(g, v) for g in "13" for v in packed_attention.VARIANTS]
    for groups, tokens, padded, variant, forward, both, diff in rows:
        assert float(forward) > 0 and float(diff) < 1e-5, (groups, variant, diff)
        assert (both == "—") == variant.startswith("flex"), (variant, both)
        assert int(tokens.replace(",", "")) == int(groups) * (8 + 3 * 16)
        assert int(padded.replace(",", "")) == int(groups) * 3 * (8 + 16)


def test_a_profiles_host_side_counts_its_waits_for_the_gpu_and_its_launches():
    """Read-backs and synchronisations are summed by name (the GPU idles behind each), launches
    counted apart, operators ranked by their own host time; kernels (CUDA events) are left out."""
    from types import SimpleNamespace

    from benchmarks.harness.profiling import format_profile, host_side

    def event(key, device, count, cpu_us):
        return SimpleNamespace(key=key, device_type=SimpleNamespace(name=device), count=count,
                               self_cpu_time_total=cpu_us, self_device_time_total=0)

    events = [event("cudaStreamSynchronize", "CPU", 24, 300_000.0),
              event("aten::_local_scalar_dense", "CPU", 48, 2_000.0),
              event("cudaLaunchKernel", "CPU", 9000, 45_000.0), event("aten::mm", "CPU", 500, 9_000.0),
              event("aten::add", "CPU", 700, 12_000.0), event("aten::nonzero", "CPU", 3, 600.0),
              event("nvjet_gemm", "CUDA", 500, 0.0)]
    host = host_side(events)
    assert host["waits"] == [{"call": "cudaStreamSynchronize", "calls": 24, "ms": 300.0},
                             {"call": "aten::_local_scalar_dense", "calls": 48, "ms": 2.0},
                             {"call": "aten::nonzero", "calls": 3, "ms": 0.6}]
    assert host["launches"] == {"calls": 9000, "ms": 45.0}
    assert [r["op"] for r in host["top_ops"]] == ["aten::add", "aten::mm", "aten::_local_scalar_dense", "aten::nonzero"]
    lines = format_profile({"step_ms": 1.0, "gpu_busy_ms": 0.5, "by_kind": {}, "top": [], "host": host})
    assert "9000 kernel launches (45.0 ms)" in lines[1] and "cudaStreamSynchronize 24x 300.0 ms" in lines[1]
    assert len(lines) == 2 + 4


def test_layer_saved_bytes_counts_what_a_layer_saves_a_token_by_hand():
    """One tiny Qwen2 layer on a row of 64 then 128 tokens (sdpa, CPU): a token costs, in float32, each
    RMSNorm's input (2 x hidden x 4 B), their two rsqrt values and the attention's log-sum-exp (one a
    head); tiling the MLP over 16-token tiles keeps out exactly its four bf16 intermediates a token
    (gate, up, SiLU(gate) and the product), and the weights are not counted."""
    from benchmarks import layer_saved_bytes
    from benchmarks.builders.model import TINY

    args = layer_saved_bytes.parse_args(["--tiny", "--lengths", "64", "128", "--modes", "eager", "tiled",
                                         "--tiled_mlp_tokens", "16"])
    got = layer_saved_bytes.measure(args)
    (eager_at, eager, eager32), (tiled_at, tiled, tiled32) = got["eager"], got["tiled"]
    hidden, inter, heads = TINY["hidden_size"], TINY["intermediate_size"], TINY["num_attention_heads"]
    assert eager32 == tiled32 == 2 * hidden * 4 + 2 * 4 + heads * 4
    assert eager - tiled == 4 * inter * 2
    # Nothing that does not grow with the row: the bytes at each length are the slope times it.
    assert eager_at == {64: eager * 64, 128: eager * 128} and tiled_at == {64: tiled * 64, 128: tiled * 128}


def test_layer_saved_bytes_needs_two_lengths(capsys):
    from benchmarks import layer_saved_bytes

    with pytest.raises(SystemExit):
        layer_saved_bytes.parse_args(["--lengths", "2048", "2048"])
    assert capsys.readouterr().err.strip().endswith(
        "--lengths: expected two or more different positive lengths, got [2048, 2048]")
