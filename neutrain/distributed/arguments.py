"""The recipe's ``train.distributed`` choice: ``TrainingArguments``' distributed keywords and the checks before launch.

``train.distributed`` only asks; the launcher decides (``accelerate launch --config_file
launch/...``), and :func:`neutrain.distributed.modes.choose_mode` reads the mode from what it
started. This module is the one place that reads the recipe's distributed keys.

Example:
    >>> from neutrain.config.sections import TrainSection
    >>> distributed_arguments(TrainSection(distributed="auto"))
    {'deepspeed': None, 'fsdp': '', 'fsdp_config': None}
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from neutrain.config.sections import TrainSection
from neutrain.errors import RecipeError, UserInputError
from neutrain.files import read_json_object

# FSDP2 defaults for ``train.distributed: fsdp2``: one fully_shard unit per decoder layer (the model's
# _no_split_modules), sharded checkpoints (each rank writes its shards; resume needs the same process count).
FSDP2_DEFAULTS = {"fsdp_version": 2, "reshard_after_forward": True, "state_dict_type": "SHARDED_STATE_DICT",
                  "cpu_ram_efficient_loading": False}


@dataclass(frozen=True)
class DistributedRequest:
    """What the recipe asks of the launch: ``TrainingArguments`` keywords and the key that asks for sharding."""

    arguments: dict[str, Any]  # deepspeed, fsdp, fsdp_config
    key: str  # the recipe setting named when the launch cannot give what it asks

    def check_processes(self, num_processes: int) -> None:
        """FSDP shards the model over several processes: refuse a launch that started one."""
        if self.arguments["fsdp"] and num_processes < 2:
            raise RecipeError(f"{self.key} shards the model over several processes, but this launch started one; launch "
                              "with `accelerate launch --config_file launch/fsdp2.yaml -m neutrain <recipe>`, or remove "
                              "the setting")


def _as_given(fsdp: str, fsdp_config, deepspeed) -> dict[str, Any]:
    return {"deepspeed": deepspeed, "fsdp": fsdp, "fsdp_config": fsdp_config}


def _replicated(fsdp: str, fsdp_config, deepspeed) -> dict[str, Any]:
    if fsdp or deepspeed:
        raise UserInputError("train.distributed: replicated contradicts train.fsdp / train.deepspeed")
    return _as_given(fsdp, fsdp_config, deepspeed)


def _deepspeed(fsdp: str, fsdp_config, deepspeed) -> dict[str, Any]:
    if not deepspeed:
        raise UserInputError("train.distributed: deepspeed needs train.deepspeed (e.g. launch/deepspeed_zero3.json)")
    return _as_given(fsdp, fsdp_config, deepspeed)


def _fsdp2(fsdp: str, fsdp_config, deepspeed) -> dict[str, Any]:
    if deepspeed:
        raise UserInputError("train.distributed: fsdp2 contradicts train.deepspeed")
    if isinstance(fsdp_config, str):  # read as the recipe check read it (neutrain.files)
        fsdp_config = read_json_object(fsdp_config, f"train.fsdp_config: file '{fsdp_config}'", RecipeError)
    fsdp_config = {**FSDP2_DEFAULTS, **(fsdp_config or {})}
    if fsdp_config["fsdp_version"] != 2:
        raise UserInputError("train.distributed: fsdp2 with fsdp_config.fsdp_version != 2")
    return _as_given(fsdp or "full_shard auto_wrap", fsdp_config, deepspeed)


# train.distributed's values (the schema's choices): how each turns the fsdp/deepspeed keys into arguments.
_ARGUMENTS: dict[str, Callable[[str, Any, Any], dict[str, Any]]] = {
    "auto": _as_given, "replicated": _replicated, "fsdp2": _fsdp2, "deepspeed": _deepspeed,
}


def distributed_request(t: TrainSection) -> DistributedRequest:
    """The recipe's ``train`` section's distributed keys, checked against each other.

    Raises:
        UserInputError: keys that contradict ``train.distributed`` (one line naming them).

    Example:
        >>> distributed_request(TrainSection(distributed="fsdp2")).key
        'train.distributed: fsdp2'
    """
    choice = t.distributed
    parse = _ARGUMENTS.get(choice, _as_given)  # the schema has refused other values already
    arguments = parse(t.fsdp or "", t.fsdp_config, t.deepspeed)
    key = f"train.distributed: {choice}" if parse is _fsdp2 else f"train.fsdp: {t.fsdp!r}"
    return DistributedRequest(arguments, key)


def distributed_arguments(t: TrainSection) -> dict[str, Any]:
    """``deepspeed``/``fsdp``/``fsdp_config`` for ``TrainingArguments`` from the recipe's ``train`` section."""
    return distributed_request(t).arguments
