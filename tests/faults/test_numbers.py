"""Numbers that would lie are refused or marked: overflowing exports, untrained runs, skipped steps' losses.

``export --dtype float16`` wrote inf weights under a valid manifest with no warning; a run where every
step was non-finite exited 0 and exported the untrained model; the logged loss of a step skipped for a
non-finite gradient looked like any other. In-process runs and exports.
"""

from __future__ import annotations

import math

import torch

from neutrain.cli import main as neutrain
from neutrain.trainer.callbacks import read_metrics
from tests.faults.test_export_and_nonfinite import _injecting_trainer, _tiny_llama
from tests.helpers import one_error_line, write_recipe


def _saved_model(path, value: float):
    from neutrain.data import byte_tokenizer

    model = _tiny_llama(0)
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[0, 0] = value
    model.save_pretrained(path)
    byte_tokenizer().save_pretrained(path)


def test_an_export_that_would_write_inf_or_holds_nan_is_refused_naming_the_weight(tmp_path, capsys):
    _saved_model(tmp_path / "big", 1e5)  # fine in float32 and bfloat16, beyond float16's 65504
    assert neutrain(["export", str(tmp_path / "big"), "--dtype", "float16", "--output", str(tmp_path / "fp16")]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "'model.layers.0.mlp.up_proj.weight' has values up to 1e+05, beyond float16's largest, 65504" in line, line
    assert not (tmp_path / "fp16").exists()
    assert neutrain(["export", str(tmp_path / "big"), "--dtype", "bfloat16", "--output", str(tmp_path / "bf16")]) == 0
    _saved_model(tmp_path / "nan", math.nan)
    assert neutrain(["export", str(tmp_path / "nan"), "--output", str(tmp_path / "broken")]) == 2
    line = one_error_line(capsys.readouterr().err)  # refused at load now, before the export: naming the weight
    assert "'model.layers.0.mlp.up_proj.weight' holds" in line and "NaN or inf" in line, line
    assert not (tmp_path / "broken").exists()


def test_a_run_whose_every_step_was_non_finite_exits_2_and_exports_nothing(tmp_path, capsys, monkeypatch):
    from neutrain.trainer import NeuTrainer

    original = NeuTrainer.compute_loss

    def nan_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        result = original(self, model, inputs, return_outputs, num_items_in_batch)
        return result if return_outputs else result * math.nan  # every training step; evaluation as it is

    monkeypatch.setattr(NeuTrainer, "compute_loss", nan_loss)
    recipe = write_recipe(tmp_path, train={"max_steps": 3, "save_steps": 3}, eval={"perplexity": True},
                          export={"format": "hf"})
    assert neutrain(["train", str(recipe)]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "every one of the 3 training steps had a non-finite loss or gradient" in line, line
    out = tmp_path / "out"
    assert not (out / "export").exists() and not (out / "summary.json").exists()
    assert (out / "checkpoint-3").is_dir()  # kept, as the non-finite policy promises


def test_the_record_of_a_step_skipped_for_a_non_finite_gradient_says_so(tmp_path):
    trainer, _ = _injecting_trainer(tmp_path, "adamw", {3}, "grad", max_steps=4)
    trainer.train()
    records = {r["step"]: r for r in read_metrics(tmp_path / "out" / "metrics.jsonl") if "loss" in r}
    assert math.isnan(records[3]["loss"]) and math.isfinite(records[3]["skipped_loss"])
    assert records[3]["nonfinite_in_window"] == 1
    assert all("nonfinite_in_window" not in records[s] and math.isfinite(records[s]["loss"]) for s in (1, 2, 4))
