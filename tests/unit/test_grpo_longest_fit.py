"""benchmarks/e2e_grpo.py --longest_search --memory_fit: the peak at each length, the line
through the peaks, where it meets the GPU's memory, and each configuration against TRL's."""

from __future__ import annotations

import pytest

from benchmarks import e2e_grpo, grpo_longest


def _args(*more: str):
    return e2e_grpo.parse_args(["--device", "cpu", "--tiny", "--longest_search", *more])


def _fake(monkeypatch, lines: dict, oom_from: dict | None = None, total: float = 80.0):
    """Probes whose peak is intercept + slope x length, OOM from a length on, all recorded."""
    calls = []

    def probe(args, config, length):
        calls.append((config, length))
        if oom_from and length >= oom_from.get(config, 1 << 60):
            return {"status": "OOM", "peak_gib": 79.9}
        intercept, slope = lines[config]
        return {"status": "ok", "peak_gib": intercept + slope * length, "total_gib": total, "wall_s": 1.0}

    monkeypatch.setattr(grpo_longest, "probe", probe)
    return calls


def test_the_fit_predicts_where_each_line_meets_the_memory_and_compares_with_trl(monkeypatch):
    args = _args("--memory_fit", "16384", "4096", "8192", "--configs", "trl", "ours_shared_prompt")
    calls = _fake(monkeypatch, {"trl": (8.0, 1e-3), "ours_shared_prompt": (6.0, 1.25e-4)})
    found, text = grpo_longest.fit(args, {"trl": None, "ours_shared_prompt": None})
    assert calls == [(c, n) for c in ("trl", "ours_shared_prompt") for n in (4096, 8192, 16384)]  # shortest first
    assert found["trl"]["predicted"] == 72_000  # (80 - 8) / 1e-3
    assert found["ours_shared_prompt"]["predicted"] == 592_000  # (80 - 6) / 1.25e-4
    assert found["trl"]["slope_gib_per_1k"] == pytest.approx(1.024)
    assert found["trl"]["max_residual_gib"] < 1e-9
    assert "~72,000" in text and "~592,000" in text and "8.22x" in text  # 592,000 / 72,000
    assert "80.0 GiB" in text and "a prediction" in text


def test_each_line_is_also_compared_with_trls_longest_configuration(monkeypatch):
    """TRL at one completion a micro-batch reaches further than at its default micro-batch; the
    last column compares with the longer of the two."""
    args = _args("--memory_fit", "4096", "8192", "--configs", "trl", "ours_shared_prompt", "trl_micro1")
    _fake(monkeypatch, {"trl": (8.0, 1e-3), "ours_shared_prompt": (6.0, 1.25e-4), "trl_micro1": (8.0, 1 / 4096)})
    found, text = grpo_longest.fit(args, {"trl": None, "ours_shared_prompt": None, "trl_micro1": None})
    assert found["trl_micro1"]["predicted"] == 294_912  # (80 - 8) x 4096
    row = next(line for line in text.splitlines() if line.startswith("| ours_shared_prompt |"))
    assert "| 8.22x | 2.01x |" in row  # 592,000 against 72,000 and 294,912
    row = next(line for line in text.splitlines() if line.startswith("| trl_micro1 |"))
    assert "| 4.10x | 1.00x |" in row


def test_a_length_that_does_not_fit_ends_the_configurations_probes_and_is_shown(monkeypatch):
    args = _args("--memory_fit", "4096", "8192", "16384", "--configs", "trl", "ours")
    calls = _fake(monkeypatch, {"trl": (8.0, 4e-3), "ours": (6.0, 1e-3)}, oom_from={"trl": 16384})
    found, text = grpo_longest.fit(args, {"trl": None, "ours": None})
    assert ("trl", 16384) in calls and len([c for c in calls if c[0] == "trl"]) == 3
    assert [p["status"] for p in found["trl"]["probes"]] == ["ok", "ok", "OOM"]
    assert found["trl"]["points"] == [(4096, 8.0 + 4e-3 * 4096), (8192, 8.0 + 4e-3 * 8192)]  # two points: a line
    assert found["trl"]["predicted"] == 18_000
    assert "24.38, 40.77, OOM" in text


def test_one_point_or_none_on_the_cpu_predicts_nothing(monkeypatch):
    args = _args("--memory_fit", "8", "16", "--configs", "trl", "ours")
    monkeypatch.setattr(grpo_longest, "probe",
                        lambda args, config, length: {"status": "ok", "peak_gib": None, "total_gib": None})
    found, text = grpo_longest.fit(args, {"trl": None, "ours": "not installed"})
    assert found["trl"]["status"] == "incomplete" and "predicted" not in found["trl"]
    assert found["ours"] == {"status": "skipped", "reason": "not installed"}
    assert "skipped: not installed" in text


def test_an_error_stops_and_is_reported(monkeypatch):
    args = _args("--memory_fit", "8", "16", "--configs", "trl")
    monkeypatch.setattr(grpo_longest, "probe",
                        lambda args, config, length: {"status": "error", "error": "RuntimeError: boom"})
    found, text = grpo_longest.fit(args, {"trl": None})
    assert found["trl"]["status"] == "error" and len(found["trl"]["probes"]) == 1
    assert "error: RuntimeError: boom" in text


