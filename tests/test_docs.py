"""The design notes the code cites exist, with the sections it cites.

Comments once cited notes that were not in the repository (``trainer.md §1``,
``codec.md §8.2``); every ``<name>.md`` a comment or docstring names must now be a
file of the repository, and every ``docs/<note>.md §n`` a heading of that note.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted((ROOT / "neutrain").rglob("*.py"))
# A file name ending in .md, optionally with a directory ("docs/codec.md", "benchmarks/notes_codec.md").
MD_NAME = re.compile(r"(?<![\w/.-])((?:[\w.-]+/)*[\w-]+\.md)\b")
# "docs/x.md §1.2, §5.1", "``docs/x.md`` §10" or "docs/x.md §6 and §8": the sections after a note's name.
CITATION = re.compile(r"docs/([\w-]+\.md)`*((?:\s*(?:,|and)?\s*§\d+(?:\.\d+)*)+)")
HEADING = re.compile(r"^#{2,4}\s+(\d+(?:\.\d+)*)\.?\s", re.MULTILINE)


def _sections(note: Path) -> set[str]:
    return set(HEADING.findall(note.read_text()))


def test_the_docs_index_lists_every_note():
    index = (ROOT / "docs" / "README.md").read_text()
    notes = sorted(p.name for p in (ROOT / "docs").glob("*.md") if p.name != "README.md")
    assert notes, "docs/ holds no notes"
    assert [n for n in notes if f"({n})" not in index] == []


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_cited_notes_and_sections_exist(source: Path):
    text = source.read_text()
    missing = [name for name in MD_NAME.findall(text) if not (ROOT / name).is_file()]
    assert missing == [], f"{source.name} cites notes that are not in the repository: {missing}"
    for note, tail in CITATION.findall(text):
        cited = re.findall(r"§(\d+(?:\.\d+)*)", tail)
        absent = [s for s in cited if s not in _sections(ROOT / "docs" / note)]
        assert absent == [], f"{source.name} cites docs/{note} §{', §'.join(absent)}, which has no such section"


def test_commands_named_in_messages_and_docstrings_exist(capsys):
    # run.py once told users to run `neutrain evaluate`, which does not exist (the command is `neutrain eval`).
    from neutrain.cli import main

    named = sorted({cmd for p in SOURCES for cmd in re.findall(r"`neutrain ([a-z][\w-]*)", p.read_text())})
    assert "train" in named
    unknown = []
    for cmd in named:
        with pytest.raises(SystemExit) as exit_info:
            main([cmd, "--help"])
        if exit_info.value.code != 0:
            unknown.append(cmd)
    capsys.readouterr()
    assert unknown == [], f"messages or docstrings name `neutrain {unknown}`, which is no command"
