"""benchmarks/decode/decode_profile.py's targets: taken from the rows' own steps, the fastest of each kind, the
compression's ratio against the fastest dense row (not the eager one), each naming the rows it took."""

import json

import pytest

from benchmarks.decode.decode_profile import profile_targets, retarget

ROWS = {"dense/engine_graph": {"step_ms": 6.0}, "dense/engine_graph_compiled": {"step_ms": 5.0},
        "neuzip-lossless/engine_graph_zgemv": {"step_ms": 5.5},
        "neuzip-lossless/engine_graph_zgemv_compiled": {"step_ms": 4.0},
        "neuzip-lossless/broken": {"error": "RuntimeError: no step"}}


def test_the_targets_take_the_fastest_row_of_each_kind():
    t = profile_targets(ROWS, roofline_step_ms=3.5)
    assert t["ar_roofline_fraction_8b"]["value"] == pytest.approx(3.5 / 5.0)
    assert t["ar_roofline_fraction_8b"]["derived_from"] == "dense/engine_graph_compiled"
    assert t["neuzip_lossless_over_bf16_decode"]["value"] == pytest.approx(5.0 / 4.0)  # not 6.0 / 4.0
    assert t["neuzip_lossless_over_bf16_decode"]["derived_from"] == (
        "neuzip-lossless/engine_graph_zgemv_compiled over dense/engine_graph_compiled")
    assert {entry["goal"] for entry in t.values()} == {">= 0.80", ">= 1.0"}


def test_without_dense_rows_no_target_is_claimed():
    assert profile_targets({"neuzip-lossless/engine_graph_zgemv": {"step_ms": 4.0}}, 3.5) == {}


def test_retarget_rewrites_only_the_targets_of_a_stored_record(tmp_path):
    path = tmp_path / "decode_profile.json"
    path.write_text(json.dumps({"git_commit": "0a5b494f", "git_dirty": False, "roofline_step_ms": 3.5,
                                "rows": ROWS, "targets": {}}))
    record = retarget(str(path))
    stored = json.loads(path.read_text())
    assert stored == record and stored["rows"] == ROWS and stored["git_commit"] == "0a5b494f"
    assert stored["targets"]["ar_roofline_fraction_8b"]["value"] == pytest.approx(0.7)
