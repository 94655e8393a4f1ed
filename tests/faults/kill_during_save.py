"""Run ``neutrain`` and SIGKILL it at a chosen point while it saves ``checkpoint-<step>``.

    python -m tests.faults.kill_during_save <step> <point> <neutrain args...>

Every file write (``torch.save``, safetensors, ``trainer_state.json``) and every rename
made while saving that checkpoint is an *event*. ``<point>`` picks the one to die at:

* ``write:<file name>``: that file is written, cut to half its size, and the process is
  killed (what a kill in the middle of the write leaves);
* ``rename``: killed just before the temporary checkpoint is renamed into place;
* ``renamed``: killed just after that rename, before the temporary directory is removed
  and old checkpoints are rotated;
* ``event:<k>``: killed at the k-th event of the save (a write is cut in half first).

A kill the run never reaches exits 3, so a test cannot pass by accident.
"""

from __future__ import annotations

import os
import signal
import sys


def _install(step: int, point: str) -> None:
    import safetensors.torch
    import torch
    import transformers.modeling_utils as modeling_utils
    from transformers import TrainerState

    marker = f"checkpoint-{step}"
    count = [0]

    def die() -> None:
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    def event(kind: str, path: str) -> bool:
        """Whether to die at this event (``kind`` is write or rename)."""
        if marker not in str(path):
            return False
        count[0] += 1
        name = os.path.basename(str(path))
        return point == f"{kind}:{name}" or point == f"event:{count[0]}"

    def writer(original):
        def write(obj, path, *args, **kwargs):
            result = original(obj, path, *args, **kwargs)
            if isinstance(path, (str, os.PathLike)) and event("write", path):
                os.truncate(path, os.path.getsize(path) // 2)
                die()
            return result
        return write

    torch.save = writer(torch.save)
    safetensors.torch.save_file = writer(safetensors.torch.save_file)
    modeling_utils.safe_save_file = writer(modeling_utils.safe_save_file)
    original_json = TrainerState.save_to_json

    def save_to_json(self, path):
        original_json(self, path)
        if event("write", path):
            os.truncate(path, os.path.getsize(path) // 2)
            die()

    TrainerState.save_to_json = save_to_json
    original_replace = os.replace

    def replace(src, dst, *args, **kwargs):
        into_place = os.path.basename(str(dst)) == marker and ".tmp-" not in str(dst)
        if event("rename", dst) or (into_place and point == "rename"):
            die()
        result = original_replace(src, dst, *args, **kwargs)
        if into_place and point == "renamed":
            die()
        return result

    os.replace = replace


def main() -> int:
    step, point, args = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
    _install(step, point)
    from neutrain.cli import main as neutrain_main

    neutrain_main(args)
    print(f"kill point {point} at checkpoint-{step} was never reached", file=sys.stderr)
    return 3


if __name__ == "__main__":
    raise SystemExit(main())
