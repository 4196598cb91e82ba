"""Training curves: which panels, which lines, and a layout whose titles do not collide."""

from __future__ import annotations

import json

import pytest

from fusedalign.plot import constant_value, last_run, line_label, panel_titles, panels, plot_run


def _write(tmp_path, records):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return tmp_path


def test_train_and_eval_of_a_metric_share_a_panel():
    records = [{"step": 1, "loss": 0.7, "rewards/accuracies": 0.5}, {"step": 2, "loss": 0.6},
               {"step": 2, "eval_loss": 0.65, "eval_rewards/accuracies": 0.6, "eval_runtime": 1.2}]
    drawn = panels(records)
    assert list(drawn) == ["loss", "rewards/accuracies"]
    assert drawn["loss"]["train"].values == [0.7, 0.6] and drawn["loss"]["eval"].values == [0.65]
    assert drawn["loss"]["eval"].steps == [2]
    assert set(drawn["rewards/accuracies"]) == {"train", "eval"}


def test_constant_lines_are_drawn_and_say_so():
    records = [{"step": s, "kl": 0.1 * s, "eval_kl": 0.0, "entropy": 0.0} for s in (1, 2, 3)]
    drawn = panels(records)  # KTO with a frozen reference: eval_kl is 0 throughout
    assert list(drawn) == ["kl", "entropy"] and list(drawn["kl"]) == ["train", "eval"]
    assert [line_label(k, v) for k, v in drawn["kl"].items()] == ["train", "eval = 0 throughout"]
    assert constant_value(drawn["entropy"]["train"]) == 0.0


def test_a_reward_that_is_always_zero_keeps_its_reward_and_loss_panels(tmp_path):
    # GRPO where no completion is ever rewarded: every group has zero std, the loss is 0.
    records = [{"step": s, "loss": 0.0, "reward": 0.0, "reward_std": 0.0, "frac_reward_zero_std": 1.0,
                "rewards/zen_words/mean": 0.0, "kl": 0.0, "entropy": 6.0 - 0.1 * s} for s in (1, 2, 3, 4)]
    _write(tmp_path, records)
    titles = ["loss", "reward", "reward_std", "frac_reward_zero_std", "rewards/zen_words/mean", "kl", "entropy"]
    assert panel_titles(str(tmp_path)) == titles
    fig = _drawn_figure(tmp_path)
    axes = {ax.get_title(): ax for ax in fig.axes if ax.get_title()}
    assert list(axes) == titles
    for title, ax in axes.items():
        notes = [text.get_text() for text in ax.texts]
        legend = [text.get_text() for text in ax.get_legend().get_texts()] if ax.get_legend() else []
        if title == "entropy":
            assert notes == [] and legend == []
        else:
            value = "1" if title == "frac_reward_zero_std" else "0"
            assert notes == ["constant"] and legend == [f"train = {value} throughout"], (title, notes, legend)
            # Clear of the flat line, which sits in the panel's middle: the note above, the legend below.
            assert ax.texts[0].get_position()[1] > 0.6 and ax.get_legend()._loc == 8, title  # 8: lower center
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_grpo_metrics_are_drawn_clip_ratios_on_one_panel():
    records = [{"step": s, "reward": 0.1 * s, "reward_std": 0.2, "kl": 0.01 * s, "entropy": 1.0,
                "completions/mean_length": 30.0 + s, "clip_ratio/low_mean": 0.0, "clip_ratio/high_mean": 0.01 * s,
                "clip_ratio/region_mean": 0.02, "rewards/accuracy_reward/mean": 0.3, "learning_rate": 1e-6}
               for s in (1, 2)]
    drawn = panels(records)
    assert list(drawn) == ["reward", "reward_std", "rewards/accuracy_reward/mean", "kl", "entropy",
                           "completions/mean_length", "clip_ratio"]
    assert set(drawn["clip_ratio"]) == {"low_mean train", "high_mean train", "region_mean train"}
    assert constant_value(drawn["clip_ratio"]["low_mean train"]) == 0.0  # never clipped: drawn, and said


def test_a_log_holding_two_appended_runs_draws_the_last():
    first = [{"step": s, "loss": 1.0} for s in (1, 2, 3)]
    second = [{"step": s, "loss": 0.5} for s in (1, 2)]
    assert last_run(first + second) == second
    assert panels(first + second)["loss"]["train"].steps == [1, 2]


def _drawn_figure(output_dir):
    """plot_run's figure, kept open (the caller closes it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    captured = {}
    real_close = plt.close
    plt.close = lambda fig: captured.setdefault("fig", fig)
    try:
        plot_run(str(output_dir))
    finally:
        plt.close = real_close
    return captured["fig"]


def test_panel_titles_are_the_titles_drawn(tmp_path):
    # GRPO with beta > 0 and num_iterations=2: the clip ratios are 0 on the on-policy steps only.
    records = [{"step": s, "loss": 0.1, "reward": 0.1 * s, "kl": 0.02 * s, "entropy": 6.0,
                "completions/mean_length": 15.5, "clip_ratio/low_mean": 0.0, "clip_ratio/high_mean": 0.05 * (s % 2 == 0),
                "clip_ratio/region_mean": 0.1 * (s % 2 == 0), "eval_kl": 0.0} for s in (1, 2, 3, 4)]
    _write(tmp_path, records)
    titles = panel_titles(str(tmp_path))
    assert titles == ["loss", "reward", "kl", "entropy", "completions/mean_length", "clip_ratio"]
    fig = _drawn_figure(tmp_path)
    assert [ax.get_title() for ax in fig.axes if ax.get_title()] == titles
    import matplotlib.pyplot as plt

    plt.close(fig)
    with pytest.raises(FileNotFoundError, match="No metrics to plot"):
        panel_titles(str(tmp_path / "missing"))


def test_figure_title_clears_every_panel_title(tmp_path):
    import matplotlib.pyplot as plt

    records = [{"step": s, "loss": 1 / s, "rewards/accuracies": s / 10, "rewards/margins": s / 5,
                "eval_loss": 1.1 / s} for s in range(1, 6)]
    fig = _drawn_figure(_write(tmp_path, records))
    renderer = fig.canvas.get_renderer()
    suptitle = fig._suptitle.get_window_extent(renderer)
    for ax in fig.axes:
        if ax.get_title():
            title = ax.title.get_window_extent(renderer)
            assert not suptitle.overlaps(title) and suptitle.y0 - title.y1 >= 5, ax.get_title()
    plt.close(fig)


def test_nothing_to_draw_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="holds no curve to draw"):
        plot_run(str(_write(tmp_path, [{"step": 1, "eval_runtime": 0.5, "learning_rate": 1e-3}])))
