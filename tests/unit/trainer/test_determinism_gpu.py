"""On CUDA, with train.deterministic: a rerun and a resume store the same compressed bytes as the first run.

The 8B recipe's configuration scaled down (``benchmarks/training/determinism.py``'s ``train_steps``): NeuZip-lossless
weights, LOMO with a per-tensor clip and stochastic rounding off, activation checkpointing, decoder weights
and checkpointed inputs in host memory or not, packed sequences (positions restart, so attention runs with
a mask). 1,024 tokens over heads of 128 make several attention blocks, where the fused backward kernels add
in a varying order unless deterministic kernels are asked for (neutrain.trainer.determinism).

Run on the device machine: ``pytest -m gpu tests/unit/trainer/test_determinism_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.training.determinism import SAVED_AT, llama_config, token_batches, train_steps
from neutrain.trainer.determinism import deterministic_kernels

pytestmark = pytest.mark.gpu


def _differing(a: dict, b: dict) -> list[str]:
    assert a.keys() == b.keys()
    return sorted(k for k in a if not torch.equal(a[k], b[k]))


@pytest.mark.parametrize("offload", [True, False], ids=["offloaded", "on-gpu"])
def test_rerun_and_resume_are_bit_identical_on_deterministic_kernels(tmp_path, offload):
    config, batches = llama_config(2, 4096, hidden=512, heads=4, kv_heads=1), token_batches(4096)
    with deterministic_kernels(True):
        first = train_steps(config, batches, offload, packed=True, save_to=tmp_path / "checkpoint")
        again = train_steps(config, batches, offload, packed=True)
        resumed = train_steps(config, batches, offload, packed=True, start=SAVED_AT,
                              resume_from=tmp_path / "checkpoint")
    assert len(first) > 100  # every blob of every weight is compared
    assert not _differing(first, again), "a rerun differs"
    assert not _differing(first, resumed), "the resume differs"
