"""``TrainingArguments``' distributed keywords (``deepspeed``, ``fsdp``, ``fsdp_config``) from a recipe's ``train`` section.

Example:
    >>> from neutrain.distributed.arguments import distributed_arguments
    >>> distributed_arguments({"distributed": "auto", "fsdp": "", "fsdp_config": None, "deepspeed": None})
    {'deepspeed': None, 'fsdp': '', 'fsdp_config': None}
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from neutrain.errors import UserInputError

# FSDP2 defaults for ``train.distributed: fsdp2``: one fully_shard unit per decoder layer (the model's
# _no_split_modules), sharded checkpoints (each rank writes its shards; resume needs the same process count).
FSDP2_DEFAULTS = {"fsdp_version": 2, "reshard_after_forward": True, "state_dict_type": "SHARDED_STATE_DICT",
                  "cpu_ram_efficient_loading": False}


def distributed_arguments(t: dict) -> dict[str, Any]:
    """``deepspeed``/``fsdp``/``fsdp_config`` for ``TrainingArguments`` from the recipe's ``train`` section."""
    mode = t.get("distributed", "auto")
    fsdp, fsdp_config, deepspeed = t["fsdp"] or "", t["fsdp_config"], t["deepspeed"]
    if mode == "replicated" and (fsdp or deepspeed):
        raise UserInputError("train.distributed: replicated contradicts train.fsdp / train.deepspeed")
    if mode == "deepspeed" and not deepspeed:
        raise UserInputError("train.distributed: deepspeed needs train.deepspeed (e.g. launch/deepspeed_zero3.json)")
    if mode == "fsdp2":
        if deepspeed:
            raise UserInputError("train.distributed: fsdp2 contradicts train.deepspeed")
        if isinstance(fsdp_config, str):
            fsdp_config = json.loads(Path(fsdp_config).read_text())
        fsdp = fsdp or "full_shard auto_wrap"
        fsdp_config = {**FSDP2_DEFAULTS, **(fsdp_config or {})}
        if fsdp_config["fsdp_version"] != 2:
            raise UserInputError("train.distributed: fsdp2 with fsdp_config.fsdp_version != 2")
    return {"deepspeed": deepspeed, "fsdp": fsdp, "fsdp_config": fsdp_config}
