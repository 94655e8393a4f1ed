"""DeepSpeed ZeRO-3 (engine without optimizer) with fused LOMO on partitions: 2 gloo processes == 1 process."""

import pytest

# Two gloo processes against one: a multi-process launch, outside the quick subset.
pytestmark = pytest.mark.distributed

pytest.importorskip("deepspeed")

from tests.unit.distributed.dist_helpers import assert_same_training, run_cases  # noqa: E402

CASES = [
    {"optimizer": "lomo", "clip_mode": "per_tensor", "max_grad_norm": 0.5},
    # No per-tensor statistic needed after step 1: the partitions' squared norms are summed once per step.
    {"optimizer": "lomo", "clip_mode": "global_stale", "max_grad_norm": 0.5},
]


def test_zero3_partition_updates_match_one_process():
    (per_tensor, stale) = run_cases("zero3", CASES)
    for single, double in (per_tensor, stale):
        assert double["sharded"] > 0, "no parameter was a ZeRO-3 partition"
        assert_same_training(single, double)
    assert stale[1]["partial_norms"] and per_tensor[1]["partial_norms"]
