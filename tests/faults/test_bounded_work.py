"""Hostile input is refused before the work starts, or the work is bounded: nothing runs unbounded.

The ``train-bpe`` tokenizer trainer went super-linear on one long word (a 1 MB word ran past 170 s); a
FIFO or a device file given as ``model.config`` blocked or read until memory ran out; a chat template
could loop or expand without end on every row; ``--max-new-tokens`` past what can be allocated failed
deep in the decoder. The cases run in one real process (the faults are hangs) under a generous timeout,
and each must end in its own way: one line and exit 2, or the work done.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.faults.test_run_directory import REPO, _env
from tests.helpers import write_recipe

# Each case: (what runs, how it must end). Run inside one process by _DRIVER, which prints the outcomes as JSON.
_DRIVER = r"""
import contextlib, io, json, random, sys, time
from neutrain.cli import main
cases, results = json.loads(sys.argv[1]), {}
for name, command in cases.items():
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        if command == "train-bpe":  # the tokenizer trainer itself, on one 1 MB word
            from neutrain.data.tokenizer import train_bpe_tokenizer
            random.seed(0)
            word = "".join(random.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(1_000_000))
            code = 0 if len(train_bpe_tokenizer([word], vocab_size=2048)) == 2048 else 1
        else:
            code = main(command)
    results[name] = [code, err.getvalue()]
print(json.dumps(results))
"""


def _errors(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("neutrain: error:") or "Traceback" in line]


def test_hostile_sizes_and_files_are_refused_or_bounded(tmp_path):
    from tests.faults.test_last_tracebacks import _model

    chats = tmp_path / "chats.jsonl"
    chats.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}) + "\n")
    recipe = write_recipe(tmp_path, data={"datasets": [{"path": str(chats), "type": "messages"}]},
                          export={"format": "none"}, eval={"perplexity": False})
    fifo = tmp_path / "config.fifo"
    os.mkfifo(fifo)
    model = tmp_path / "model"
    _model(model, 259)  # the byte tokenizer's vocabulary; max_position_embeddings 256
    loops = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}{{ messages[0]['content'] }}"
    cases = {
        "fifo": ["train", str(recipe), f"model.config={fifo}"],
        "device": ["train", str(recipe), "model.config=/dev/zero"],
        "template": ["train", str(recipe), f"data.chat_template={loops}"],
        "huge": ["generate", str(model), "--prompt", "hi", "--raw", "--max-new-tokens", "1000000000000"],
        "context": ["generate", str(model), "--prompt", "hi", "--raw", "--max-new-tokens", "300"],
        "train-bpe": "train-bpe",
    }
    proc = subprocess.run([sys.executable, "-c", _DRIVER, json.dumps(cases)], cwd=REPO, env=_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    said = {
        "fifo": f"model.config: file '{fifo}' is a FIFO (named pipe), not a regular file",
        "device": "model.config: file '/dev/zero' is a character device, not a regular file",
        "template": "data.chat_template: the chat template loops more than 1,000,000 times",
        "huge": "--max-new-tokens: 1000000000000 is out of range; expected an integer from 1 to 1,048,576",
        "context": "--max-new-tokens: 300 new tokens after a 2-token prompt exceed the model's context of 256 positions",
    }
    for name, needle in said.items():
        code, err = results[name]
        assert code == 2 and len(_errors(err)) == 1 and needle in _errors(err)[0], (name, err[-2000:])
    assert results["train-bpe"][0] == 0, results["train-bpe"][1][-2000:]
