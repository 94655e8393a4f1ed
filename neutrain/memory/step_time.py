"""The step-time model: how long one training step of a configuration takes, predicted from its shape.

Why: the automatic fit (:mod:`neutrain.memory.fit`) chooses between configurations that all fit the
card (dense or NeuZip weights, k layers streamed from host memory, activations offloaded, a smaller
micro-batch) and they train the same model, so the one to take is the fastest. Bytes over PCIe alone do
not say that: at batch 1 the 8B's step is set by the host (one Python launch chain per weight), at batch
8 by the device, and NeuZip adds codec work on both sides.

One step is ``max(host, device) + link`` (on a CPU, where host and device are one, ``host + device``):

* ``device``: the step's matrix products (decoder and lm_head matrices, then attention, which runs at
  its own rate) over a measured rate, plus bytes over bandwidth: each fused update reads the weight and
  its gradient and writes the weight back; NeuZip decodes each matrix :attr:`Rates.decodes_checkpointed`
  times a step and re-encodes it once;
* ``host``: a launch and Python cost per trained tensor, more for a compressed one (decode, update,
  re-encode launched from Python);
* ``link``: the PCIe bytes of the step (weights streamed both ways, activations out and back) that the
  copy streams do not hide behind compute (:data:`COPY_HIDDEN_SHARE`).

Every rate is a constant below, in one place, each with the record it was calibrated on: after new GPU
runs, recalibrating is an edit here (``tests/unit/memory/test_step_time.py`` holds the model within 15%
of the training steps of ``benchmarks/memory/results.jsonl#train_memory`` and of the timing rows of
``benchmarks/cards/results.jsonl#cards`` that ran the current code's paths, and says which row a new constant misses).

Example:
    >>> from neutrain.config import load_recipe
    >>> t = recipe_step_time(load_recipe("llama3_8b", ["memory.weights=neuzip-lossless"]))
    >>> round(t.host_s, 2), round(t.device_s, 2), t.bound  # batch 1: the host sets the pace
    (0.42, 0.26, 'host')
    >>> 2300 < t.tokens_per_s < 2550  # train_memory.json measured 2,420 tok/s
    True
"""

from __future__ import annotations

from dataclasses import dataclass

from neutrain.optim.registry import optimizer_spec
from neutrain.memory.planner import Estimate, estimate_recipe
from neutrain.memory.shape import ModelShape, recipe_shape

GEMM_FLOPS_PER_S = 515e12
"""Matrix products of a training step, bf16, per second on an H200. Calibrated on
benchmarks/memory/results.jsonl#train_memory, variant c (dense fused LOMO, Llama-3-8B shapes, batch 8 x 1024,
checkpointing) at batch 8: a 0.992 s step, device-bound (its profile: 967 ms busy), less its update and
attention."""

ATTENTION_FLOPS_PER_S = 245e12
"""Attention's products (causal, counted as if each row were one document; forward, recompute and a
backward of 2.5 forwards) per second on an H200. Calibrated on benchmarks/offload/results.jsonl#offload,
``70b_recipe.train.tokens_per_s`` (609.7 at 16K tokens, every layer streamed), where attention is 13% of
the step's products; at 1K tokens it is 2%, so the 8B records barely constrain it."""

MEMORY_BYTES_PER_S = 3.81e12
"""Device memory traffic (read plus write) per second on an H200: benchmarks/codec/results.jsonl#codec,
``summary.copy_TBps_out`` 1.905 TB/s written, as much read. The fused updates' bytes go over it."""

CODEC_BYTES_PER_S = 333e9
"""Dense bytes NeuZip decodes or re-encodes per second inside a training step on an H200 (each decode
and the re-encode of every matrix counted). Calibrated on the NeuZip step over the dense one at batch 8:
benchmarks/cards/results.jsonl#cards ``timing.b8_none`` (7,002 tok/s, 1.170 s) against train_memory.json c at
batch 8 (0.992 s). The codec's kernels alone run faster (codec.json: decode 0.94 TB/s, re-encode 0.48 TB/s,
50 ms a step for the 8B); in the step they cost 178 ms, their synchronous launches included."""

