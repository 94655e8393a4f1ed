"""No command creates, fills or replaces the file system's root: every folder a command writes passes through
``note_resolved``, which refuses a path that is (or resolves to) the root, naming the key or flag."""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings, strategies as st

from neutrain.errors import RecipeError
from neutrain.trainer.ownership import note_resolved

KEYS = ["train.output_dir", "export.output_dir", "--output"]


def _roots():
    ups = st.integers(min_value=1, max_value=6).map(lambda n: "/".join([".."] * n))
    # Climbing out of the working folder takes as many '..' as it has components (it differs between a
    # checkout and CI's clone), then any number more: '..' at the root stays at the root.
    depth = len([c for c in os.getcwd().split(os.sep) if c])
    return st.one_of(st.sampled_from(["/", "//", "///", "/.", "/./", "/tmp/..", "/tmp/../", "/tmp/../.."]),
                     ups.map(lambda u: "/tmp/" + u),
                     ups.map(lambda u: os.getcwd() + "/" + "/".join([".."] * depth) + "/" + u))


@given(path=_roots(), key=st.sampled_from(KEYS), itself=st.booleans())
@settings(max_examples=60, deadline=None)
def test_the_root_is_refused_for_every_output_key(path, key, itself):
    with pytest.raises(RecipeError, match=rf"^{key}: '.*' is the file system's root"):
        note_resolved(key, path, itself)


@pytest.mark.parametrize("path", ["/tmp/run", "run", "/tmp/../tmp/run"])
def test_a_folder_under_the_root_passes(path):
    assert os.path.basename(os.path.abspath(note_resolved("--output", path, False)))
