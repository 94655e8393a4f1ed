"""Where checkpointed layers' saved inputs wait between forward and backward: the GPU, host memory, a file.

Why: with activation checkpointing each decoder layer keeps its input for the recompute. Offloading them
all to pinned host memory (``memory.offload_activations``) costs the host ``layers x tokens x hidden``
bytes: 20 GiB for the 70B at 16K tokens, on top of the 88 GiB its streamed weights pin, more than a 128 GB
workstation can give. Where the host is that short, the fit splits the inputs over three tiers, fastest
first:

* **the GPU**: the inputs of the last layers (their backward comes first) stay on the device, as many as
  the device budget's room left by the rest of the step holds;
* **host memory**: as many as the host holds beside the pinned weights and the process itself
  (:data:`HOST_PROCESS_BYTES`);
* **a file** under the run's own folder (:data:`ACTIVATION_FILE`, :mod:`neutrain.nn.activation_file`): the
  rest, the first layers', whose backward comes last. It is written through a small pinned staging buffer
  and read back in backward, at a disk's rate (:data:`~neutrain.memory.step_time.DISK_BYTES_PER_S`).

With host memory to spare nothing is split: every offloaded input goes to host memory, as before.

Example:
    >>> tiers = split(80, 256 << 20, device_room=3.9 * GIB, host_room=3.5 * GIB)
    >>> tiers.device, tiers.host, tiers.file
    (15, 13, 52)
    >>> tiers.clause("outputs/run")
    'layer inputs: 15 on the GPU, 13 in host memory, 52 in a file under outputs/run/.cache'
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from neutrain.memory.planner import ACTIVATION_STAGING_BYTES, GIB

ACTIVATION_FILE = ".cache/activations"
"""The file the spilled layer inputs go to, under ``train.output_dir`` (one per process: the rank is appended)."""

HOST_PROCESS_BYTES = 8 * GIB
"""Host memory the training process needs for itself beside what it pins: Python, torch and the CUDA
driver's host side, the tokenizer and the dataset; the fit leaves this much of the host's memory free when it
pins host memory. Read, not fitted: the 70B recipe's training at 22 GiB used 116.66 GiB of host memory at its
peak with 108.43 GiB pinned, and 3.36 GiB were in use once every command had ended
(benchmarks/offload/results.jsonl#offload, ``70b_recipe_22gib.samples``), so about 4.9 GiB was the process's
own; 8 GiB leaves room for a larger dataset or tokenizer. To calibrate with ``card_24gb_70b_host_gib``
(benchmarks/memory/gpu_70b_recipe.sh at ``HOST_LIMIT_GIB=100``), which measures it with the split in place."""


@dataclass(frozen=True)
class ActivationTiers:
    """How many decoder layers keep their saved inputs on the GPU, in host memory and in a file."""

    device: int
    host: int
    file: int

    @property
    def layers(self) -> int:
        return self.device + self.host + self.file

    def clause(self, run: str = "RUN") -> str:
        """The tiers as the fit's line names them (``run``: the run's folder)."""
        parts = [f"{self.device} on the GPU"] if self.device else []
        parts.append(f"{self.host} in host memory")
        if self.file:
            parts.append(f"{self.file} in a file under {run.rstrip('/')}/.cache")
        return "layer inputs: " + ", ".join(parts)

    def as_dict(self) -> dict[str, int]:
        return {"device": self.device, "host": self.host, "file": self.file}


def split(layers: int, layer_bytes: float, device_room: float, host_room: float) -> ActivationTiers | None:
    """The fastest split of ``layers`` layers' inputs (``layer_bytes`` each) that fits the rooms (bytes).

    The GPU takes what ``device_room`` holds, host memory what ``host_room`` holds of the rest, a file the
    remainder (then ``host_room`` also holds the staging buffer). None: the host cannot even hold the
    staging buffer.

    Example:
        >>> split(80, GIB, device_room=100 * GIB, host_room=0)
        ActivationTiers(device=80, host=0, file=0)
        >>> split(4, GIB, device_room=0, host_room=1 * GIB)  # one in host memory would leave no staging room
        ActivationTiers(device=0, host=0, file=4)
        >>> split(4, GIB, device_room=0, host_room=0) is None
        True
    """
    device = max(0, min(layers, math.floor(max(0.0, device_room) / layer_bytes)))
    rest = layers - device
    host = max(0, min(rest, math.floor(max(0.0, host_room) / layer_bytes)))
    if host < rest:  # a file: the staging buffer is pinned too
        if host_room < ACTIVATION_STAGING_BYTES:
            return None
        host = max(0, min(rest, math.floor((host_room - ACTIVATION_STAGING_BYTES) / layer_bytes)))
    return ActivationTiers(device, host, rest - host)
