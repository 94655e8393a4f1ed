"""``python -m tests.unit.distributed.accelerate_cpu_fsdp recipe.yaml``: neutrain with Accelerate's FSDP on CPU.

Test-only entry point. Accelerate picks FSDP only on accelerator devices (its
``AcceleratorState`` maps a CPU process group to MULTI_CPU and drops the FSDP
plugin), although FSDP2 itself runs on CPU with gloo. This shim restores the
FSDP plugin on CPU so that the Trainer's FSDP2 path (prepare, hooks bound after
``fully_shard``, checkpoint save and resume) runs in CPU CI exactly as on GPUs.
"""

import accelerate.state
from accelerate.utils import DistributedType

_original_init = accelerate.state.AcceleratorState.__init__


def _init_keeping_fsdp_on_cpu(self, *args, fsdp_plugin=None, **kwargs):
    _original_init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
    if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
        self.distributed_type = DistributedType.FSDP
        self.fsdp_plugin = fsdp_plugin


accelerate.state.AcceleratorState.__init__ = _init_keeping_fsdp_on_cpu

if __name__ == "__main__":
    from neutrain.cli import main

    raise SystemExit(main())
