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