@pytest.mark.parametrize("argv, words", [
    (["--memory_fit", "8", "16"], "give both"),
    (["--longest_search", "--memory_fit", "8", "8"], "two or more different lengths"),
])
def test_bad_fit_flags_are_refused(argv, words, capsys):
    with pytest.raises(SystemExit):
        e2e_grpo.parse_args(["--device", "cpu", "--tiny", *argv])
    assert words in capsys.readouterr().err


def test_the_table_is_rewritten_after_each_configuration(monkeypatch, tmp_path):
    """A part stopped by its limit while the second configuration runs keeps the first's line."""
    out = tmp_path / "longest.md"
    args = _args("--memory_fit", "4096", "8192", "--configs", "trl", "ours_shared_prompt", "--markdown_out", str(out))
    seen = []

    def probe(args, config, length):
        if config == "ours_shared_prompt" and not seen:
            seen.append(out.read_text())  # what a stop here would leave
        return {"status": "ok", "peak_gib": 4.0 + 1e-3 * length, "total_gib": 80.0}

    monkeypatch.setattr(grpo_longest, "probe", probe)
    grpo_longest.fit(args, {"trl": None, "ours_shared_prompt": None})
    assert "| trl | 8.10, 12.19 |" in seen[0] and "~76,000" in seen[0]
    assert "| ours_shared_prompt | not run |" in seen[0]
    assert out.read_text().count("~76,000") == 2  # both lines at the end


def test_trl_micro1_trains_one_completion_a_micro_batch():
    """Its TRL arguments: micro-batch 1, the step's 8 completions as 8 accumulation steps, one generation."""
    from benchmarks.builders import grpo

    args = _args("--prompts", "1", "--num_generations", "8", "--per_device_train_batch_size", "8")
    grpo.apply_micro_batch(grpo.RUNS["trl"], args)
    assert args.per_device_train_batch_size == 8
    grpo.apply_micro_batch(grpo.RUNS["trl_micro1"], args)
    args.total_steps = 2
    kw = grpo.grpo_args(args, "/tmp/unused")
    assert (kw["per_device_train_batch_size"], kw["gradient_accumulation_steps"], kw["steps_per_generation"]) == (1, 8, 8)


def test_the_rollouts_kv_cache_at_the_predicted_length_is_shown_for_the_rows_decoded_at_once(monkeypatch):
    """The peaks leave out generation (random completions); the last column gives the KV cache a
    rollout at the predicted length would hold: every completion of the step at once for TRL and
    ours by default, two for generation_max_rows=2."""
    from benchmarks.builders import grpo
    from benchmarks.builders.model import model_config
    from benchmarks.harness.decode_limit import Shape

    args = _args("--memory_fit", "4096", "8192", "--configs", "trl", "ours_shared_prompt_rows2",
                 "--prompts", "8", "--num_generations", "8", "--prompt_length", "128")
    _fake(monkeypatch, {"trl": (8.0, 1e-3), "ours_shared_prompt_rows2": (6.0, 1.25e-4)})
    found, text = grpo_longest.fit(args, {"trl": None, "ours_shared_prompt_rows2": None})
    c = model_config(True)
    per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads) * 4  # fp32
    assert Shape.of(c, 0, 4).kv_bytes_per_token == per_token and Shape.of(c, 0, 2).kv_bytes_per_token == per_token // 2
    assert grpo.rows_decoded_at_once(grpo.RUNS["trl"], args) == 64
    assert grpo.rows_decoded_at_once(grpo.RUNS["ours_shared_prompt_rows2"], args) == 2
    for config, rows, length in (("trl", 64, 72_000), ("ours_shared_prompt_rows2", 2, 592_000)):
        assert found[config]["predicted"] == length
        row = next(line for line in text.splitlines() if line.startswith(f"| {config} |"))
        assert row.rstrip(" |").endswith(f"{rows * (128 + length) * per_token / 2**30:.1f} ({rows})")
    assert f"{per_token:,} bytes a token" in text


def test_the_pinned_host_memory_of_each_probe_is_shown_beside_its_peak(monkeypatch):
    """With checkpoint offload what the layers save waits in pinned host memory: each probe's peak of
    it stands beside its GPU peak (a dash where the worker could not read it: the CPU, an older torch),
    and does not enter the GPU line."""
    args = _args("--memory_fit", "4096", "8192", "--configs", "trl_micro1", "ours_shared_prompt_rows2_tiled")
    pinned = {("trl_micro1", 4096): None, ("trl_micro1", 8192): None,
              ("ours_shared_prompt_rows2_tiled", 4096): 0.75, ("ours_shared_prompt_rows2_tiled", 8192): 1.5}

    def probe(args, config, length):
        return {"status": "ok", "peak_gib": 4.0 + 1e-3 * length, "total_gib": 80.0,
                "host_pinned_gib": pinned[config, length]}

    monkeypatch.setattr(grpo_longest, "probe", probe)
    found, text = grpo_longest.fit(args, {"trl_micro1": None, "ours_shared_prompt_rows2_tiled": None})
    assert "| pinned host GiB at them (peak, offload's) |" in text
    assert "| ours_shared_prompt_rows2_tiled | 8.10, 12.19 | 0.75, 1.50 | 1.024 |" in text
    assert "| trl_micro1 | 8.10, 12.19 | —, — | 1.024 |" in text
    assert [p["host_pinned_gib"] for p in found["ours_shared_prompt_rows2_tiled"]["probes"]] == [0.75, 1.5]
    assert found["ours_shared_prompt_rows2_tiled"]["predicted"] == found["trl_micro1"]["predicted"] == 76_000