HOST_S_PER_TENSOR = 1.13e-3
"""Host seconds per trained tensor per micro-batch (forward, recompute and backward launches, the fused
update's Python): a dense 8B step at batch 1 is host-bound, 330 ms for 291 tensors in the
benchmarks/memory/step_timeline.py profile on an H200 at a73232e (157 ms of it device-busy, 12,691 kernels);
the committed record, train_memory.json c at batch 1 (dcf57b4), measured 308 ms."""

HOST_S_PER_COMPRESSED = 1.11e-3
"""Host seconds a NeuZip matrix adds per micro-batch (its decodes, update and re-encode launched from
Python). Calibrated on benchmarks/cards/results.jsonl#cards ``timing.b1_none`` (the NeuZip recipe at batch 1,
1,764.6 tok/s: 580 ms, host-bound) against the dense host cost above, over the 8B's 226 matrices; the
step_timeline profile at a73232e measured 565 ms."""

HOST_S_PER_GROUPED = 4.16e-4
"""Host seconds a NeuZip matrix adds per micro-batch when its decoder layer is decoded and re-encoded as a
group (:mod:`neutrain.nn.groups`: grouped launches, no per-matrix slot bookkeeping; the layers of a model none
of whose layers live in host memory). Calibrated on benchmarks/memory/results.jsonl#train_memory (c0ee2cc), d at
batch 1 (2,420 tok/s: 423 ms, host-bound) against the dense host cost above, over the 8B's 226 matrices. The
batch-1 figures move between calls (the same commit's first call measured d 404 ms, c 376 ms)."""

CODEC_BYTES_PER_S_GROUPED = 391e9
"""As :data:`CODEC_BYTES_PER_S`, for grouped layers: benchmarks/memory/results.jsonl#train_memory (c0ee2cc), d
against c at batch 8 (1.106 s against 0.991 s), three dense passes (two decodes and the re-encode) of the 8B's
matrices in the 115 ms between them (the per-tensor clip's second lm_head pass, about 17 ms, folded in)."""

DECODES_GROUPED = 2.0
"""Decodes per matrix per step for grouped layers, with or without checkpointing: the forward's, and the
recompute's or (without checkpointing) the backward's own, the loss's vocabulary matrix having taken the group
buffer in between (train_memory.json's d: ``decodes_per_step.sync`` 450, the 224 decoder matrices twice and the two vocabulary
matrices)."""

PCIE_BYTES_PER_S = 50.69e9
"""Host-device copy bandwidth, each way while both run, on an H200: benchmarks/offload/results.jsonl#offload,
``link.both_ways_gb_s_each``."""

DISK_BYTES_PER_S = 2.0e9
"""Bytes per second a file of spilled layer inputs is written at in forward and read back at in backward
(:mod:`neutrain.memory.tiers`). An assumption, not a measurement: a PCIe 4.0 NVMe drive's sustained sequential
rate through the page cache, below its 5-7 GB/s peak. Not calibrated yet: the record to calibrate it on is
benchmarks/memory/results.jsonl#train_70b once it holds the 70B at a 22 GiB budget on a short host
(``card_24gb_70b_host_gib``, benchmarks/memory/train_70b.py). Charged in full: the writes and reads go through one
staging buffer on the step's own stream, so no compute hides them."""

COPY_HIDDEN_SHARE = 0.794
"""Share of the step's copy time that overlapped compute in the 8B's step with every layer streamed and
activations offloaded (H200, batch 8 x 1024: benchmarks/offload/results.jsonl#offload,
``8b.offloaded.timeline.copy_hidden_share``). Applied to every copied byte, weights and activations:
cards.json's ``b8_7`` (activations and 27 layers offloaded) took 34 ms more than ``b8_none``, less than
its activation copies alone would cost unhidden (about 85 ms)."""

