"""A Rust panic in ``tokenizers`` (pyo3's ``PanicException``) becomes the caller's one-line error, its printout dropped."""

from __future__ import annotations

import os
import sys

import pytest

from neutrain.compat.native_panics import is_panic, native_panics


def _panicking_tokenizer():
    from tokenizers import Regex, Tokenizer, models, normalizers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.Replace(Regex("(a+)+$"), "x")  # Oniguruma gives up on a...ab: the binding panics
    return tok


def test_a_tokenizer_panic_is_the_callers_error_and_its_printout_is_dropped(capfd):
    tok = _panicking_tokenizer()
    with pytest.raises(ValueError, match=r"^row 3: Onig: Regex search error: retry-limit-in-match over$"):
        with native_panics(lambda message: ValueError(f"row 3: {message}")):
            tok.encode("a" * 40 + "b")
    assert "panicked" not in capfd.readouterr().err


def test_what_else_the_block_writes_to_stderr_is_kept(capfd):
    with native_panics(ValueError):
        os.write(2, b"from the descriptor\n")
        print("from python", file=sys.stderr)
    err = capfd.readouterr().err
    assert "from the descriptor" in err and "from python" in err


def test_other_errors_pass_through_unchanged():
    with pytest.raises(KeyError):
        with native_panics(ValueError):
            raise KeyError("x")
    assert not is_panic(KeyError("x"))
