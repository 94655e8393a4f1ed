"""What every compressed module shares: state-dict hooks, optimizer binding, dense view.

A compressed module saves its weight as the codec's blobs under
``<prefix>weight.<blob>`` (plain tensors with a checksum, safetensors-ready), so
``model.state_dict()`` / ``load_state_dict()`` round-trip the compressed weights
bit-exactly without ever materialising a dense copy. Dense export goes through
:func:`neutrain.nn.decompressed_state_dict` instead.
"""

from __future__ import annotations

import torch


def save_blobs(weight, destination, key_prefix: str) -> None:
    """Put a compressed weight's codec blobs into ``destination`` as ``<key_prefix><blob>``."""
    for name, blob in weight.saved_ct().state_dict().items():
        destination[key_prefix + name] = blob


def load_blobs(weight, state_dict, key_prefix: str, missing_keys, error_msgs) -> None:
    """Replace a compressed weight's tensor by the blobs under ``key_prefix`` (checksums verified)."""
    from neutrain.compress import CompressedTensor

    blobs = {k[len(key_prefix):]: v for k, v in state_dict.items() if k.startswith(key_prefix)}
    if not blobs:
        missing_keys.append(key_prefix[:-1])
        return
    try:
        weight.replace_(CompressedTensor.from_state_dict(blobs, name=key_prefix[:-1], device=weight.device))
    except Exception as exc:  # report like torch does, all errors at once
        error_msgs.append(f"{key_prefix[:-1]}: {exc}")


def save_compressed_state(module, destination, prefix, keep_vars):
    """``_save_to_state_dict`` for compressed modules: the codec's blobs under ``weight.*``."""
    save_blobs(module.compressed, destination, prefix + "weight.")
    bias = getattr(module, "bias", None)
    if bias is not None:
        destination[prefix + "bias"] = bias if keep_vars else bias.detach()


def load_compressed_state(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                          error_msgs):
    """``_load_from_state_dict`` for compressed modules (inverse of :func:`save_compressed_state`)."""
    load_blobs(module.compressed, state_dict, prefix + "weight.", missing_keys, error_msgs)
    bias = getattr(module, "bias", None)
    if bias is not None:
        if prefix + "bias" in state_dict:
            with torch.no_grad():
                bias.copy_(state_dict[prefix + "bias"])
        else:
            missing_keys.append(prefix + "bias")



class CompressedModuleMixin:
    """Shared by :class:`CompressedLinear` and :class:`CompressedEmbedding` (which set
    ``self.compressed`` and ``self.weight_key``)."""

    @property
    def weight(self) -> torch.Tensor:
        """A fresh, detached dense copy of the weight (for inspection and export; never trained).

        Inside :func:`neutrain.nn.stand_in.shape_only_weights` it is a shape-only stand-in instead
        (no decode): wrappers such as peft read ``.weight`` only for its device and dtype.
        """
        from neutrain.nn.stand_in import WeightStandIn, stand_ins_active

        if stand_ins_active():
            return WeightStandIn(self.compressed.shape, self.compressed.dtype, self.compressed.device)
        return self.compressed.dense()

    def bind_fused_optimizer(self, optimizer) -> list[torch.Tensor]:
        """Called by ``FusedOptimizer.bind``; returns the keys this module feeds."""
        self.compressed.optimizer = optimizer
        return [self.weight_key]

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        save_compressed_state(self, destination, prefix, keep_vars)

    def _load_from_state_dict(self, state_dict, prefix, *args):
        load_compressed_state(self, state_dict, prefix, *args)