DECODES_CHECKPOINTED = 2.7
"""NeuZip decodes per matrix per step with activation checkpointing: train_memory.json d,
``decodes_per_step.sync`` 611 over the 8B's 226 matrices (forward, recompute, and backward where the
recompute's buffer was reused)."""

DECODES_UNCHECKPOINTED = 2.0
"""Without checkpointing on a GPU: forward and backward, the two-slot decode pool keeping no layer between
them (cpu_train.json measured 1.9 with the GPU's slots on a CPU, ``decodes_per_weight_per_step``)."""

CPU_FLOPS_PER_S = 299e9
"""A whole training step's products per second on a 2-core CPU with AMX (bf16), host work folded in:
benchmarks/training/results.jsonl#cpu_train ``real_model`` (SmolLM2-135M, batch 16 x 128, dense AdaLomo, 363.3
tok/s). Large matrices multiply faster (about 2 TFLOP/s for one 4096 x 14336 product there), so for an
8B this rate overstates the step, likely by 1.5-3x; at a few hundred tokens a step Python's per-operation cost
dominates and it understates it (the cards benchmark's CPU smoke run, 64 tokens a step, took 10x longer). It
only has to tell seconds from minutes."""

CPU_CODEC_BYTES_PER_S = 569e6
"""Dense bytes the CPU codec decodes or re-encodes per second in a step: cpu_train.json ``real_model``,
compressed (311.1 tok/s) against dense (363.3), one decode and one re-encode of 135M weights a step
(``decodes_per_weight_per_step`` 1.0: a CPU keeps the decoded weight from forward to backward)."""

HOST_S_PER_MLP_CHUNK = 1.5e-4
"""Host seconds one chunk of a sequence-chunked MLP (:mod:`neutrain.nn.chunked_mlp`) costs per decoder layer per
micro-batch: about 17 launches from Python (its forward's five, its backward's twelve) at some 9 us each, the
per-launch cost of benchmarks/memory/results.jsonl#train_memory's host-bound batch-1 step
(:data:`HOST_S_PER_TENSOR`: 12,691 kernels in 330 ms, about 26 us a kernel with its Python, a third of it the
launch). Derived, not measured on a chunked run: the cards benchmark's ``b8_5`` timing calibrates it."""

ORDINARY_UPDATE_PASSES = {"adamw": 7, "sgd": 3}
"""Weight-sized passes over device memory per update of the Trainer's own optimizers: SGD 3 (read the weight and
its gradient, write the weight, as LOMO and AdaLomo do, part of the record GEMM_FLOPS_PER_S is calibrated on);
AdamW 7, also reading and writing its two moments (derived, not measured). A fused optimizer's passes are its
spec's ``update_passes`` (:mod:`neutrain.optim.registry`)."""


def update_passes(optimizer: str) -> int:
    """Weight-sized passes over device memory of one update by ``optimizer``.

    Example:
        >>> update_passes("adamw"), update_passes("lomo"), update_passes("adamw-in-backward")
        (7, 3, 7)
    """
    if optimizer in ORDINARY_UPDATE_PASSES:
        return ORDINARY_UPDATE_PASSES[optimizer]
    return optimizer_spec(optimizer).update_passes


@dataclass(frozen=True)
class Rates:
    """One device's rates (see the constants above)."""

    name: str
    gemm_flops_per_s: float
    attention_flops_per_s: float
    memory_bytes_per_s: float | None  # None: folded into the FLOP rate (the CPU's is a whole step's)
    codec_bytes_per_s: float
    host_s_per_tensor: float
    host_s_per_compressed: float
    link_bytes_per_s: float
    decodes_checkpointed: float
    decodes_uncheckpointed: float
    serial: bool  # host and device are one: their times add
    disk_bytes_per_s: float = DISK_BYTES_PER_S


GPU = Rates("H200", GEMM_FLOPS_PER_S, ATTENTION_FLOPS_PER_S, MEMORY_BYTES_PER_S, CODEC_BYTES_PER_S,
            HOST_S_PER_TENSOR, HOST_S_PER_COMPRESSED, PCIE_BYTES_PER_S, DECODES_CHECKPOINTED,
            DECODES_UNCHECKPOINTED, serial=False)
