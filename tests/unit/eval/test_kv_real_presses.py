"""The real model's part of the KV table evaluates the settings beside every throughput row, the kvpress presses
included, in the rows' order.

The H200 call at bdfe903 recorded "real -,-,-" beside the kvpress-pruned row: ``kv_eval.all_parts`` asked the real
part for the settings beside the rows, ``real_part`` ran them in ``real_configs`` + ``baseline_configs`` order
(the three presses last), and the run's time ran out after QuantizedCache: each press was recorded as skipped for
the time budget. The presses themselves run on SmolLM2 (checked on CPU); what was wrong was their place and the
real part's seconds (``_kv_plan.REAL_SECONDS``)."""

import argparse
from types import SimpleNamespace

from benchmarks.kv._kv_targets import PRESSES, ROW_ACCURACY, attach_accuracy
from benchmarks.kv._kv_throughput import ROWS
from benchmarks.kv.kv_eval import beside_rows


def test_the_settings_beside_the_rows_are_every_rows_first_then_the_other_presses():
    settings = beside_rows()
    assert set(settings) == {s for row in ROWS for s in ROW_ACCURACY[row]} - {"full"}
    assert set(PRESSES) <= set(settings)
    firsts = {ROW_ACCURACY[row][0] for row in ROWS} - {"full"}
    assert set(settings[: len(firsts)]) == firsts  # one accuracy for each row before a second press


def fake_real_part(monkeypatch, settings_with_time: int):
    """``real_part`` on a stand-in model whose every setting takes 10 s of a run that has time for
    ``settings_with_time`` of them; returns the part's record and the settings evaluated, in order."""
    import neutrain.eval.real_model as real_model
    from benchmarks.kv import _kv_real

    evaluated = []
    config = SimpleNamespace(num_key_value_heads=3, head_dim=64, hidden_size=576, num_attention_heads=9,
                             num_hidden_layers=30)
    model = SimpleNamespace(config=config, to=lambda device: None)
    monkeypatch.setattr(real_model, "load_smollm2", lambda: (model, object()))
    monkeypatch.setattr(_kv_real, "real_samples", lambda tok, args: [])
    monkeypatch.setattr(_kv_real, "run_tasks", lambda *a, **k: {"overall": {"accuracy": 100.0}, "tasks": {}})
    monkeypatch.setattr(_kv_real, "summarise", lambda res, label, options: {"kv": label, **res, "table": label})
    monkeypatch.setattr(_kv_real, "chosen_min_similarity", lambda *a: (0.5, None))
    monkeypatch.setattr(_kv_real, "format_table", lambda results: results["kv"])

    class FakeFactory:
        def __init__(self, *a, **k):
            pass

        def __enter__(self):
            return None

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(_kv_real, "kv_cache_factory", FakeFactory)

    def evaluate(model, tok, samples, kind, options):
        evaluated.append(kind)
        return {"overall": {"accuracy": 50.0}, "tasks": {}}

    monkeypatch.setattr(_kv_real, "evaluate_config", evaluate)
    reserve = 5.0
    monkeypatch.setattr(_kv_real.DEADLINE, "left", lambda: reserve + 10.0 * (settings_with_time - len(evaluated)) - 1)
    args = argparse.Namespace(only=beside_rows(), reserve_seconds=reserve, real_len=1024, real_samples=10,
                              real_chat=False, min_similarity="auto")
    record = _kv_real.real_part(args, lambda msg: None)
    return record, [label for label, cache in record["caches"].items() if "overall" in cache and label != "full"]


def test_the_real_part_runs_the_settings_beside_the_rows_in_that_order(monkeypatch):
    record, evaluated = fake_real_part(monkeypatch, settings_with_time=5)
    assert evaluated == beside_rows()[:5]
    skipped = [label for label, cache in record["caches"].items() if "skipped" in cache]
    assert skipped == beside_rows()[5:]


def test_with_time_for_one_setting_a_row_every_row_has_its_real_model_accuracy(monkeypatch):
    firsts = len({ROW_ACCURACY[row][0] for row in ROWS} - {"full"})
    record, evaluated = fake_real_part(monkeypatch, settings_with_time=firsts)
    results = {"throughput": {"contexts": {"65536": {row: {"tokens_per_s": 1.0} for row in ROWS}}}, "real": record,
               "fidelity": {}}
    attach_accuracy(results)
    for row, entry in results["throughput"]["contexts"]["65536"].items():
        assert any("gap_points" in a for a in entry["accuracy"]["real_model"]), (row, entry["accuracy"]["real_model"])
    pruned = results["throughput"]["contexts"]["65536"]["kvpress_pruned"]["accuracy"]["real_model"]
    assert [a["setting"] for a in pruned if "gap_points" in a] == ["kvpress_snapkv"]
    assert all("time budget" in a["missing"] for a in pruned if "gap_points" not in a)


def test_with_time_for_all_of_them_the_three_presses_have_their_accuracy(monkeypatch):
    record, evaluated = fake_real_part(monkeypatch, settings_with_time=len(beside_rows()))
    assert set(PRESSES) <= set(record["gap_points"])
