"""benchmarks/generation.py's table: its ratios are against generate as TRL runs it."""

from benchmarks import generation


def _ran(tokens_per_s: float) -> dict:
    return {"status": "ok", "batches": {"4": {"tokens_per_s": tokens_per_s, "new_tokens": [32], "expected": 32,
                                              "peak_gib": None, "times_s": [0.5], "first_call_s": 1.0}}}


def _row(text: str, method: str) -> list[str]:
    line = next(line for line in text.splitlines() if line.startswith(f"| 4 | {method} |"))
    return [cell.strip() for cell in line.strip("|").split("|")]


def test_ratios_are_against_dynamic_eos_where_it_ran():
    args = generation.parse_args(["--device", "cpu", "--tiny", "--batches", "4",
                                  "--methods", "dynamic_eos", "ours", "dynamic"])
    text = generation.table(args, {"dynamic_eos": _ran(100.0), "ours": _ran(250.0), "dynamic": _ran(50.0)})
    assert "vs dynamic_eos" in text
    assert _row(text, "ours")[7] == "2.50x"
    assert _row(text, "dynamic")[7] == "0.50x"


def test_ratios_fall_back_to_dynamic_and_to_none():
    args = generation.parse_args(["--device", "cpu", "--tiny", "--batches", "4", "--methods", "dynamic", "ours"])
    text = generation.table(args, {"dynamic": _ran(100.0), "ours": _ran(300.0)})
    assert "vs dynamic |" in text and _row(text, "ours")[7] == "3.00x"
    args = generation.parse_args(["--device", "cpu", "--tiny", "--batches", "4", "--methods", "dynamic_eos", "ours"])
    text = generation.table(args, {"dynamic_eos": {"status": "error", "error": "x"}, "ours": _ran(300.0)})
    assert _row(text, "ours")[7] == "—"


def test_fastest_method_is_compiled_triton_with_fused_projections():
    args = generation.parse_args(["--device", "cpu", "--tiny"])
    decode = generation.generation_config(args, "ours_fastest", pad=0, eos=1)
    assert decode.compile_step and decode.fuse_projections and decode.decode_kernel == "triton"
    assert not decode.fused_sampling
    assert generation.unavailable("ours_fastest", "cpu")


def test_defaults_methods_turn_on_one_option_each_and_both_uncompiled():
    """`ours` is StaticDecode's default (decode_kernel "auto"), `ours_sdpa` pins the grouped sdpa,
    `ours_triton` the Triton kernels; the projections' methods add fuse_projections to those."""
    args = generation.parse_args(["--device", "cpu", "--tiny"])
    options = {m: generation.generation_config(args, m, pad=0, eos=1)
               for m in ("ours", "ours_sdpa", "ours_triton", "ours_fused_projections", "ours_triton_fused_projections")}
    assert [(d.decode_kernel, d.fuse_projections, d.compile_step) for d in options.values()] == [
        ("auto", False, False), ("sdpa", False, False), ("triton", False, False), ("auto", True, False),
        ("triton", True, False)]
    assert generation.unavailable("ours_triton_fused_projections", "cpu")
    assert generation.unavailable("ours_fused_projections", "cpu") is None
