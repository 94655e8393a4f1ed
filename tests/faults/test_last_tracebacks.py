"""The last raw tracebacks are one line each: GGUF headers, chat templates, environment, CLI numbers, vocabularies.

Truncated or lying GGUF headers ended in ``struct.error``; a chat template that raised an ordinary Python
error while rendering (``{{ 1/0 }}``) in its traceback; ``WORLD_SIZE=abc`` or ``ACCELERATE_USE_CPU=maybe``
in Accelerate's ``ValueError``; ``--seed 2**70``, ``--num-drafts 100000`` (an allocation of terabytes) or
``--max-shard-size abc`` deep in torch or transformers; a tokenizer larger than the model's vocabulary in
``IndexError``. Each case: exit 2 and one ``neutrain: error:`` line naming the culprit. In-process; the drafts
cases ask for one more than allowed (the fixed code refuses it; a broken one must not allocate terabytes here).
"""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from neutrain.cli import main as neutrain
from tests.helpers import TINY_LLAMA, one_error_line, write_recipe


def _model(path: Path, vocab: int, template: str | None = None) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from neutrain.data import byte_tokenizer

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**{k: v for k, v in TINY_LLAMA.items() if k != "model_type"}, vocab_size=vocab)).save_pretrained(path)
    tokenizer = byte_tokenizer()
    if template is not None:
        tokenizer.chat_template = template
    tokenizer.save_pretrained(path)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("inputs")
    _model(root / "model", 259)  # the byte tokenizer's vocabulary
    _model(root / "small-vocab", 64)
    _model(root / "divides-by-zero", 259, "{{ 1 / 0 }}")
    (root / "truncated.gguf").write_bytes(b"GGUF" + struct.pack("<I", 3) + b"\x01")
    (root / "lying.gguf").write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 2**40, 2**40))  # counts the file cannot hold
    (root / "long-key.gguf").write_bytes(b"GGUF" + struct.pack("<IQQQ", 3, 0, 1, 2**50) + b"key")
    recipe = write_recipe(root, train={"max_steps": 1, "save_steps": 1}, export={"format": "none"},
                          eval={"perplexity": False})
    return root, recipe


GGUF = ["model.init=pretrained", "model.config=null", "model.tokenizer=null"]
CASES = {
    "truncated gguf (train)": (lambda r, c: ["train", str(c), f"model.gguf_file={r / 'truncated.gguf'}", *GGUF], {},
                               "model.gguf_file: GGUF file '{r}/truncated.gguf': truncated or corrupt: the tensor count"),
    "lying gguf (generate)": (lambda r, c: ["generate", str(r / "lying.gguf"), "--prompt", "hi"], {},
                              "GGUF file '{r}/lying.gguf': truncated or corrupt: the length of metadata key 0"),
    "long gguf key (generate)": (lambda r, c: ["generate", str(r / "long-key.gguf"), "--prompt", "hi"], {},
                                 "GGUF file '{r}/long-key.gguf': truncated or corrupt: metadata key 0 needs"),
    "template raises": (lambda r, c: ["generate", str(r / "divides-by-zero"), "--prompt", "hi"], {},
                        "the chat template raised an error while rendering (line 1: ZeroDivisionError"),
    "vocabulary (generate)": (lambda r, c: ["generate", str(r / "small-vocab"), "--prompt", "hi", "--raw"], {},
                              "the tokenizer has 259 tokens, the model's vocabulary 64"),
    "vocabulary (train)": (lambda r, c: ["train", str(c), f"model.base_model={r / 'small-vocab'}", "model.init=pretrained",
                                         "model.config=null", f"train.output_dir={r / 'vocab-run'}"], {},
                           "model.tokenizer: the tokenizer has 259 tokens, the model's vocabulary 64"),
    "seed": (lambda r, c: ["generate", str(r / "model"), "--prompt", "hi", "--seed", str(2**70)], {},
             "--seed: 1180591620717411303424 is out of range"),
    "num drafts": (lambda r, c: ["generate", str(r / "model"), "--prompt", "hi", "--draft", str(r / "model"),
                                 "--num-drafts", "17"], {}, "--num-drafts: 17 is out of range; expected an integer from 1 to 16"),
    "draft length": (lambda r, c: ["generate", str(r / "model"), "--prompt", "hi", "--draft", str(r / "model"),
                                   "--draft-len", "65"], {}, "--draft-len: 65 is out of range; expected an integer from 1 to 64"),
    "device budget": (lambda r, c: ["generate", str(r / "model"), "--prompt", "hi", "--device-budget-gib", "nan"], {},
                      "--device-budget-gib: nan is out of range"),
    "shard size": (lambda r, c: ["export", str(r / "model"), "--output", str(r / "out"), "--max-shard-size", "abc"], {},
                   "--max-shard-size: 'abc' is not a size"),
    "WORLD_SIZE": (lambda r, c: ["train", str(c)], {"WORLD_SIZE": "abc"}, "environment variable WORLD_SIZE='abc'"),
    "ACCELERATE_USE_CPU": (lambda r, c: ["train", str(c)], {"ACCELERATE_USE_CPU": "maybe"},
                           "environment variable ACCELERATE_USE_CPU='maybe' is not a boolean"),
    "ACCELERATE_MIXED_PRECISION": (lambda r, c: ["train", str(c)], {"ACCELERATE_MIXED_PRECISION": "fp99"},
                                   "environment variable ACCELERATE_MIXED_PRECISION='fp99'"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_is_one_line_and_exit_2(files, capsys, monkeypatch, case):
    root, recipe = files
    command, environ, said = CASES[case]
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    assert neutrain(command(root, recipe)) == 2
    line = one_error_line(capsys.readouterr().err)
    assert said.format(r=root) in line, line
