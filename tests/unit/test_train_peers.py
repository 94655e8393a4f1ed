"""benchmarks/memory/_train_peers.py: the device memory a benchmark reports is its own card's (no GPU needed)."""

from __future__ import annotations

import sys
import types

import torch

from benchmarks.memory import _train_peers


def test_device_used_reads_the_cuda_device_not_nvml_index_zero(monkeypatch):
    # A run given the host's second GPU (CUDA_VISIBLE_DEVICES=1) is cuda:0 to torch but NVML's index 1;
    # NVML's own index 0 is the neighbour's card. torch.cuda.device_memory_used maps the index; a stand-in
    # NVML that answers 9 GiB for its index 0 must not be what the benchmark reports.
    asked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_memory_used", lambda index: asked.append(index) or 5 * 2**30)
    neighbour = types.SimpleNamespace(
        nvmlInit=lambda: None, nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetMemoryInfo=lambda handle: types.SimpleNamespace(used=9 * 2**30))
    monkeypatch.setitem(sys.modules, "pynvml", neighbour)
    assert _train_peers.device_used_gib() == 5.0
    assert asked == [0]


def test_device_used_without_nvml_falls_back_to_the_drivers_free_figure(monkeypatch):
    def no_nvml(index):
        raise ModuleNotFoundError("pynvml")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_memory_used", no_nvml)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index=None: (30 * 2**30, 32 * 2**30))
    assert _train_peers.device_used_gib() == 2.0


def test_device_used_is_none_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _train_peers.device_used_gib() is None
