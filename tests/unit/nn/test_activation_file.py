"""The disk tier of checkpointed layer inputs: bytes back as they went out, training unchanged, and no file
left under the run's folder after a step, a finished run or an exception in the middle of a step."""

from __future__ import annotations

import copy
import gc
import os

import pytest
import torch

from neutrain.nn import causal_lm_loss
from neutrain.nn.activation_file import ActivationFile, FileStash
from neutrain.nn.offload import STATS, offload_checkpointed_inputs

from .nn_helpers import enable_checkpointing, tiny_llama, token_batches


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int64, torch.bool])
def test_a_tensor_comes_back_bit_for_bit_through_a_staging_buffer_smaller_than_it(tmp_path, dtype):
    torch.manual_seed(0)
    x = (torch.randn(33, 65) * 1e3).to(dtype)
    if dtype.is_floating_point:
        x.view(-1)[:3] = torch.tensor([float("nan"), float("-inf"), -0.0])  # odd values are bytes like any other
    with ActivationFile(tmp_path, staging_bytes=100) as spill:  # many chunks, the last one short
        first, second = spill.write(x), spill.write(x.t())  # a transposed view: written as its values
        back, back_t = spill.read(first), spill.read(second)
        assert back.dtype == dtype and back.shape == x.shape
        assert torch.equal(back.view(torch.uint8), x.contiguous().view(torch.uint8))
        assert torch.equal(back_t.view(torch.uint8), x.t().contiguous().view(torch.uint8))
        assert spill.live == 2 and spill.end % 4096 == 0
        del first, second
        assert spill.live == 0 and spill.end == 0  # every record back: the space is reused from the start
    assert spill.closed and os.listdir(tmp_path) == []


def _step(model, ids):
    loss = causal_lm_loss(model, ids, ids)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def test_layers_spilled_to_a_file_train_bit_identically_and_leave_no_file(tmp_path):
    model = tiny_llama(layers=3)
    enable_checkpointing(model)
    twin = copy.deepcopy(model)
    folder = tmp_path / "run" / ".cache"
    with ActivationFile(folder, staging_bytes=256) as spill:
        # The first layer's inputs to the file, the second's to host memory, the last's stay where they are.
        assert offload_checkpointed_inputs(twin, device_layers=1, file_layers=1, spill=spill, spill_host_tensors=True) == 3
        STATS.reset()
        for ids in token_batches(2, seed=3):
            want_loss, want = _step(model, ids)
            got_loss, got = _step(twin, ids)
            assert torch.equal(want_loss, got_loss)
            assert all(torch.equal(want[n], got[n]) for n in want)
            assert spill.live == 0 and spill.end == 0  # the step read every input back
        assert spill.written_bytes == spill.read_bytes > 0
        assert STATS.calls == 2 * 2  # the file's and the host's layers went through the offloading checkpoint
        assert os.listdir(folder) == []  # nameless while open
    assert spill.closed


def test_an_exception_in_the_middle_of_a_step_frees_the_file_and_the_next_step_is_exact(tmp_path):
    model = tiny_llama(layers=2)
    enable_checkpointing(model)
    twin = copy.deepcopy(model)
    spill = ActivationFile(tmp_path, staging_bytes=512)
    offload_checkpointed_inputs(twin, file_layers=2, spill=spill, spill_host_tensors=True)
    ids = token_batches(1, seed=5)[0]

    def fail(_grad):
        raise RuntimeError("a failure inside backward")

    with pytest.raises(ValueError, match="before backward"):
        causal_lm_loss(twin, ids, ids)  # forward wrote both layers' inputs
        raise ValueError("a failure before backward")
    gc.collect()
    assert spill.live == 0 and spill.end == 0 and os.listdir(tmp_path) == []  # the graph's records went with it
    handle = twin.model.layers[1].mlp.down_proj.weight.register_hook(fail)
    with pytest.raises(RuntimeError, match="inside backward"):
        causal_lm_loss(twin, ids, ids).backward()  # backward fails half-way: one input read back, one not
    handle.remove()
    twin.zero_grad(set_to_none=True)
    assert spill.written_bytes > spill.read_bytes and os.listdir(tmp_path) == []
    # autograd's engine lets go of a failed graph at its next backward: the next step is exact, and after it
    # the file is empty again
    want_loss, want = _step(model, ids)
    got_loss, got = _step(twin, ids)
    assert torch.equal(want_loss, got_loss) and all(torch.equal(want[n], got[n]) for n in want)
    gc.collect()
    assert spill.live == 0 and spill.end == 0
    kept = spill.write(torch.ones(3))
    spill.close()
    assert spill.closed and os.listdir(tmp_path) == []
    with pytest.raises(ValueError, match="closed after this tensor was written"):
        spill.read(kept)
    again = spill.write(torch.zeros(2))  # a later run of the same trainer: opened again
    assert torch.equal(spill.read(again), torch.zeros(2)) and os.listdir(tmp_path) == []
    spill.close()


