"""The one consumer of a source's tensors: places them into a model skeleton, dense or compressed,
and hands each offloaded module to host memory once the last of its parameters is in.

The skeleton's parameters are on the meta device (buffers such as rotary frequencies are real).
Each tensor that arrives is renamed and merged as transformers' own loader does
(:mod:`neutrain.nn.checkpoint_keys`), checked against the parameter's shape and placed:

* dense: it becomes the parameter, in the compute dtype;
* compressed: a target weight (every ``nn.Linear``, the embedding, MoE expert stacks) is encoded at
  once and its dense tensor dropped, so peak memory is the compressed model plus about one dense
  tensor, never the dense model; a tensor that arrives already encoded (a neutrain checkpoint) is
  placed as it is, and decoded when the placement is dense;
* compressed and offloaded: as compressed, and each module the placement names (by default every
  decoder layer) moves to a :class:`~neutrain.nn.weight_offload.WeightOffload` when all of its
  parameters are placed, counted from the skeleton. Sources need not deliver a layer in one piece: a
  sharded checkpoint may split a layer across files, in any key order.

Example:
    >>> from accelerate import init_empty_weights
    >>> from transformers import AutoModelForCausalLM, LlamaConfig
    >>> from neutrain.nn.model_spec import Placement
    >>> from neutrain.nn.sources import RandomInit
    >>> cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
    ...                   num_key_value_heads=1, vocab_size=64)
    >>> with init_empty_weights(include_buffers=False):
    ...     skeleton = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    >>> sink = ModelSink(skeleton, Placement("neuzip-lossless", offload=True), codec_options={"steps": 16})
    >>> for name, tensor in RandomInit().tensors(skeleton, "cpu", torch.bfloat16):
    ...     sink.put(name, tensor)
    >>> model, report = sink.finish()
    >>> len(model._neutrain_weight_offload.layers), report.converted
    (2, 16)
"""

from __future__ import annotations

import logging
import re

import torch

from neutrain.compress import CompressedTensor, compress
from neutrain.config.layer_placement import LayerPlacement
from neutrain.errors import CheckpointError
from neutrain.nn.checkpoint_keys import CheckpointKeys
from neutrain.nn.convert import (
    CompressionReport,
    build_module,
    compressed_weights,
    default_targets,
    mark_large_weights,
    model_nbytes,
)
from neutrain.nn.experts import compress_expert_stack, expert_stacks
from neutrain.nn.model_spec import Placement
from neutrain.nn.weight import CompressedWeight
from neutrain.nn.weight_offload import WeightOffload
from neutrain.nn.weight_offload_model import attach, layer_names, ring_store

logger = logging.getLogger(__name__)


