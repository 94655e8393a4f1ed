"""benchmarks/decode/zgemv.py runs on the CPU in its ``--quick`` mode (tiny shapes, Triton's interpreter), so the GPU
script cannot rot between device runs: every shape gets a checked zgemv time, the layout is exact, the record
is written where it was asked (never into a benchmark table) and says it is no measurement."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("triton")


@pytest.mark.slow
def test_quick_run_writes_a_checked_record(tmp_path, capsys):
    from benchmarks.decode import zgemv as bench

    final = bench.main(["--quick", "--out-dir", str(tmp_path)])
    record = json.loads((tmp_path / "zgemv.json").read_text())
    assert final["path"] == str(tmp_path / "zgemv.json")
    assert record["targets"] == {} and "not a measurement" in record["targets_note"]
    assert record["git_commit"] and "device" in record and "versions" in record
    shapes = record["results"]["shapes"]
    assert set(shapes) == set(bench.QUICK_SHAPES)
    for name, row in shapes.items():
        assert "error" not in row, (name, row.get("error"))
        assert row["layout_exact"] and row["best_zgemv"].startswith("zgemv_"), (name, row)
        assert not [key for key in row["errors"] if key.startswith("zgemv")], row["errors"]  # every config checked out
        assert row["bits_per_weight"] > 12 and row["rows"]["4"]["best_zgemv"]
    table = capsys.readouterr().out
    assert "zgemv/bf16" in table and "q_or_o" in table and "lm_head" in table
