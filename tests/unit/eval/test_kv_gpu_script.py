"""benchmarks/kv/gpu_kv.sh, the KV table's one device call, runs its whole path on CPU with SMOKE=1 (stand-in shapes,
the settings beside the throughput rows; ~20 s on 2 cores): its record has every throughput row with its batch,
attention kernel and GPU state (or the reason it did not run), and beside each its accuracy on the retrieval model
and on the real model (or the reason there is none). The real model itself (SmolLM2 on CPU, minutes on a busy
host) is left out here by naming a GGUF that is not there: the committed CPU record stands in, cited;
test_kv_real_presses.py covers the real part's settings."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.kv._kv_throughput import CUDA_ONLY_ROWS, GRAPH_NEEDS_CUDA

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.slow
def test_the_device_script_writes_every_row_with_its_throughput_and_accuracy(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    wrapper = bin_dir / "python3"  # the script calls python3: this interpreter (a symlink would lose its venv)
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    wrapper.chmod(0o755)
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "NEUTRAIN_SMOLLM2_GGUF")}
    env.update(NEUTRAIN_SMOLLM2_GGUF=str(tmp_path / "absent.gguf"), SMOKE="1", OUT=str(out), NEUTRAIN_GIT_COMMIT="0" * 40, NEUTRAIN_GIT_DIRTY="1",
               PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", PYTHONPATH=str(ROOT))
    res = subprocess.run(["bash", "benchmarks/kv/gpu_kv.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    log = (out / "kv_eval.log").read_text() if (out / "kv_eval.log").exists() else ""
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:] + log[-3000:]
    record = json.loads((out / "kv_eval_smoke.json").read_text())
    rows = record["results"]["throughput"]["contexts"]["128"]
    assert {"full", "shadowkv", "minicache_merge_4bit", "minicache_4bit_only", "minicache_merge", "kvpress_pruned",
            "full_repeat", "minicache_merge_4bit_restore", "quantized_cache_4bit", *CUDA_ONLY_ROWS} <= set(rows)
    for label, row in rows.items():
        assert "skipped" not in row, (label, row)  # no row is skipped (for time or otherwise)
        if "error" in row:  # e.g. QuantizedCache without optimum-quanto: the reason is kept
            assert row["error"].strip(), label
        elif label in CUDA_ONLY_ROWS and not torch.cuda.is_available():  # on CPU, why the graphed rows did not run
            assert row["needs_cuda"] == GRAPH_NEEDS_CUDA and "tokens_per_s" not in row, (label, row)
        else:
            assert row["batch"] >= 1 and row["tokens_per_s"] > 0, label
            assert row["attention_kernel"], (label, row.get("attention_ops"))
            assert {"before", "after"} <= set(row["gpu_state"]) and "sm_clock_mhz" in row["gpu_state"]["after"], label
        for model in ("retrieval_model", "real_model"):
            entries = row["accuracy"][model]
            assert entries and all("gap_points" in e or e.get("missing") for e in entries), (label, model, entries)
    assert "triton:minicache" in rows["minicache_merge_4bit"]["attention_kernel"]
    assert "triton:shadowkv_fused_decode" in rows["shadowkv_fused_decode"]["attention_kernel"]
    assert rows["shadowkv_fused_decode"]["fused_steps"] > 0 and rows["shadowkv"]["fused_steps"] == 0
    assert set(rows["full"]["sdpa_backends"]) >= {"default_dispatch", "flash_attention"}
    assert record["results"]["fidelity"]["caches"]["full"]["overall"]["samples"] >= 1
    assert "shadowkv_throughput_over_full_64k" in record["targets"]
    assert "x full" in res.stdout  # the summary table the device call prints
    assert "no such file" in record["results"]["real"]["skipped"]  # the real model left out, and why
    assert [t["part"] for t in record["results"]["timeline"]] == [
        "retrieval model", "throughput rows", "retrieval-model settings", "real model", "record"]