class ModelSink:
    """Places tensors into ``model`` (a meta-device skeleton) as ``placement`` says; see the module docstring.

    Args:
        model: the skeleton; its modules are swapped for compressed ones as tensors arrive.
        placement: dense, compressed or compressed and offloaded, and the device.
        storage_dtype: dtype of the compressed weights when it differs from the parameters' (compute) dtype.
        codec_options: extra arguments for ``neutrain.compress.compress``.
        source_keys: every tensor name the source will yield, when known (for merged MoE parameters).
    """

    def __init__(self, model: torch.nn.Module, placement: Placement, *, storage_dtype: torch.dtype | None = None,
                 codec_options: dict | None = None, source_keys: list[str] | None = None, label: str = "checkpoint"):
        self.model, self.placement, self.label = model, placement, label
        self.buffer_names = {n for n, _ in model.named_buffers()}
        self.skipped: list[str] = []
        self.device = placement.device
        self.storage_dtype, self.codec_options = storage_dtype, codec_options or {}
        for module in model.modules():
            for name, buffer in list(module._buffers.items()):
                if buffer is not None:
                    module._buffers[name] = buffer.to(self.device)
        self.targets = set(default_targets(model)) if placement.compressed else set()
        self.stacks = set(expert_stacks(model)) if placement.compressed else set()
        self.param_names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
        self.keys = CheckpointKeys(model, source_keys)
        self.placed: set[str] = set()
        self.dense_bytes = self.compressed_bytes = self.converted = 0
        self.store, units = None, ()
        if placement.offload and placement.host is not None:
            self.store, units = WeightOffload(self.device), placement.host
        elif placement.offload:  # decoder layers, spread evenly, with the ring the planner counted
            names = layer_names(model)
            spread = LayerPlacement.spread(len(names), placement.layers, placement.slots)
            self.store, units = ring_store(spread, self.device), [names[i] for i in spread.offloaded]
        # Offloaded module -> its parameters not placed yet. Under offload, a layer whose tensors are
        # spread across shards stays on the device until its last one arrives: at most the partial
        # layers of the shards read so far, in practice the one or two a shard boundary cuts.
        self.waiting: dict[str, set[str]] = {}
        self.unit_of: dict[str, str] = {}
        self.handed: set[int] = set()
        if self.store is not None:
            for unit in units:
                model.get_submodule(unit)  # an unknown name fails here, before anything is read
                params = {n for n in self.param_names if n.startswith(unit + ".")}
                self.waiting[unit] = params
                self.unit_of.update(dict.fromkeys(params, unit))

    def put(self, source_name: str, tensor) -> None:
        """Place one source tensor (a dense ``torch.Tensor`` or a ``CompressedTensor``)."""
        for name, value in self.keys.feed(source_name, tensor):
            matched = _match_name(name, self.param_names)
            if matched is None:
                self._unmatched(name)
                continue
            name = matched
            if name in self.placed:
                raise CheckpointError(f"checkpoint tensor {name} appears twice")
            self._place(name, value)
            del value
            self.placed.add(name)
            unit = self.unit_of.get(name)
            if unit is not None:
                self.waiting[unit].discard(name)
                if not self.waiting[unit]:
                    self._offload(unit)

    def _unmatched(self, name: str) -> None:
        """A source tensor the model has no parameter for: a buffer the model computes itself (a rotary table, a
        causal mask of old files, :data:`FOREIGN_EXTRAS`) is skipped and said at the end; any other is refused.

        Why: every such tensor was skipped in silence, so a file of another architecture, or one whose names a tool
        had changed, built a model with those weights left out of it (refused at the end only when a parameter
        then had no tensor) or, where the names still covered every parameter, dropped trained weights.
        """
        if _match_name(name, self.buffer_names) is not None or FOREIGN_EXTRAS.search(name):
            self.skipped.append(name)
            return
        raise CheckpointError(f"{self.label}: tensor '{name}' matches no parameter of the "
                              f"{getattr(self.model.config, 'model_type', 'model')} model its config builds (another "
                              "architecture's file, or renamed tensors); nothing was loaded")

    def _place(self, name: str, tensor) -> None:
        module_name, _, pname = name.rpartition(".")
        module = self.model.get_submodule(module_name)
        meta = module._parameters[pname]
        if tuple(tensor.shape) != tuple(meta.shape):
            raise CheckpointError(f"checkpoint tensor {name} has shape {tuple(tensor.shape)}; the model's "
                                  f"config needs {tuple(meta.shape)}")
        if meta.is_floating_point() and not tensor.dtype.is_floating_point:
            # The cast below would turn an integer tensor's values into weights: a header that says I32 where F32
            # was written made a model of reinterpreted bytes that generated, exit 0.
            raise CheckpointError(f"checkpoint tensor {name} holds {str(tensor.dtype).removeprefix('torch.')} values; "
                                  f"the model's parameter is floating point ({str(meta.dtype).removeprefix('torch.')})")
        stack = (module_name, pname) in self.stacks
        target = stack or (module_name in self.targets and pname == "weight")
        encoded = isinstance(tensor, CompressedTensor)
        if encoded and not target:
            tensor, encoded = tensor.decompress(), False  # a compressed run's weight, placed dense
        if encoded:
            self.dense_bytes += tensor.numel * tensor.dtype.itemsize
            compressed = CompressedWeight(tensor.to(self.device), name=name, compute_dtype=meta.dtype)
            values = None
        else:
            cast = self.storage_dtype if target and self.storage_dtype is not None else meta.dtype
            tensor = tensor.to(device=self.device, dtype=cast if meta.is_floating_point() else tensor.dtype)
            self.dense_bytes += tensor.numel() * tensor.element_size()
            if not target:
                module._parameters[pname] = torch.nn.Parameter(tensor, requires_grad=meta.requires_grad)
                return
            compressed = CompressedWeight(compress(tensor, name=name, **self.codec_options), name=name,
                                          compute_dtype=meta.dtype)
            values = tensor
        if stack:
            compress_expert_stack(module, pname, compressed)
        else:
            self.model.set_submodule(module_name, build_module(module, compressed, module_name, values))
        self.compressed_bytes += compressed.nbytes
        self.converted += 1

    def _offload(self, unit: str) -> None:
        """Move ``unit``'s compressed weights to host memory (once; a tied weight goes with its first unit)."""
        del self.waiting[unit]
        weights = [w for w in compressed_weights(self.model.get_submodule(unit)) if id(w) not in self.handed]
        if weights:
            self.handed.update(id(w) for w in weights)
            self.store.add_layer(weights)

    def finish(self):
        """Tie the head if the config says so, check that every parameter arrived, offload what is left.

        Returns:
            ``(model, report)``: the model (train mode) and a :class:`~neutrain.nn.convert.CompressionReport`
            (``bytes_before`` is the dense size the source's tensors take).
        """
        model = self.model
        _tie_if_configured(model)
        leftover = [n for n, p in model.named_parameters() if p.is_meta]
        if leftover:
            raise CheckpointError(f"{self.label}: no tensor for {len(leftover)} parameter(s) of the model, e.g. "
                                  f"{', '.join(leftover[:5])} (a file of another model, or cut short)")
        if self.skipped:
            logger.warning("%s: %d tensor(s) the model computes itself, not loaded: %s", self.label, len(self.skipped),
                           ", ".join(self.skipped[:5]) + (", ..." if len(self.skipped) > 5 else ""))
        for unit in list(self.waiting):  # only tied parameters (the lm_head) can still be waiting
            self._offload(unit)
        mark_large_weights(model)
        if self.store is not None:
            attach(model, self.store)
            logger.info("memory.offload_weights: %d layers, %.2f GiB in host memory", len(self.store.layers),
                        self.store.host_bytes / 2**30)
        model.train()
        buffers = sum(b.numel() * b.element_size() for b in model.buffers())
        report = CompressionReport(self.placement.weights, self.converted, self.dense_bytes + buffers,
                                   model_nbytes(model), self.dense_bytes, self.compressed_bytes)
        return model, report


def _tie_if_configured(model) -> None:
    """Share the embedding with the lm_head when the config ties them and the source omits it."""
    if not getattr(model.config, "tie_word_embeddings", False):
        return
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    if head is None:
        return
    head_weight = getattr(head, "compressed", None)
    if head_weight is None and not head.weight.is_meta:
        return  # the source carried its own lm_head
    name = next(n for n, m in model.named_modules() if m is head)
    if isinstance(getattr(embedding, "compressed", None), CompressedWeight):
        if head_weight is None:
            model.set_submodule(name, build_module(head, embedding.compressed))
    else:
        head.weight = embedding.weight


FOREIGN_EXTRAS = re.compile(r"(^|\.)(rotary_emb\.inv_freq|rope_freqs(\.weight)?|attn\.(masked_)?bias)$")
"""Tensors some files carry that no model parameter holds: rotary tables (old Llama checkpoints' ``inv_freq``, a
GGUF file's ``rope_freqs``) and GPT-2's causal-mask buffers, which the model computes itself."""


def _match_name(name: str, param_names: set[str]) -> str | None:
    if name in param_names:
        return name
    for candidate in (f"model.{name}", name.removeprefix("model.")):
        if candidate in param_names:
            return candidate
    return None
