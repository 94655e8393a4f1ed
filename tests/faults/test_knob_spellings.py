"""A ``NEUTRAIN_*`` value other than a path is ASCII text: a letter whose Unicode case mapping is ASCII
(``'ınfo'.upper()`` is ``'INFO'``, the Kelvin sign's ``lower()`` is ``k``) spelled a setting the user did not type,
where every number was already read from ASCII digits only. A path keeps any character its file system holds."""

from __future__ import annotations

import pytest

from neutrain.config.knobs import KNOBS, LOG_LEVELS, EnvironmentVariableError, knob

# Non-ASCII letters whose case mapping is ASCII: the disguises of a setting.
DISGUISES = {"i": "ı", "I": "ı", "s": "ſ", "S": "ſ", "k": "\u212a", "K": "\u212a"}


def _accepted(name: str) -> list[str]:
    """Texts the variable takes, spelled in ASCII."""
    k = KNOBS[name]
    if k.type is bool:
        return ["yes", "true", "on", "off", "false", "no", "1", "0"]
    if k.type == "level":
        return list(LOG_LEVELS) + [level.lower() for level in LOG_LEVELS]
    return list(k.choices)


def _disguised(text: str) -> list[str]:
    return [text[:i] + DISGUISES[c] + text[i + 1:] for i, c in enumerate(text) if c in DISGUISES]


WORDED = sorted(name for name, k in KNOBS.items() if k.type in (bool, "level") or k.choices)


@pytest.mark.parametrize("name", WORDED)
def test_a_setting_spelled_with_a_letter_that_case_maps_to_ascii_is_refused_naming_the_variable(name):
    for text in _accepted(name):
        knob(name, {name: text})  # the ASCII spelling is taken
        for disguised in _disguised(text) + [text + "\u00a0x"]:
            with pytest.raises(EnvironmentVariableError, match=rf"^environment variable {name}="):
                knob(name, {name: disguised})


def test_a_path_variable_keeps_its_non_ascii_name(tmp_path):
    folder = tmp_path / "récipes-ı"
    folder.mkdir()
    assert knob("NEUTRAIN_RECIPES", {"NEUTRAIN_RECIPES": str(folder)}) == str(folder)
