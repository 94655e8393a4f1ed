"""Work whose cost depends on the content is bounded for every input, not for the probe that was checked.

A 1 MB run of whitespace in a data row hung the BPE trainer (the cut applied to runs without whitespace
only); a tokenizer regex that backtracks without end ended in a hundred-line Rust panic and a traceback; a
chat template whose loop is gated on a message's content passed the probe check and hung ``generate`` on
the prompt that opened it. Each case runs in one real process under a timeout (the faults are hangs) and
must end in its own way: the work done in seconds, or one line and exit 2.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

from hypothesis import given, settings
from hypothesis import strategies as st

from neutrain.data.tokenizer import LONGEST_WORD, bounded_words
from tests.faults.test_run_directory import REPO, _env
from tests.helpers import write_recipe

_DRIVER = r"""
import contextlib, io, json, sys, time
import neutrain.data.template_bounds as bounds
from neutrain.cli import main
bounds.RENDER_SECONDS = 1.0  # the bound's value is not under test: that it holds is
cases, results = json.loads(sys.argv[1]), {}
for name, command in cases.items():
    err, started = io.StringIO(), time.monotonic()
    with contextlib.redirect_stderr(err):
        if command[0] == "train-bpe":  # the tokenizer trainer itself, on rows holding 1 MB of whitespace
            from neutrain.data.tokenizer import train_bpe_tokenizer
            text = {"spaces": " " * 1_000_000, "newlines": "\n" * 1_000_000, "mixed": "\t \n\r" * 250_000,
                    "between words": "start" + " " * 1_000_000 + "end"}[command[1]]
            code = 0 if len(train_bpe_tokenizer([text, "def f(x):\n    return x\n"], vocab_size=400)) > 259 else 1
        else:
            code = main(command)
    results[name] = [code, err.getvalue(), time.monotonic() - started]
print(json.dumps(results))
"""

GATED_LOOP = ("{% for m in messages %}{% if 'boom' in m['content'] %}{% for i in range(100000) %}"
              "{% for j in range(100000) %}{% endfor %}{% endfor %}{% endif %}{{ m['role'] }}: {{ m['content'] }}\n"
              "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
# A loop whose body calls, reads and computes nothing: only the time bound sees it.
GATED_SILENT_LOOP = ("{% for m in messages %}{% if 'boom' in m['content'] %}{% set c = m['content'] %}{% for a in c %}"
                     "{% for b in c %}{% for d in c %}{% endfor %}{% endfor %}{% endfor %}{% endif %}{{ m['content'] }}\n"
                     "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
SILENT_BOUND = r"takes more than 1 s to render|runs more than [\d,]+ operations for an input of"


def _panicking_tokenizer(folder) -> None:
    """The byte tokenizer with a normalizer regex that backtracks without end on ``a...ab``."""
    from tokenizers import Regex, normalizers

    from neutrain.data import byte_tokenizer

    tok = byte_tokenizer()
    tok.backend_tokenizer.normalizer = normalizers.Replace(Regex("(a+)+$"), "x")
    tok.save_pretrained(folder)


def _model(folder, template: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from neutrain.data import byte_tokenizer

    tok = byte_tokenizer()
    tok.chat_template = template
    LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=len(tok), max_position_embeddings=4096)
                     ).save_pretrained(folder)
    tok.save_pretrained(folder)


def test_content_dependent_costs_are_bounded_for_every_row_and_prompt(tmp_path):
    boom = "boom " + "x" * 1500
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"text": "hello"}) + "\n" + json.dumps({"text": "a" * 40 + "b"}) + "\n")
    chats = tmp_path / "chats.jsonl"
    chats.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": c}, {"role": "assistant", "content": "ok"}]})
                               for c in ("hi", boom)) + "\n")
    quiet = {"export": {"format": "none"}, "eval": {"perplexity": False}}
    panicking = tmp_path / "panic-tok"
    _panicking_tokenizer(panicking)
    regex_recipe = write_recipe(tmp_path / "a", data={"datasets": [{"path": str(rows), "type": "text"}]},
                                model={"tokenizer": str(panicking)}, **quiet)
    loop_recipe = write_recipe(tmp_path / "b", data={"datasets": [{"path": str(chats), "type": "messages"}],
                                                     "chat_template": GATED_LOOP}, **quiet)
    silent_recipe = write_recipe(tmp_path / "c", data={"datasets": [{"path": str(chats), "type": "messages"}],
                                                       "chat_template": GATED_SILENT_LOOP}, **quiet)
    gated, silent = tmp_path / "gated-model", tmp_path / "silent-model"
    _model(gated, GATED_LOOP)
    _model(silent, GATED_SILENT_LOOP)
    generate = ["--max-new-tokens", "2"]
    cases = {
        **{f"bpe {kind}": ["train-bpe", kind] for kind in ("spaces", "newlines", "mixed", "between words")},
        "regex in a row": ["train", str(regex_recipe)],
        "gated loop in a row": ["train", str(loop_recipe)],
        "gated silent loop in a row": ["train", str(silent_recipe)],
        "gated loop in a prompt": ["generate", str(gated), "--prompt", boom, *generate],
        "gated silent loop in a prompt": ["generate", str(silent), "--prompt", boom, *generate],
        "the prompt without the trigger": ["generate", str(gated), "--prompt", "hi", *generate],
    }
    proc = subprocess.run([sys.executable, "-c", _DRIVER, json.dumps(cases)], cwd=REPO, env=_env(), capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "panicked" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    print({name: round(r[2], 1) for name, r in results.items()})
    said = {
        "regex in a row": rf"{re.escape(str(rows))}: row 1: the tokenizer's native code stopped on this text \(Onig: "
                          r"Regex search error: retry-limit-in-match over\)",
        "gated loop in a row": rf"{re.escape(str(chats))}: row 1: the chat template loops more than 1,000,000 times on "
                               r"this row's messages",
        # Every loop step counts (tests/faults/test_template_threads.py): the operations' bound or the time's.
        "gated silent loop in a row": rf"{re.escape(str(chats))}: row 1: the chat template ({SILENT_BOUND})",
        "gated loop in a prompt": r"--prompt: the model's chat template loops more than 1,000,000 times on this prompt",
        "gated silent loop in a prompt": rf"--prompt: the model's chat template ({SILENT_BOUND})",
    }
    for name, (code, err, seconds) in results.items():
        errors = [line for line in err.splitlines() if line.startswith("neutrain: error:") or "Traceback" in line]
        assert seconds < 30, (name, seconds)
        if name in said:
            assert code == 2 and len(errors) == 1 and re.search(said[name], errors[0]), (name, err[-2000:])
        else:
            assert code == 0 and not errors, (name, err[-2000:])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["a", "é", " ", "\n", "\t", "\u3000", "-"]), st.integers(1, 700)), max_size=8))
def test_bounded_words_keep_the_text_and_cut_every_run(pieces):
    text = "".join(ch * n for ch, n in pieces)
    words = list(bounded_words([text]))
    assert "".join(words) == text
    for word in words:
        assert not re.search(r"\S{%d}|\s{%d}" % (LONGEST_WORD + 1, LONGEST_WORD + 1), word), word[:20]
