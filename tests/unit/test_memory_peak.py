"""benchmarks/memory_peak.py: finding a step's memory peak and what is alive there."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.memory_peak import BEFORE, NO_FRAME, format_breakdown, label, peak_breakdown  # noqa: E402

HEAD = [{"filename": "/x/site-packages/torch/autograd/function.py", "line": 5, "name": "apply"},
        {"filename": "/repo/fusedalign/ops/triton_head.py", "line": 42, "name": "backward"}]
MODEL = [{"filename": "/x/site-packages/transformers/models/qwen2/modeling_qwen2.py", "line": 7, "name": "forward"}]
COMPILED_FWD = [{"filename": "/tmp/torchinductor_root/ab/cab12.py", "line": 90, "name": "call"},
                {"filename": "/x/site-packages/torch/_dynamo/eval_frame.py", "line": 1, "name": "_fn"}] + MODEL
COMPILED_BWD = [{"filename": "/tmp/torchinductor_root/cd/ccd34.py", "line": 12, "name": "call"},
                {"filename": "/x/site-packages/torch/_functorch/_aot_autograd/runtime_wrappers.py", "line": 3,
                 "name": "backward"}]


def ev(action, addr, size, frames=None):
    return {"action": action, "addr": addr, "size": size, "frames": frames or []}


def test_labels_skip_torch_frames_and_name_compiled_graphs():
    assert label(HEAD) == "fusedalign/ops/triton_head.py:42 backward"
    assert label(MODEL) == "transformers/models/qwen2/modeling_qwen2.py:7 forward"
    assert label(COMPILED_FWD) == "compiled graph called from transformers/models/qwen2/modeling_qwen2.py:7 forward"
    assert label(COMPILED_BWD) == "compiled graph, backward"
    assert label([]) == NO_FRAME


def test_peak_and_what_is_alive_there():
    trace = [
        ev("alloc", 1, 100, HEAD),        # 1100
        ev("alloc", 2, 200, MODEL),       # 1300
        ev("free_requested", 1, 100),     # 1200
        ev("alloc", 3, 300),              # 1500: the peak (B and C alive, A freed)
        ev("free_requested", 9, 50),      # 1450: a block from before the recording
        ev("alloc", 4, 10, HEAD),         # 1460
        ev("free_completed", 4, 10),      # not an accounting event
        ev("free_requested", 2, 200),
        ev("free_requested", 3, 300),
        ev("free_requested", 4, 10),
    ]
    s = peak_breakdown(trace, baseline_bytes=1000, tokens=10)
    assert s["peak_event"] == 3 and abs(s["peak_gib"] * 2**30 - 1500) < 1e-6
    groups = {g["label"]: round(g["gib"] * 2**30) for g in s["groups"]}
    assert groups == {BEFORE: 1000, NO_FRAME: 300, "transformers/models/qwen2/modeling_qwen2.py:7 forward": 200}
    assert [g["label"] for g in s["groups"]] == [BEFORE, NO_FRAME, "transformers/models/qwen2/modeling_qwen2.py:7 forward"]
    assert {g["label"]: g["bytes_per_token"] for g in s["groups"]}[NO_FRAME] == 30
    text = format_breakdown(s)
    assert "| transformers/models/qwen2/modeling_qwen2.py:7 forward | 0.000 | 1 | 20 |" in text


def test_pre_existing_frees_before_the_peak_shrink_the_before_group():
    trace = [ev("free_requested", 9, 400), ev("alloc", 1, 500, HEAD), ev("free_requested", 1, 500)]
    s = peak_breakdown(trace, baseline_bytes=1000)  # 600, 1100 (peak), 600
    groups = {g["label"]: round(g["gib"] * 2**30) for g in s["groups"]}
    assert s["peak_event"] == 1 and groups == {BEFORE: 600, "fusedalign/ops/triton_head.py:42 backward": 500}


def test_no_event_above_the_baseline_means_the_baseline_is_the_peak():
    s = peak_breakdown([ev("free_requested", 9, 400)], baseline_bytes=1000)
    assert s["peak_event"] == -1 and round(s["peak_gib"] * 2**30) == 1000


def test_the_on_policy_benchmarks_print_each_recorded_peak_under_its_configuration():
    # e2e_distill.py / e2e_grpo.py --memory_snapshot: a breakdown per configuration that recorded one.
    from benchmarks.harness.rollout import memory_snapshots

    s = peak_breakdown([ev("alloc", 1, 500, HEAD), ev("free_requested", 1, 500)], baseline_bytes=1000)
    texts = memory_snapshots({"ours": {"status": "ok", "memory": s}, "trl": {"status": "ok"},
                              "ours_compiled": {"status": "OOM", "memory": None}})
    assert len(texts) == 1 and texts[0].startswith("#### memory at the peak of the recorded step, ours\n")
    assert "| fusedalign/ops/triton_head.py:42 backward | 0.000 | 1 |" in texts[0]
