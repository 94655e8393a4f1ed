"""The run's PNG: drawn from metrics.jsonl without warnings, also for a run that logged no memory."""

import json
import warnings

from neutrain.trainer.callbacks import plot_metrics


def _metrics(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_a_run_without_memory_records_plots_without_a_warning(tmp_path):
    # The draft's distillation logs loss and learning rate but no memory: matplotlib warned about an
    # empty legend on every default run.
    metrics = _metrics(tmp_path / "metrics.jsonl", [{"step": s, "loss": 3.0 - s / 10, "learning_rate": 1e-3}
                                                    for s in (1, 2, 3)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        png = plot_metrics(metrics, tmp_path / "curves.png")
    assert png is not None and (tmp_path / "curves.png").stat().st_size > 1000


def test_memory_series_are_drawn_when_logged(tmp_path):
    metrics = _metrics(tmp_path / "metrics.jsonl", [{"step": s, "loss": 3.0, "peak_rss_gib": 1.0 + s}
                                                    for s in (1, 2)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert plot_metrics(metrics, tmp_path / "curves.png") is not None


def test_legends_sit_off_the_data_and_the_memory_line_below_the_border():
    # Before: each legend sat inside its panel, and a flat memory line ran along the top border under it.
    from neutrain.trainer.callbacks import draw_metrics

    records = [{"step": s, "loss": 6.0 - s / 50, "learning_rate": 0.1 * (1 - s / 240), "peak_rss_gib": 1.04 + s / 12000}
               for s in range(20, 241, 20)] + [{"step": 240, "eval_loss": 4.75}]
    fig = draw_metrics(records)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        legend = ax.get_legend()
        assert legend is not None
        assert not legend.get_window_extent(renderer).overlaps(ax.get_window_extent(renderer)), ax.get_ylabel()
    ax_mem = fig.axes[2]
    highest = max(max(line.get_ydata()) for line in ax_mem.get_lines())
    assert highest <= 0.9 * ax_mem.get_ylim()[1]


def test_an_evaluation_alone_draws_no_figure(tmp_path):
    # Before: `neutrain eval` wrote a training_curves.png with one point and two empty panels.
    metrics = _metrics(tmp_path / "metrics.jsonl", [{"step": 240, "eval_loss": 4.75, "eval_runtime": 3.0}])
    assert plot_metrics(metrics, tmp_path / "curves.png") is None
    assert not (tmp_path / "curves.png").exists()
