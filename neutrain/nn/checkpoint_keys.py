"""Checkpoint tensors -> model parameters, as transformers' loader maps them, one target at a time.

transformers 5 renames some checkpoint keys and merges others while loading (MoE
checkpoints store each expert's projections separately; the model holds one 3-D
stack per layer). :class:`CheckpointKeys` applies transformers' own conversion
mapping (:func:`neutrain.compat.weight_conversions`) to a stream of tensors:
a merged parameter is built as soon as its last source tensor arrives, so at most
one layer's expert tensors are held dense at a time.

Example:
    >>> import torch
    >>> from transformers import MixtralConfig, AutoModelForCausalLM
    >>> cfg = MixtralConfig(hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
    ...                     num_key_value_heads=1, vocab_size=16, num_local_experts=2)
    >>> model = AutoModelForCausalLM.from_config(cfg)
    >>> name = "model.layers.0.block_sparse_moe.experts.{}.{}.weight"
    >>> keys = CheckpointKeys(model, [name.format(e, w) for e in range(2) for w in ("w1", "w3")])
    >>> keys.feed(name.format(0, "w1"), torch.zeros(16, 8))
    []
    >>> out = [o for e in range(2) for w in ("w1", "w3") for o in keys.feed(name.format(e, w), torch.zeros(16, 8))]
    >>> [(k, tuple(v.shape)) for k, v in out]
    [('model.layers.0.mlp.experts.gate_up_proj', (2, 32, 8))]
"""

from __future__ import annotations

import copy

import torch

from neutrain import compat
from neutrain.errors import CheckpointError


class CheckpointKeys:
    """Streaming key mapping for one model and one checkpoint.

    Args:
        model: the (meta) model being loaded.
        source_keys: every tensor name of the checkpoint (known before any tensor is read,
            from the safetensors headers), or None when names already are the model's.
    """

    def __init__(self, model: torch.nn.Module, source_keys: list[str] | None):
        self.model = model
        self._direct: dict[str, str] = {}
        self._pattern_of: dict[str, str] = {}  # source key -> converter pattern it matched
        self._target_of: dict[str, str] = {}  # source key -> merged parameter it feeds
        self._converters: dict[str, object] = {}  # merged parameter -> its converter
        self._waiting: dict[str, set[str]] = {}  # merged parameter -> source keys not yet fed
        self._held: dict[str, dict[str, torch.Tensor]] = {}
        if not source_keys:
            return
        renamings, converters = compat.weight_conversions(model)
        if not renamings and not converters:
            return
        model_keys = dict.fromkeys(model.state_dict().keys(), True)
        by_pattern = {pattern: c for c in converters for pattern in c.source_patterns}
        prefix = getattr(model, "base_model_prefix", None)
        for key in source_keys:
            renamed, pattern = compat.rename_checkpoint_key(key, renamings, converters, prefix, model_keys)
            if renamed not in model_keys and key in model_keys:
                renamed, pattern = key, None
            if pattern is None:
                self._direct[key] = renamed
                continue
            self._pattern_of[key], self._target_of[key] = pattern, renamed
            if renamed not in self._converters:
                self._converters[renamed] = copy.deepcopy(by_pattern[pattern])
            self._waiting.setdefault(renamed, set()).add(key)

    def feed(self, key: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """``(model key, tensor)`` pairs ready after ``tensor`` arrived (none while a merge waits)."""
        target = self._target_of.get(key)
        if target is None:
            return [(self._direct.get(key, key), tensor)]
        self._held.setdefault(target, {})[key] = tensor
        waiting = self._waiting[target]
        waiting.discard(key)
        if waiting:
            return []
        held = self._held.pop(target)
        held_keys = list(held)
        converter = self._converters.pop(target)
        for source in compat.natural_key_order(list(held)):
            converter.add_tensor(target, source, self._pattern_of[source], held.pop(source))
        try:
            merged = converter.convert(target, model=self.model, config=getattr(self.model, "config", None))
        except Exception as exc:  # noqa: BLE001 - any op failure, e.g. an expert missing: the stacks do not line up
            raise CheckpointError(f"checkpoint: cannot build {target} from {len(held_keys)} tensor(s) "
                                  f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from None
        return list(merged.items())
