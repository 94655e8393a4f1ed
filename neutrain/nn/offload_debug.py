"""``NEUTRAIN_OFFLOAD_SYNC_DEBUG=1``: find which weight-offload call a CUDA fault comes from, in one run.

A weight offload (:mod:`neutrain.nn.weight_offload`) works on three streams (compute, host-to-device,
device-to-host) and never waits for the device, so a fault (``an illegal memory access was
encountered``) surfaces at some later, unrelated call: the Llama-3-8B's first offloaded step reported
one in the activation offload's copy. ``CUDA_LAUNCH_BLOCKING=1`` would serialise every kernel of the
run (and changes the timing that such races depend on). This switch instead, after each fetch of a
layer, each decode of an offloaded weight and each write-back,

* waits for the device and, if it faulted, raises :class:`OffloadFaultError` naming the call, the layer
  and the weight;
* after a fetch or a write-back, compares the weight's payload on the device with its host bytes
  (they must be equal then: the host store is the source of truth) and names the first tensor and
  index that differ, so a slot overwritten by another stream's work is caught before the decode
  kernel reads a corrupt tile table.

Slow (a device synchronisation and a payload comparison per call): for debugging only. On CPU the
comparisons run too, which is how the tests check this module.

Example:
    >>> import os
    >>> os.environ[ENV] = "1"; enabled()
    True
    >>> del os.environ[ENV]; enabled()
    False
"""

from __future__ import annotations

import torch

from neutrain.config.knobs import knob

ENV = "NEUTRAIN_OFFLOAD_SYNC_DEBUG"
PAYLOAD = ("stream", "tails", "lane_words", "tile_base")


class OffloadFaultError(RuntimeError):
    """The device faulted during, or a payload was corrupted by, the weight-offload call named in the message."""


def enabled() -> bool:
    """Whether ``NEUTRAIN_OFFLOAD_SYNC_DEBUG`` asks for the checks (a true boolean: 1, true, yes, on)."""
    return knob(ENV)


def check(store, what: str, weight) -> None:
    """Wait for ``store``'s device after ``what`` (``fetch``, ``decode``, ``write-back``) of ``weight``;
    after a fetch or write-back also compare the weight's device payload with its host bytes."""
    layer = weight._offload_layer
    label = f"{what} of layer {layer.index} weight {weight.name or '<unnamed>'} (slot {layer.slot})"
    if store.cuda:
        try:
            torch.cuda.synchronize(store.device)
        except RuntimeError as exc:  # torch.AcceleratorError is one
            first = (str(exc).splitlines() or [type(exc).__name__])[0]
            raise OffloadFaultError(f"weight offload: the device faulted by the end of the {label}: {first}") from exc
    if what == "decode":
        return
    for name in PAYLOAD:
        device, host = getattr(weight.ct, name), weight._host[name]
        same = device.shape == host.shape and torch.equal(device, host.to(device.device))
        if not same:
            raise OffloadFaultError(f"weight offload: after the {label}, its {name} on the device "
                                    f"({_describe(device, host)}) differs from the host store's")


def _describe(device: torch.Tensor, host: torch.Tensor) -> str:
    if device.shape != host.shape:
        return f"{tuple(device.shape)} elements against {tuple(host.shape)}"
    index = int((device.cpu().view(-1) != host.view(-1)).nonzero()[0, 0])
    return f"element {index}: {device.view(-1)[index].item()} against {host.view(-1)[index].item()}"
