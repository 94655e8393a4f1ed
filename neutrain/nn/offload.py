"""Activation offload: checkpointed layers keep their saved inputs in pinned host memory.

With activation checkpointing every decoder layer still keeps its input alive for
the recompute: ``layers x tokens x hidden`` bf16, 40 GiB for Llama-3-70B at 32K
tokens, which is what stops a 70B step at long context on one H200
(``benchmarks/memory/results.jsonl#train_70b``). :func:`offload_checkpointed_inputs` wraps
each layer's checkpoint in :class:`HostStash`, a ``saved_tensors_hooks`` pair that
copies every tensor the checkpoint saves to pinned host memory in forward and
back in backward (its recompute), so the GPU holds one layer's working set instead.
The copies run on the current stream (about 1.5 s per 40 GiB each way over PCIe 5);
the values are the same bytes, so training is bit-identical with and without it.

Where the host cannot hold every input, the fit (:mod:`neutrain.memory.tiers`) keeps the last layers' on
the GPU (their backward comes first) and sends the first layers' on to a file
(:mod:`neutrain.nn.activation_file`; their backward comes last): ``device_layers`` and ``file_layers``
of :func:`offload_checkpointed_inputs`.

transformers 5.24 has the same switch (``activation_checkpointing_enable(offload=True)``,
through ``torch.autograd.graph.save_on_cpu``); 5.17, on the GPU image, does not.

Example:
    >>> import torch
    >>> from transformers import LlamaConfig, AutoModelForCausalLM
    >>> cfg = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
    ...                   num_attention_heads=2, num_key_value_heads=1, vocab_size=40)
    >>> model = AutoModelForCausalLM.from_config(cfg).train()
    >>> model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    >>> offload_checkpointed_inputs(model)
    2
"""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel

from neutrain.nn.activation_file import ActivationFile, FileStash

_OFFLOADED = "_neutrain_offloaded"


class HostStash(torch.autograd.graph.saved_tensors_hooks):
    """Saved tensors of a device go to (pinned) host memory and come back when backward needs them.

    Host tensors are kept as they are. ``packed``/``packed_bytes`` count what was moved.
    """

    def __init__(self):
        self.packed = 0
        self.packed_bytes = 0

        def pack(tensor: torch.Tensor):
            if tensor.device.type == "cpu":
                return None, tensor
            host = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, pin_memory=True)
            host.copy_(tensor, non_blocking=True)
            self.packed += 1
            self.packed_bytes += tensor.numel() * tensor.element_size()
            return tensor.device, host

        def unpack(packed):
            device, host = packed
            return host if device is None else host.to(device, non_blocking=True)

        super().__init__(pack, unpack)


def offloaded_checkpoint(function, *args, _stash=HostStash, **kwargs):
    """``torch.utils.checkpoint.checkpoint`` whose saved inputs live in host memory (see the module docstring);
    ``_stash`` makes the hooks that move them (a file's: :class:`~neutrain.nn.activation_file.FileStash`)."""
    stash = _stash()
    with stash:
        out = checkpoint(function, *args, **kwargs)
    STATS.calls += 1
    STATS.packed += stash.packed
    STATS.packed_bytes += stash.packed_bytes
    return out


class OffloadStats:
    """Checkpointed calls, and tensors and bytes sent to host memory, by :func:`offloaded_checkpoint` since :meth:`reset`."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.calls = 0
        self.packed = 0
        self.packed_bytes = 0


STATS = OffloadStats()


def offload_checkpointed_inputs(model: torch.nn.Module, device_layers: int = 0, file_layers: int = 0,
                                spill: ActivationFile | None = None, spill_host_tensors: bool = False) -> int:
    """Make every checkpointed layer of ``model`` keep its saved inputs in host memory; return their number.

    ``device_layers``: the last this many layers keep theirs on the device (a plain checkpoint);
    ``file_layers``: the first this many send theirs on to ``spill`` (needed then; ``spill_host_tensors``:
    a CPU model's too, which tests use to run the file on a CPU). Call after activation
    checkpointing is enabled (``gradient_checkpointing_enable`` or the Trainer's ``gradient_checkpointing``);
    the checkpoint's own options (``use_reentrant=False``) are kept. Raises ``ValueError`` if no layer is
    checkpointed, or ``file_layers`` without a file.
    """
    if file_layers and spill is None:
        raise ValueError("file_layers needs an ActivationFile to spill to")
    found = []
    for module in model.modules():
        func = getattr(module, "_gradient_checkpointing_func", None)
        if getattr(module, "gradient_checkpointing", False) and func is not None:
            found.append(module)
    layers = [m for m in found if not isinstance(m, PreTrainedModel)]
    if not layers:
        raise ValueError("no checkpointed layer to offload: enable activation checkpointing first "
                         "(memory.gradient_checkpointing: true)")
    tier = {id(m): "host" for m in found}  # the model carries the function too (which one calls it changed
    for i, module in enumerate(layers):    # across transformers versions): its own calls go to host memory
        tier[id(module)] = ("file" if i < file_layers else "device" if i >= len(layers) - device_layers else "host")
    for module in found:
        func = module._gradient_checkpointing_func
        if getattr(func, _OFFLOADED, False):
            continue  # wrapped once: its tier stays
        keywords = dict(getattr(func, "keywords", None) or {})
        where = tier[id(module)]
        if where == "device":
            wrapped = functools.partial(checkpoint, **keywords)
        elif where == "file":
            wrapped = functools.partial(offloaded_checkpoint, _stash=functools.partial(FileStash, spill, spill_host_tensors),
                                        **keywords)
        else:
            wrapped = functools.partial(offloaded_checkpoint, **keywords)
        setattr(wrapped, _OFFLOADED, True)
        module._gradient_checkpointing_func = wrapped
    return len(layers)
