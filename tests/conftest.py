"""Shared pytest setup.

Why this file sets environment variables at import time: Triton reads
``TRITON_INTERPRET`` once, when it is first imported, and the Hugging Face
libraries read their offline switches on import. Nothing in the test suite may
touch the network, and kernels must run through Triton's CPU interpreter when
no GPU is present.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("DISABLE_TQDM", "1")

import torch  # noqa: E402  (after the environment is set)

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    # Kernels fall back to Triton's CPU interpreter; must be set before triton import.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import hypothesis  # noqa: E402
import pytest  # noqa: E402

# Generated inputs, the same ones on every run: CI must never fail on an example one run happened to draw and the
# next did not (a failure found this way is a real case, and every run reproduces it until it is fixed).
hypothesis.settings.register_profile("neutrain", derandomize=True, database=None)
hypothesis.settings.load_profile("neutrain")


def pytest_collection_modifyitems(config, items):
    """Skip GPU-marked tests on machines without CUDA (they run on the device machine)."""
    if HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU; run on the device machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def pytest_deselected(items):
    """A deselected test (``-k``, ``-m``, ``--deselect``, ``--lf``): this session's items are not the whole suite."""
    from tests import collect_counts

    collect_counts.SESSION["partial"] = True


def pytest_collection_finish(session):
    """The suite's counts, when this session collected all of it (``tests/test_readme_counts.py`` reads them)."""
    from tests import collect_counts

    collect_counts.record_session(session)


@pytest.fixture(autouse=True)
def _seed_everything():
    """Every test starts from a fixed seed so failures reproduce."""
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _gpu_tests_start_from_free_device_memory(request):
    """A GPU test starts with neutrain's process-wide device buffers freed (the decode slots and the layer groups'
    buffer, which outlive the models of earlier tests): what a test measures of the allocator, or the budget it
    sets, must not depend on which tests ran before it in the same process."""
    if HAS_CUDA and "gpu" in request.keywords:
        import gc

        from neutrain.nn.buffers import DECODE_BUFFERS

        gc.collect()
        DECODE_BUFFERS.clear()
        torch.cuda.empty_cache()
    yield


@pytest.fixture(scope="session", autouse=True)
def _junit_records_commit(request):
    """With ``--junitxml``, the report's ``<properties>`` name the commit tested and whether the tree was dirty.

    A junit file kept in ``benchmarks/<topic>/results.jsonl`` must say which code passed (or failed): the
    device scripts set ``NEUTRAIN_GIT_COMMIT``/``NEUTRAIN_GIT_DIRTY`` (their copy has no
    reliable ``.git``); elsewhere ``git`` answers. Without ``--junitxml`` this does nothing.
    """
    if not request.config.getoption("xmlpath", None):
        return
    from benchmarks._common import ProvenanceError, git_provenance  # lazily: only junit runs need it

    record = request.getfixturevalue("record_testsuite_property")
    try:
        commit, dirty = git_provenance()
    except ProvenanceError as exc:
        commit, dirty = f"not recorded: {exc}", None
    record("git_commit", commit)
    record("git_dirty", "unknown" if dirty is None else str(dirty).lower())
