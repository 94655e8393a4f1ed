"""FSDP2 with fused updates on local shards: 2 gloo processes (fully_shard on CPU) == 1 process."""

import pytest

from tests.unit.distributed.dist_helpers import assert_same_training, run_cases

# Two gloo processes against one: a multi-process launch, outside the quick subset.
pytestmark = pytest.mark.distributed

CASES = [
    {"optimizer": "lomo", "clip_mode": "global_stale", "max_grad_norm": 0.5},
    {"optimizer": "adalomo", "clip_mode": "per_tensor", "max_grad_norm": 0.5},
]


@pytest.fixture(scope="module")
def results():
    return run_cases("fsdp2", CASES)


@pytest.mark.parametrize("index", range(len(CASES)), ids=["lomo-global_stale", "adalomo-per_tensor"])
def test_sharded_updates_match_one_process(results, index):
    single, double = results[index]
    assert single["sharded"] == 0
    assert double["sharded"] > 0, "the optimizer's parameters were not FSDP2 shards"
    assert_same_training(single, double)
