"""The floor of a GRPO step (benchmarks/harness/step_floor.py, benchmarks/grpo_floor.py): each part
by hand on a shape small enough to add up, its decoding equal to the decode limit's where the
two count the same work, and the script's table and errors."""

from __future__ import annotations

import pytest

from benchmarks.harness.decode_limit import Peaks, Shape, limit_tokens_per_s
from benchmarks.harness.step_floor import StepWork, step_floor

SHAPE = Shape(params=1000, layers=2, heads=4, kv_heads=2, head_dim=8, hidden=32, vocab=10, dtype_bytes=2)
PEAKS = Peaks("test", tb_per_s=1e-9, tflops=1e-9)  # 1000 bytes/s, 1000 flop/s


def test_each_part_by_hand_with_the_prompt_once_a_group():
    # 2 prompts of 3 tokens, 2 completions each of 3 tokens: 4 rows; L h d = 64, kv bytes a token 128.
    work = StepWork(prompts=2, generations=2, prompt_length=3, completion_length=3, extra_forwards=1)
    assert (work.rows, work.prompt_tokens, work.trained_tokens) == (4, 6, 18)
    # a prompt attends 1 + 2 + 3 = 6, a completion 4 + 5 + 6 = 15: 2 prompts, 4 completions
    assert work.attended == 2 * 6 + 4 * 15 == 72
    f = step_floor(SHAPE, PEAKS, work)
    assert f.prefill_s == pytest.approx(2 * 1000 * 6 / 1000)
    # step k reads the weights (2000 bytes) and 6 prompt + 4k cached tokens (128 bytes each); it does
    # 2 * 4 * 1000 flops of matmuls and 4 * 4 * (3 + k) * 64 of attention
    steps = [max((2000 + (6 + 4 * k) * 128) / 1000, (8000 + 16 * (3 + k) * 64) / 1000) for k in (1, 2)]
    assert f.decode_s == pytest.approx(sum(steps))
    forward = 2 * 1000 * 18 + 4 * 64 * 72
    assert f.training_s == pytest.approx(3 * forward / 1000)
    assert f.forwards_s == pytest.approx(forward / 1000)
    assert f.total_s == pytest.approx(f.prefill_s + sum(steps) + 4 * forward / 1000)


def test_a_copy_a_row_costs_more_and_decodes_at_the_decode_limit():
    once = StepWork(prompts=3, generations=4, prompt_length=5, completion_length=6)
    each = StepWork(prompts=3, generations=4, prompt_length=5, completion_length=6, prompt_once=False)
    assert (each.prompt_tokens, each.trained_tokens) == (60, 60 + 72)
    assert each.attended == 12 * (5 * 6 // 2 + 6 * 5 + 6 * 7 // 2)
    a, b = step_floor(SHAPE, PEAKS, once), step_floor(SHAPE, PEAKS, each)
    # (this shape's decoding is bound by its flops, which the shared prompt does not change)
    assert b.prefill_s > a.prefill_s and b.decode_s == a.decode_s and b.training_s > a.training_s
    # Where the bytes bind (flops a million times cheaper), the prompt cached once is read once.
    fast = Peaks("bandwidth-bound", tb_per_s=1e-9, tflops=1e-3)
    assert step_floor(SHAPE, fast, each).decode_s > step_floor(SHAPE, fast, once).decode_s
    assert step_floor(SHAPE, fast, each).decode_s == pytest.approx(
        sum((2000 + 12 * (5 + k) * 128) / 1000 for k in range(1, 6)), rel=1e-6)
    # The decode limit counts the same prefill and steps for rows that each carry their prompt.
    limit = limit_tokens_per_s(SHAPE, PEAKS, 5, [12] * 6)
    assert b.prefill_s + b.decode_s == pytest.approx(12 * 6 / limit, rel=1e-12)


def test_the_script_prints_the_floor_and_each_measured_steps_distance(tmp_path, capsys):
    from benchmarks import grpo_floor

    out = tmp_path / "floor.md"
    assert grpo_floor.main(["--tiny", "--gpu", "H100", "--measured", "slow=2.5", "a=b=1", "--markdown_out",
                            str(out)]) == 0
    text = out.read_text()
    assert text.strip() == capsys.readouterr().out.strip()
    shape = grpo_floor.model_shape(tiny=True)
    peaks = next(k for k in grpo_floor.KNOWN if k.name == "H100")
    floor = step_floor(shape, peaks, StepWork(64, 8, 128, 256)).total_s
    assert f"| once a group | {64 * 128 + 512 * 256:,} |" in text
    assert f"| {floor:.3f} | {512 / floor:,.0f} |" in text
    assert f"| slow | 2.50 | {floor / 2.5:.1%} | {2.5 / floor:.1f}x |" in text
    assert f"| a=b | 1.00 | {floor / 1:.1%} |" in text  # the name keeps every '=' but the last


@pytest.mark.parametrize("bad", ["10.11", "TRL=", "TRL=abc", "TRL=-1"])
def test_a_measured_step_that_is_not_name_equals_seconds_is_refused_in_one_line(bad, capsys):
    from benchmarks import grpo_floor

    with pytest.raises(SystemExit) as e:
        grpo_floor.parse_args(["--measured", bad])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == f"grpo_floor.py: error: --measured: expected NAME=SECONDS with SECONDS > 0, got {bad!r}"
