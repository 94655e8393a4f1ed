"""Run ``neutrain`` and hold it in the middle of saving ``checkpoint-<step>`` until told to go on.

    python -m tests.faults.pause_during_save <step> <gate dir> <neutrain args...>

When every file of that checkpoint is written into ``.tmp-checkpoint-<step>`` (just before
its manifest and the rename into place), the run writes ``<gate dir>/paused`` (its pid)
and waits for ``<gate dir>/go``; then it finishes as usual. A pause the run never reaches
exits 3, and one nobody releases within 5 minutes exits 4, so a test cannot pass by accident.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from tests.faults.pause_at import hold, run_reaching


def main() -> int:
    step, gate, args = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
    import neutrain.trainer.trainer as trainer

    original = trainer.write_manifest
    reached = []

    def paused(directory, *rest, **kwargs):
        if os.path.basename(str(directory)) == f"checkpoint-{step}" and not reached:
            reached.append(True)
            hold(gate)
        return original(directory, *rest, **kwargs)

    trainer.write_manifest = paused
    return run_reaching(args, reached, f"checkpoint-{step}")


if __name__ == "__main__":
    raise SystemExit(main())