def test_host_tensors_stay_where_they_are_without_the_flag(tmp_path):
    with ActivationFile(tmp_path) as spill:
        stash = FileStash(spill)
        x = torch.randn(4, 3, requires_grad=True)
        with stash:
            y = (x * x).sum()
        y.backward()
        assert stash.packed == 0 and spill.written_bytes == 0 and torch.equal(x.grad, 2 * x)


def test_file_layers_need_a_file():
    model = tiny_llama()
    enable_checkpointing(model)
    with pytest.raises(ValueError, match="ActivationFile"):
        offload_checkpointed_inputs(model, file_layers=1)


@pytest.mark.gpu
def test_layer_inputs_spilled_from_the_gpu_come_back_bit_for_bit_and_free_the_device(tmp_path):
    # Four layers: the first two's inputs to the file, the third's to host memory, the last's stay on the device.
    results, inputs = {}, 4 * 1024 * 512 * 2  # one layer's input: tokens x hidden x bf16
    for tiers in ("none", "split"):
        torch.manual_seed(0)
        model = tiny_llama(hidden=512, layers=4).cuda()
        enable_checkpointing(model)
        spill = ActivationFile(tmp_path / tiers)
        if tiers == "split":
            offload_checkpointed_inputs(model, device_layers=1, file_layers=2, spill=spill)
        ids = torch.randint(0, 256, (4, 1024), device="cuda")
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        loss = causal_lm_loss(model, ids, ids)
        held = torch.cuda.memory_allocated() - base  # what the forward keeps for backward
        loss.backward()
        torch.cuda.synchronize()
        results[tiers] = (held, loss.detach().cpu(), {n: p.grad.cpu() for n, p in model.named_parameters()})
        del loss
        gc.collect()
        assert spill.live == 0 and spill.written_bytes == spill.read_bytes
        assert spill.written_bytes >= (2 * inputs if tiers == "split" else 0)
        assert not (tmp_path / tiers).exists() or os.listdir(tmp_path / tiers) == []  # nameless while open
        spill.close()
    assert results["none"][0] - results["split"][0] >= 0.9 * 3 * inputs, (results["none"][0], results["split"][0])
    assert torch.equal(results["none"][1], results["split"][1])
    for name, grad in results["none"][2].items():
        assert torch.equal(grad, results["split"][2][name]), name


def test_the_disk_check_counts_the_spilled_layer_inputs(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    from neutrain.config import load_recipe
    from neutrain.errors import RecipeError
    from neutrain.trainer import disk_plan

    recipe = load_recipe("default", [f"train.output_dir={tmp_path / 'run'}", "train.max_steps=2",
                                     "train.save_steps=100", "train.save_final=false", "export.format=none"])
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _p: usage(100 << 30, 90 << 30, 10 << 30))
    model = tiny_llama()
    disk_plan.check_disk_space(recipe, model, 0, 0, 2)  # saves nothing: needs no room
    disk_plan.check_disk_space(recipe, model, 0, 0, 2, spill_bytes=9 << 30)
    with pytest.raises(RecipeError, match=r"train.output_dir: .* has 10.00 GiB free, and this run needs 10.50 GiB there "
                                          r"\(10.50 GiB of layer inputs spilled to a file under .cache"):
        disk_plan.check_disk_space(recipe, model, 0, 0, 2, spill_bytes=10 << 30)
