"""The design notes the code cites exist, with the sections it cites; the README and docs/ link only to files
that exist, and every docs page is listed.

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
# A file name ending in .md, optionally with a directory ("docs/codec.md", "benchmarks/codec/NOTES.md").
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


PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# "[text](target)" outside code: a relative target is a path from the page's own directory.
LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")


def relative_links(text: str) -> list[str]:
    """The relative link targets of a Markdown text, without their #anchor; code blocks and spans skipped.

    Example:
        >>> relative_links("[a](docs/x.md) [b](https://e.org) [c](y.md#s) `[d](z.md)`\\n```\\n[e](w.md)\\n```\\n")
        ['docs/x.md', 'y.md']
    """
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    targets = [t.split("#", 1)[0] for t in LINK.findall(text)]
    return [t for t in targets if t and not re.match(r"[a-z][a-z0-9+.-]*:", t)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_of_the_readme_and_docs_resolve(page: Path):
    # The README's detail moved into docs/ pages that link to each other and back; a renamed page must not
    # leave a dead link behind.
    dead = [t for t in relative_links(page.read_text()) if not (page.parent / t).exists()]
    assert dead == [], f"{page.relative_to(ROOT)} links to paths that do not exist: {dead}"


def test_the_readme_lists_every_docs_page():
    # The README's "Documentation" list is how a newcomer finds the pages.
    readme = (ROOT / "README.md").read_text()
    pages = sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    design = {"trainer.md", "codec.md", "attention.md", "kvcache.md", "specdec.md"}  # listed in docs/README.md
    assert [n for n in pages if n not in design and f"(docs/{n})" not in readme] == []


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


RECIPE_PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "recipes").glob("*.yaml"))]


def _recipe(name: str) -> dict:
    import yaml

    return yaml.safe_load((ROOT / "recipes" / f"{name}.yaml").read_text())


def _parameters(recipe: dict) -> int:
    """A recipe's random-init model's parameter count, built on the meta device (no memory, no time)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(recipe["model"]["config"])
    vocab = recipe["model"].get("tokenizer_vocab_size") if recipe["model"].get("tokenizer") == "train-bpe" else 259
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), vocab_size=vocab, **cfg))
    return sum(p.numel() for p in model.parameters())


def test_the_docs_describe_the_default_recipes_draft_as_it_is():
    # The README called the quick start's draft 1-layer and the recipe's own comment 2-layer; it has
    # a quarter of the target's 4 layers, 1.
    default = _recipe("default")
    layers = (default["distill"].get("draft_config") or {}).get(
        "num_hidden_layers", max(1, default["model"]["config"]["num_hidden_layers"] // 4))
    claims = [(page.name, int(n)) for page in RECIPE_PAGES for n in re.findall(r"\b(\d+)-layer draft", page.read_text())]
    assert claims and all(n == layers for _, n in claims), claims
    readme = (ROOT / "README.md").read_text()
    words = {1: "one", 2: "two", 3: "three", 4: "four"}
    assert f"({words[default['distill']['num_drafts']]} drafts" in readme
    assert f"K = {default['distill']['num_drafts']} drafts" in (ROOT / "recipes" / "default.yaml").read_text()
    # The round cost the README and the recipe state is the one the payoff rule computes for these models.
    from types import SimpleNamespace

    from neutrain.speculative.payoff import round_cost

    cfg = {k: v for k, v in default["model"]["config"].items() if k != "model_type"}
    target = SimpleNamespace(config=SimpleNamespace(**cfg, vocab_size=default["model"]["tokenizer_vocab_size"]))
    draft = SimpleNamespace(config=SimpleNamespace(**{**vars(target.config), "num_hidden_layers": layers}))
    cost = f"{round_cost(target, [draft], default['distill']['draft_len']):.2f}"
    for page in (ROOT / "README.md", ROOT / "recipes" / "default.yaml", ROOT / "docs" / "evaluation-and-speculative.md"):
        stated = re.findall(r"(\d\.\d\d) (?:needed|target steps)", " ".join(page.read_text().replace("#", " ").split()))
        assert stated and set(stated) == {cost}, (page.name, stated, cost)


def test_the_readme_states_the_quick_starts_steps_and_size():
    default, readme = _recipe("default"), " ".join((ROOT / "README.md").read_text().split())
    steps, every = re.search(r"training \((\d+) steps, one line of numbers per (\d+) steps\)", readme).groups()
    assert (int(steps), int(every)) == (default["train"]["max_steps"], default["train"]["logging_steps"])
    assert f"each a mean over its {every}-step logging window" in readme
    size = int(re.search(r"trains a (\d+)M-parameter Llama", readme).group(1))
    assert size == round(_parameters(default) / 1e6)


@pytest.mark.parametrize("name", ["default", "long_context", "neuzip_cpu", "lora_neuzip"])
def test_a_recipes_header_states_its_own_size_and_steps(name):
    # Each random-init recipe opens with its model's size (and, where it says, its steps): they must be the recipe's.
    recipe, text = _recipe(name), (ROOT / "recipes" / f"{name}.yaml").read_text()
    header = " ".join(line.lstrip("# ") for line in text.splitlines() if line.startswith("#"))
    size = int(re.search(r"(\d+)M-parameter", header).group(1))
    assert size == round(_parameters(recipe) / 1e6), (name, _parameters(recipe))
    for steps in re.findall(r"(?:trained for|^|\s)(\d+)[ -]steps?\b", header):
        assert int(steps) == recipe["train"]["max_steps"], (name, steps)


def test_the_walkthrough_states_its_data_and_steps():
    chat, readme = _recipe("smollm2_chat"), " ".join((ROOT / "README.md").read_text().split())
    rows = len((ROOT / "recipes" / "data" / "veltoria_chat.jsonl").read_text().splitlines())
    assert f"on {rows} conversations shipped in the repository" in readme
    assert f"({chat['train']['max_steps']} steps," in readme
