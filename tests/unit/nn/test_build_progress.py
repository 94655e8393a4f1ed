"""A build that takes more than a few seconds says how far it is: lines in a log, counted (never timed)."""

from __future__ import annotations

import io

import pytest
import torch

from neutrain.nn import build_progress as progress


def test_a_gguf_load_in_a_log_prints_how_far_it_is_and_how_long_it_took(tmp_path, capsys, monkeypatch):
    pytest.importorskip("gguf")
    from neutrain.nn.gguf import load_gguf_model
    from tests.gguf_writer import tiny_llama, tiny_tokenizer, write_gguf

    tok = tiny_tokenizer()
    path = write_gguf(tmp_path / "tiny.gguf", tiny_llama(len(tok)), tok)
    monkeypatch.delenv("DISABLE_TQDM", raising=False)
    monkeypatch.setattr(progress, "QUIET_FOR", 0.0)  # as if every tensor took longer than the quiet time
    monkeypatch.setattr(progress, "EVERY", 0.0)
    load_gguf_model(str(path.parent), path.name, torch.float32)
    lines = capsys.readouterr().err.splitlines()
    counted = [line for line in lines if line.startswith("loading weights: ") and " elapsed" in line]
    total = len(tiny_llama(len(tok)).state_dict())
    assert len(counted) == total and counted[0].startswith(f"loading weights: 1/{total} tensors, ")
    assert lines[-1].startswith(f"loading weights: {total} tensors in ")


def test_a_short_build_prints_nothing_and_disable_tqdm_silences_a_long_one():
    log = io.StringIO()
    assert list(progress.build_progress(range(5), "loading weights", 5, stream=log, environ={})) == list(range(5))
    assert log.getvalue() == ""
    ticks = iter(range(0, 1000, 10))
    list(progress.build_progress(range(5), "loading weights", 5, stream=log, clock=lambda: next(ticks),
                                 environ={"DISABLE_TQDM": "1"}))
    assert log.getvalue() == ""


def test_log_lines_come_every_interval_with_the_time_left():
    log = io.StringIO()
    ticks = iter(range(0, 1000, 10))  # 10 s per item: lines at 10 s, then every 30 s
    list(progress.build_progress(range(8), "building", 8, stream=log, clock=lambda: next(ticks), environ={}))
    assert log.getvalue().splitlines() == [
        "building: 1/8 tensors, 10 s elapsed, about 70 s left",
        "building: 4/8 tensors, 40 s elapsed, about 40 s left",
        "building: 7/8 tensors, 70 s elapsed, about 10 s left",
        "building: 8 tensors in 90 s",
    ]
