"""Replicated data parallel with fused updates: 2 gloo processes == 1 process on the same global batch."""

import pytest

from tests.unit.distributed.dist_helpers import assert_same_training, run_cases

# Two gloo processes against one: a multi-process launch, outside the quick subset.
pytestmark = pytest.mark.distributed

# Clipping at 0.5 is active on these tiny models, so the clip coefficients (global norm of the
# averaged gradient, exact or stale) and AdaLomo's RMS statistics are all exercised.
CASES = [
    {"optimizer": "lomo", "clip_mode": "global_exact", "max_grad_norm": 0.5},
    {"optimizer": "adalomo", "clip_mode": "global_stale", "max_grad_norm": 0.5},
    {"optimizer": "adalomo", "compressed": True, "clip_mode": "per_tensor", "max_grad_norm": 0.5},
]


@pytest.fixture(scope="module")
def results():
    return run_cases("replicated", CASES)


@pytest.mark.parametrize("index", range(len(CASES)), ids=[
    "lomo-dense-global_exact", "adalomo-dense-global_stale", "adalomo-neuzip-per_tensor"])
def test_two_processes_match_one(results, index):
    single, double = results[index]
    assert_same_training(single, double)
    # every update went through the asynchronous all-reduce, and all of them completed
    assert double["submitted"] > 0 and double["completed"] == double["submitted"]
