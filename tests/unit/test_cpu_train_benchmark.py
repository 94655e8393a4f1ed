"""benchmarks/training/cpu_train.py's record: both compressed-over-dense targets, each the ratio of the median steps.

Nothing here times anything: the rows are made up (or come from a two-step run of a tiny model whose
times are not looked at), and nothing is appended to a benchmark table.
"""

from __future__ import annotations

import json
from argparse import Namespace
from pathlib import Path
from statistics import median

import pytest
import torch

from benchmarks import records
from benchmarks.training import cpu_train

RECORD = records.current("cpu_train")


def _run(times: dict[str, list[float]], tokens: int, blocks: list[dict]) -> dict:
    n = len(next(iter(times.values())))
    return {"times": times, "decodes": {k: 2 * 10 * n for k in times if k != "dense"}, "blocks": blocks,
            "identical": {k: True for k in times if k != "dense"}, "n_weights": 10, "tokens": tokens, "steps": n}


def _block(order, load, **tok_s):
    rates = {f"{k}_tok_s": v for k, v in tok_s.items()}
    return {"order": list(order), "load_before": load, **rates, "load_after": load + 1}


def test_the_record_names_both_targets_with_the_ratio_of_the_median_steps():
    small = _run({"dense": [1.0, 2.0, 3.0], "compressed": [1.0, 4.0, 5.0], "compressed_slots": [2.0, 6.0, 6.0]}, 100,
                 [_block(cpu_train.VARIANTS, 2.0, dense=100.0, compressed=50.0, compressed_slots=40.0),
                  _block(cpu_train.VARIANTS, 3.0, dense=100.0, compressed=90.0, compressed_slots=40.0)])
    real = _run({"dense": [10.0, 12.0, 11.0], "compressed": [16.0, 15.0, 14.0]}, 2048,
                [_block(cpu_train.REAL_VARIANTS, 1.5, dense=200.0, compressed=150.0),
                 _block(cpu_train.REAL_VARIANTS[::-1], 2.5, dense=200.0, compressed=170.0),
                 _block(cpu_train.REAL_VARIANTS, 3.5, dense=200.0, compressed=100.0)])
    results = cpu_train.summarize(small)
    results["real_model"] = {"load_s": {"dense": 13.2, "compressed": 14.1}, **cpu_train.summarize(real)}
    targets = cpu_train.targets_of(results)

    assert set(targets) == {"cpu_compressed_over_dense_fused", "cpu_real_model_compressed_over_dense"}
    assert targets["cpu_compressed_over_dense_fused"] == {"value": round(2.0 / 4.0, 3), "goal": 0.8}
    assert targets["cpu_real_model_compressed_over_dense"] == {"value": round(11.0 / 15.0, 3), "goal": 0.8}
    assert results["median_tok_s"] == {"dense": 50.0, "compressed": 25.0, "compressed_slots": round(100 / 6, 1)}
    assert results["compressed_slots_over_dense"] == round(2.0 / 6.0, 3)
    assert results["compressed_over_dense_per_repeat_median"] == 0.7  # median of 0.5 and 0.9
    assert results["real_model"]["compressed_over_dense_per_repeat_median"] == 0.75  # of 0.75, 0.85, 0.5
    assert results["real_model"]["median_tok_s"] == {"dense": round(2048 / 11.0, 1),
                                                     "compressed": round(2048 / 15.0, 1)}
    assert results["real_model"]["decodes_per_weight_per_step"] == {"compressed": 2.0}
    assert results["real_model"]["load_average"] == {"min": 1.5, "max": 4.5}


def test_a_skipped_real_model_is_named_with_no_value_and_the_reason(monkeypatch):
    args = Namespace(no_real_model=True, real_batch=16, real_seq=128, real_steps=1, real_repeats=6, real_warmup=2)
    settings, skipped = cpu_train.real_model_run(args)
    assert skipped == {"skipped": "--no-real-model"}
    assert (settings["batch"], settings["seq"], settings["optimizer"]["lr"]) == (16, 128, 5e-4)
    target = cpu_train.targets_of({"compressed_over_dense": 0.9, "real_model": skipped})[cpu_train.TARGET_REAL]
    assert target["value"] is None and "--no-real-model" in target["note"]

    monkeypatch.setenv("NEUTRAIN_SMOLLM2_GGUF", "/nonexistent/SmolLM2-135M-Instruct.Q4_1.gguf")  # a missing GGUF
    args.no_real_model = False
    _, missing = cpu_train.real_model_run(args)
    assert "could not be loaded" in missing["skipped"] and "no such file" in missing["skipped"]
    assert "not measured" in cpu_train.targets_of({"compressed_over_dense": 0.9, "real_model": missing})[
        cpu_train.TARGET_REAL]["note"]


@pytest.mark.slow
def test_interleaved_blocks_give_rows_the_summary_reads():
    from transformers import AutoModelForCausalLM, LlamaConfig

    from neutrain.nn import compress_model

    cfg = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=40, tie_word_embeddings=True)
    torch.manual_seed(0)
    dense = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).train()
    compressed = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).train()
    compressed.load_state_dict(dense.state_dict())
    compress_model(compressed, progress=False)
    run = cpu_train.interleave({"dense": dense, "compressed": compressed}, cpu_train.OPTIMIZER,
                               cpu_train._batches(40, 2, 8, 2), repeats=2)
    assert [b["order"] for b in run["blocks"]] == [["dense", "compressed"], ["compressed", "dense"]]
    assert (len(run["times"]["dense"]), len(run["times"]["compressed"]), run["tokens"], run["steps"]) == (4, 4, 16, 4)
    assert run["identical"] == {"compressed": True}
    out = cpu_train.summarize(run)
    assert out["compressed_over_dense"] == round(median(run["times"]["dense"]) / median(run["times"]["compressed"]), 3)


def test_the_committed_record_holds_both_targets_from_its_own_results():
    if RECORD is None:
        pytest.skip("no current cpu_train row in benchmarks/training/results.jsonl")
    data = RECORD
    results = data["results"]
    assert data["targets"] == cpu_train.targets_of(results)
    small = results["median_tok_s"]["compressed"] / results["median_tok_s"]["dense"]  # medians kept to 0.1 tok/s
    assert abs(data["targets"]["cpu_compressed_over_dense_fused"]["value"] - small) < 2e-3
    real = results["real_model"]
    if "skipped" not in real:
        ratio = real["median_tok_s"]["compressed"] / real["median_tok_s"]["dense"]
        assert abs(data["targets"]["cpu_real_model_compressed_over_dense"]["value"] - ratio) < 2e-3
        assert set(real["load_s"]) == {"dense", "compressed"}
    settings = data["settings"]["real_model"]
    assert {"model", "batch", "seq", "steps_per_block", "repeats", "optimizer", "threads"} <= set(settings)