CPU = Rates("this CPU", CPU_FLOPS_PER_S, CPU_FLOPS_PER_S, None, CPU_CODEC_BYTES_PER_S, 0.0, 0.0, float("inf"),
            2.0, 1.0, serial=True)


@dataclass(frozen=True)
class StepTime:
    """A step's predicted parts (seconds) and what they give."""

    host_s: float
    device_s: float
    link_s: float
    tokens: int
    serial: bool = False
    disk_s: float = 0.0  # layer inputs spilled to a file, written and read back

    @property
    def step_s(self) -> float:
        inner = self.host_s + self.device_s if self.serial else max(self.host_s, self.device_s)
        return inner + self.link_s + self.disk_s

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_s

    @property
    def bound(self) -> str:
        """What sets the pace: ``host``, ``device`` or ``link``."""
        if self.disk_s > max(self.host_s, self.device_s, self.link_s):
            return "disk"
        if self.link_s > max(self.host_s, self.device_s):
            return "link"
        return "host" if self.host_s > self.device_s else "device"

    def as_dict(self) -> dict[str, float | str]:
        return {"step_s": self.step_s, "tokens_per_s": self.tokens_per_s, "host_s": self.host_s,
                "device_s": self.device_s, "link_s": self.link_s, "bound": self.bound,
                **({"disk_s": self.disk_s} if self.disk_s else {})}


def step_flops(shape: ModelShape, batch: int, seq: int, checkpointing: bool) -> tuple[float, float]:
    """``(matrix products, attention products)`` of one micro-batch's forward and backward, in FLOPs.

    A product of an ``m x k`` by a ``k x n`` matrix is ``2mkn``; backward is twice the forward for a
    matrix and 2.5 times for attention; checkpointing runs the decoder layers' forward again.

    Example:
        >>> shape = ModelShape(4096, 14336, 32, 32, 8, 128256, False, 128)  # Llama-3-8B
        >>> gemm, attention = step_flops(shape, 1, 1024, True)
        >>> round(gemm / 1e12, 1), round(attention / 1e12, 2)
        (60.4, 1.24)
    """
    tokens = batch * seq
    vocab_matrices = 1 if shape.tied else 2
    decoder = shape.matrix_params() - vocab_matrices * shape.vocab * shape.hidden
    passes = 4 if checkpointing else 3
    gemm = (2 * decoder * passes + 2 * shape.vocab * shape.hidden * 3) * tokens
    # Causal: each token's query meets seq / 2 keys on average, in QK^T and again in PV.
    attention = 2 * seq * shape.heads * shape.head_dim * shape.layers * tokens * (passes + 0.5)
    return gemm, attention


