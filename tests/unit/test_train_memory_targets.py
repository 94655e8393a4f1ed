"""The training-throughput record's targets (benchmarks/memory/train_memory.py): rounds and bounds computed, not copied."""

from benchmarks.memory.train_memory import targets_of


def _row(variant, b1=None, b8=None, reserved=None):
    row = {"variant": variant}
    if b1 is not None:
        row["batch1"] = {"tokens_per_s": b1}
        if reserved is not None:
            row["batch1"]["peak_reserved_gib"] = reserved
    if b8 is not None:
        row["batch8"] = {"tokens_per_s": b8}
    return row


def test_a_variant_timed_in_rounds_counts_by_its_median_and_lists_every_round():
    # d c c d: the host's drift within the call hits both; one slow round does not decide the ratio.
    rows = [_row("d", 2000, 7000, 12.0), _row("c", 2500, 8000), _row("c", 2100, 8100), _row("d", 2050, 7100, 12.2),
            _row("d", 1000, 7050, 11.9)]
    t = targets_of(rows)
    b1 = t["d_over_c_tokens_per_s_batch1"]
    assert b1["value"] == round(2000 / 2300, 3) and b1["met"] is False
    assert b1["rounds_tokens_per_s"] == {"d": [2000, 2050, 1000], "c": [2500, 2100]}
    assert t["d_over_c_tokens_per_s_batch8"]["value"] == round(7050 / 8050, 3)
    # Memory is a bound: the worst round.
    assert t["d_peak_reserved_gib_batch1"] == {"value": 12.2, "goal": "<= 12.1", "met": False}


def test_one_round_each_reads_as_before():
    t = targets_of([_row("d", 2900, 7800), _row("c", 3000, 8000)])
    assert t["d_over_c_tokens_per_s_batch1"] == {"value": round(2900 / 3000, 3), "goal": ">= 0.95", "met": True}
    assert "rounds_tokens_per_s" not in t["d_over_c_tokens_per_s_batch8"]
