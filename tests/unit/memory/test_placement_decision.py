"""The fit and the generation's residency end in one ``Placement``, which the build and the trainer act on."""

from __future__ import annotations

import dataclasses

import pytest

from neutrain.config import load_recipe
from neutrain.config.layer_placement import LayerPlacement
from neutrain.memory import GIB, ModelShape, Placement, choose_fit, decide

LLAMA3_8B = ModelShape(4096, 14336, 32, 32, 8, 128256, False, 128)


def test_the_fit_decides_one_placement_with_its_reasons():
    fit = choose_fit(load_recipe("llama3_8b"), budget=11 * GIB, host=64 * GIB)
    p = fit.placement
    assert (p.weights, len(p.streamed), p.budget) == ("neuzip-lossless", 9, 11 * GIB)
    assert p.streamed == LayerPlacement.spread(32, 9).offloaded  # the layers the build will stream
    assert p.peak_reserved == fit.peak[1].reserved <= 11 * GIB and p.peak_phase == fit.peak[0]
    assert p.lines == (fit.line,) and p.phases["train_step"]["reserved_gib"] > 0
    build = p.build_placement("cpu")
    assert (build.weights, build.offload, build.layers) == ("neuzip-lossless", True, 9)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.streamed = ()


def test_a_fit_that_offloads_nothing_keeps_every_layer_on_the_device():
    p = choose_fit(load_recipe("llama3_8b"), budget=22 * GIB, host=64 * GIB).placement
    assert (p.weights, p.streamed, p.offload_weights, p.resident) == ("dense", (), False, 32)
    assert p.build_placement("cpu").offload is False


def test_the_generation_decides_the_same_kind_of_placement():
    residency = decide(LLAMA3_8B, int(9 * GIB), prompt_tokens=16, new_tokens=64)
    p = residency.placement
    assert isinstance(p, Placement) and p.streamed == residency.streamed and p.offload_weights
    assert (p.weights, p.micro_batch_size, p.peak_phase) == ("neuzip-lossless", None, residency.phase)
    assert p.build_placement("cpu").layers == len(residency.streamed)
    assert decide(LLAMA3_8B, None, prompt_tokens=16, new_tokens=64).placement.weights == "dense"


def test_the_trainer_streams_the_layers_its_placement_names(tmp_path, monkeypatch):
    # A model built elsewhere, compressed, with a memory section that asks for no offload: the placement the
    # fit decided is what the trainer acts on before the first step.
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, TrainingArguments

    from neutrain.nn import compress_model
    from neutrain.nn.weight_offload_model import weight_store
    from neutrain.trainer import NeuTrainer

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=64)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    compress_model(model, progress=False, codec_options={"steps": 16})
    args = TrainingArguments(str(tmp_path / "out"), use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True)
    placed = Placement("neuzip-lossless", layers=4, streamed=LayerPlacement.spread(4, 2).offloaded)
    trainer = NeuTrainer(model=model, args=args, placement=placed)
    monkeypatch.setattr(type(trainer.distributed_mode), "prepare_for_training", lambda *args: None)
    trainer._prepare_for_training(1, None, None)
    assert len(weight_store(model).layers) == 2


def test_the_trainer_splits_the_layer_inputs_as_its_placement_says(tmp_path, monkeypatch):
    # The fit's split for a short host: the last layer's inputs stay on the device, the first's go to a file under
    # the run's .cache (nameless), the rest to host memory; the file is closed when training ends.
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, TrainingArguments

    from neutrain.nn.offload import offloaded_checkpoint
    from neutrain.trainer import NeuTrainer

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=64)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    args = TrainingArguments(str(tmp_path / "out"), use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True)
    placed = Placement("dense", layers=4, offload_activations=True, activation_device_layers=1,
                       activation_file_layers=2, activation_file_bytes=2 * 1024)
    trainer = NeuTrainer(model=model, args=args, placement=placed)
    monkeypatch.setattr(type(trainer.distributed_mode), "prepare_for_training", lambda *args: None)
    trainer._prepare_for_training(1, None, None)
    funcs = [layer._gradient_checkpointing_func for layer in model.model.layers]
    stashes = [f.keywords.get("_stash") for f in funcs]
    assert [f.func is offloaded_checkpoint for f in funcs] == [True, True, True, False]  # the last: a plain checkpoint
    assert [getattr(s, "args", None) == (trainer.activation_file, False) for s in stashes] == [True, True, False, False]
    assert trainer.activation_file.folder == str(tmp_path / "out" / ".cache")
    assert trainer.host_memory()["activation_file_written_gib"] == 0.0
