"""An option its command would ignore for this target is refused, naming the option; it is never dropped silently.

Why: ``neutrain eval RECIPE --recipe OTHER`` evaluated on RECIPE's data and said nothing of OTHER; ``neutrain
export DENSE_CKPT --base X`` exported the checkpoint as it was, though the user asked for a merge onto X;
``neutrain generate MODEL --num-drafts 4`` without ``--draft`` and ``--top-k 5`` under greedy decoding printed
what plain greedy decoding prints. Each ended with exit 0 and a result the user did not ask for. And a missing
checkpoint given with ``--recipe`` was called a "recipe file" that does not exist.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import one_error_line, write_recipe


@pytest.fixture(scope="module")
def run(tiny_run) -> Path:
    return tiny_run  # the session's finished tiny run (tests/faults/conftest.py), read only


CASES = {  # argv (RUN: the run directory, RECIPE: a recipe, OTHER: a second recipe), the option named
    "eval recipe --recipe": (["eval", "RECIPE", "--recipe", "OTHER"], "--recipe"),
    "export dense --base": (["export", "RUN/checkpoint-2", "--base", "RUN/export", "--output", "NEW"], "--base"),
    "export dense --force-base": (["export", "RUN/checkpoint-2", "--force-base", "--output", "NEW"], "--force-base"),
    "generate --scheme without --draft": (["generate", "RUN/export", "--prompt", "hi", "--scheme", "sd"], "--scheme"),
    "generate --num-drafts without --draft": (["generate", "RUN/export", "--prompt", "hi", "--num-drafts", "3"],
                                              "--num-drafts"),
    "generate --draft-len without --draft": (["generate", "RUN/export", "--prompt", "hi", "--draft-len", "2"],
                                             "--draft-len"),
    "generate greedy --top-k": (["generate", "RUN/export", "--prompt", "hi", "--top-k", "5"], "--top-k"),
    "generate greedy --top-p": (["generate", "RUN/export", "--prompt", "hi", "--top-p", "0.5"], "--top-p"),
    "chat greedy --top-k": (["chat", "RUN/export", "--top-k", "5"], "--top-k"),
    "generate --compile with --draft": (["generate", "RUN/export", "--prompt", "hi", "--draft", "RUN/export",
                                         "--compile"], "--compile"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_an_option_the_command_would_ignore_is_refused_naming_it(run, tmp_path, capsys, monkeypatch, case):
    from neutrain.cli import main

    monkeypatch.setattr("sys.stdin", open("/dev/null"))  # chat reads no conversation
    argv, option = CASES[case]
    names = {"RUN": str(run), "RECIPE": str(run.parent / "tiny.yaml"), "NEW": str(tmp_path / "new"),
             "OTHER": str(write_recipe(tmp_path / "other", data={"sequence_len": 32}))}
    argv = [names.get(a, a) if "/" not in a else a.replace("RUN", names["RUN"]) for a in argv]
    assert main(argv) == 2
    line = one_error_line(capsys.readouterr().err)
    assert option in line and "ignore" in line, line
    assert not (tmp_path / "new").exists()


def test_a_missing_checkpoint_given_with_a_recipe_is_called_a_checkpoint(tmp_path, capsys):
    from neutrain.cli import main

    recipe = write_recipe(tmp_path)
    assert main(["eval", str(tmp_path / "gone"), "--recipe", str(recipe)]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert f"checkpoint '{tmp_path / 'gone'}' does not exist" in line and "recipe file" not in line, line