def step_time(train: Estimate, shape: ModelShape, rates: Rates = GPU, accumulation: int = 1) -> StepTime:
    """Predict one optimizer step of the configuration whose training-step estimate is ``train``.

    Args:
        train: :func:`~neutrain.memory.planner.estimate`'s result (its settings say the batch, weights,
            optimizer, checkpointing and the PCIe bytes).
        shape: The model's shape.
        rates: :data:`GPU` or :data:`CPU`.
        accumulation: Micro-batches per step (each runs forward and backward; the update runs once).
    """
    s = train.settings
    compressed = str(s["weights"]).startswith("neuzip")
    grouped = compressed and "vocab_slot" in train.terms  # the planner's sign of layer groups
    ckpt = bool(s["checkpointing"])
    gemm, attention = step_flops(shape, s["batch"], s["seq"], ckpt)
    matrices = 7 * shape.layers + (1 if shape.tied else 2)
    tensors = matrices + 2 * shape.layers + 1  # and the norms
    params = shape.params()
    weight_bytes = s.get("bits_per_weight", 16) / 8 if not compressed else 2  # the update runs on the decoded bf16
    device = accumulation * (gemm / rates.gemm_flops_per_s + attention / rates.attention_flops_per_s)
    if rates.memory_bytes_per_s is not None:
        passes = update_passes(s["optimizer"])
        accumulated = (accumulation - 1) * 8 if accumulation > 1 else 0  # an fp32 sum read and written
        device += params * (passes * weight_bytes + accumulated) / rates.memory_bytes_per_s
    if compressed:
        if grouped and not rates.serial:
            decodes, codec_rate, per_matrix = DECODES_GROUPED, CODEC_BYTES_PER_S_GROUPED, HOST_S_PER_GROUPED
        else:
            decodes = rates.decodes_checkpointed if ckpt else rates.decodes_uncheckpointed
            codec_rate, per_matrix = rates.codec_bytes_per_s, rates.host_s_per_compressed
        dense = shape.matrix_params() * 2
        device += (accumulation * decodes + 1) * dense / codec_rate
    host = accumulation * (tensors * rates.host_s_per_tensor + (matrices * per_matrix if compressed else 0))
    chunk = s.get("mlp_chunk_tokens") or 0  # estimates built before the key have none
    if chunk:
        # Same products as unchunked (the chunks' gate and up run in backward instead of the recompute), but
        # each chunk is launched from Python, and the three weight gradients are read and written once a chunk.
        chunks = -(-s["batch"] * s["seq"] // chunk)
        host += accumulation * chunks * shape.layers * HOST_S_PER_MLP_CHUNK * (rates.host_s_per_tensor > 0)
        if s.get("mlp_two_pass"):  # the second pass computes gate's and up's products again
            device += accumulation * shape.layers * 2 * 2 * s["batch"] * s["seq"] * shape.hidden * shape.intermediate \
                / rates.gemm_flops_per_s
        if rates.memory_bytes_per_s is not None:
            grad_bytes = 3 * shape.hidden * shape.intermediate * 2
            device += accumulation * shape.layers * chunks * 2 * grad_bytes / rates.memory_bytes_per_s
    spilled = s.get("file_activation_bytes", 0)  # through the host on their way to the file, and back
    copied = (s.get("h2d_bytes_per_step", 0) + s.get("d2h_bytes_per_step", 0)
              + 2 * (s.get("host_activation_bytes", 0) + spilled))
    link = (1 - COPY_HIDDEN_SHARE) * copied / rates.link_bytes_per_s
    disk = accumulation * 2 * spilled / rates.disk_bytes_per_s
    return StepTime(host, device, link, accumulation * s["batch"] * s["seq"], rates.serial, disk)


def recipe_step_time(recipe, rates: Rates = GPU, shape: ModelShape | None = None) -> StepTime:
    """:func:`step_time` of a recipe as it is (its ``memory.weights`` resolved: ``auto`` is not a storage).

    Example:
        >>> from neutrain.config import load_recipe
        >>> dense = recipe_step_time(load_recipe("llama3_8b", ["memory.weights=dense"]))
        >>> round(dense.step_s, 2), dense.bound
        (0.33, 'host')
    """
    shape = shape or recipe_shape(recipe)
    return step_time(estimate_recipe(recipe, shape), shape, rates, recipe.train.gradient_accumulation_steps)


def rate(tokens_per_s: float) -> str:
    """Tokens per second as the run's lines print them.

    Example:
        >>> rate(3114.07), rate(4.97), rate(0.028)
        ('3,114', '5.0', '0.028')
    """
    return f"{tokens_per_s:,.0f}" if tokens_per_s >= 10 else f"{tokens_per_s:.2g}" if tokens_per_s < 1 else f"{tokens_per_s:.1f}"


def duration(seconds: float) -> str:
    """A step's time as people say it.

    Example:
        >>> duration(0.333), duration(42.0), duration(206.0), duration(7300.0)
        ('0.33 s', '42 s', '3 min 26 s', '2 h 1 min')
    """
    if seconds < 10:
        return f"{seconds:.2f} s"
    if seconds < 60:
        return f"{seconds:.0f} s"
    minutes, secs = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {secs} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min"
