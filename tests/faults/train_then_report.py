"""Train a recipe through ``neutrain.cli.train.train_from_recipe``, then record what is still alive of the process group.

    python -m torch.distributed.run --nproc_per_node 2 -m tests.faults.train_then_report <recipe> <report dir>

Each rank writes ``<report dir>/rank<r>.json``: whether ``torch.distributed`` is still
initialised once the run has returned (it must not be: gloo's threads would then meet
interpreter finalization).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def main() -> int:
    import torch.distributed as dist

    from neutrain.config import load_recipe
    from neutrain.cli.train import train_from_recipe

    recipe, report = sys.argv[1], Path(sys.argv[2])
    train_from_recipe(load_recipe(recipe))
    rank = os.environ.get("RANK", "0")
    (report / f"rank{rank}.json").write_text(json.dumps({"initialized": dist.is_initialized()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
