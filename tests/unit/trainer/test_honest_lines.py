"""What a run prints says what each number is: the draft's losses are distillation losses, the throughput is
tokens over time, a resumed bar starts at its step, a log file gets elapsed time and an ETA, and a CPU run
has no memory-by-phase table of dashes."""

from types import SimpleNamespace

import pytest
import torch
from transformers import TrainerControl, TrainingArguments

from neutrain.cli.after_training import format_summary, throughput
from neutrain.cli.memory import phase_lines
from neutrain.trainer.progress import LabelledProgressCallback, format_log_line, timing_suffix


def test_the_drafts_losses_are_named_distillation_losses(tmp_path):
    # Before: "before training  held-out loss 3.653" for the draft, beside the target's "held-out loss 4.752".
    from transformers import LlamaConfig, LlamaForCausalLM

    from neutrain.distill.trainer import DistillationTrainer

    cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1)
    trainer = DistillationTrainer(model=LlamaForCausalLM(cfg), teacher_model=LlamaForCausalLM(cfg), divergence="fkl",
                                  args=TrainingArguments(str(tmp_path), report_to="none", use_cpu=True))
    progress = next(c for c in trainer.callback_handler.callbacks if isinstance(c, LabelledProgressCallback))
    assert progress.names == ("distillation loss (forward KL to the target)",
                              "held-out distillation loss (forward KL to the target)")
    line = format_log_line({"eval_loss": 3.653, "eval_acceptance": 0.21}, step=20, max_steps=20, names=progress.names)
    assert line == "step 20/20  held-out distillation loss (forward KL to the target) 3.653  acceptance alpha 0.210"
    done = format_log_line({"train_runtime": 7.0, "train_loss": 1.192}, step=8, max_steps=8, names=progress.names)
    assert done == "step 8/8  training done in 7.0 s, mean distillation loss (forward KL to the target) 1.192"
    assert format_log_line({"loss": 2.0}, step=5, max_steps=20) == "step 5/20  loss 2"  # the target's stay as they were


def test_the_summarys_throughput_is_tokens_over_time():
    # Before: the mean of the windows' rates, 200 tokens/s here, where 6,000 tokens took 40 s.
    history = [{"step": 20, "loss": 5.0, "tokens_per_second": 300.0, "window_tokens": 3000, "window_seconds": 10.0},
               {"step": 40, "loss": 4.0, "tokens_per_second": 100.0, "window_tokens": 3000, "window_seconds": 30.0}]
    assert throughput(history) == {"tokens_per_second": 150.0, "tokens_trained": 6000, "training_seconds": 40.0}
    text = format_summary({"output_dir": "out", "wall_time_s": 50.0, **throughput(history)})
    assert "throughput      150 tokens/s (training: 6,000 tokens in 40 s)" in text
    assert throughput([{"step": 1, "loss": 2.0}]) == {}


@pytest.mark.slow
def test_the_trainer_logs_each_windows_tokens_and_seconds(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from neutrain.trainer import NeuTrainer

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    rows = [{"input_ids": r, "labels": r} for r in torch.randint(0, 32, (8, 12)).tolist()]
    trainer = NeuTrainer(model=model, train_dataset=rows, args=TrainingArguments(
        str(tmp_path), max_steps=4, logging_steps=2, per_device_train_batch_size=2, report_to="none",
        save_strategy="no", use_cpu=True, disable_tqdm=True))
    trainer.train()
    windows = [h for h in trainer.state.log_history if "loss" in h]
    assert [w["window_tokens"] for w in windows] == [48, 48]  # 2 steps x 2 rows x 12 tokens each
    assert all(w["window_seconds"] > 0 for w in windows)
    assert throughput(trainer.state.log_history)["tokens_trained"] == 96


def _state(step, max_steps=200):
    return SimpleNamespace(global_step=step, max_steps=max_steps, is_world_process_zero=True)


def test_a_resumed_progress_bar_starts_at_the_resumed_step(monkeypatch):
    # Before: the bar of a run resumed at step 120 of 200 read 0/200.
    import neutrain.trainer.progress as progress

    bars = []
    monkeypatch.setattr(progress, "tqdm", lambda **kw: bars.append(kw) or SimpleNamespace(close=lambda: None))
    callback = LabelledProgressCallback(bars=True)
    callback.on_train_begin(None, _state(120), TrainerControl())
    assert bars[0]["initial"] == 120 and bars[0]["total"] == 200


def test_lines_written_to_a_log_file_carry_elapsed_time_and_an_eta(monkeypatch, capsys):
    # Before: a line every few minutes on a busy machine, saying neither how long it had run nor how long was left.
    import neutrain.trainer.progress as progress

    clock = [1000.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: clock[0])
    callback = LabelledProgressCallback(bars=False)
    callback.on_train_begin(None, _state(100), TrainerControl())  # resumed at 100: the rate is this launch's
    clock[0] += 125.0
    callback.on_log(None, _state(150), TrainerControl(), logs={"loss": 4.5, "learning_rate": 0.01})
    assert capsys.readouterr().out.strip() == "step 150/200  loss 4.5  lr 0.01  elapsed 2m05s  ETA 2m05s"
    callback.on_log(None, _state(200), TrainerControl(), logs={"eval_loss": 4.7})
    assert "elapsed" not in capsys.readouterr().out  # an evaluation line: no training timing
    assert timing_suffix(7300.0, step=1, first_step=0, max_steps=1) == "elapsed 2h01m"  # done: no ETA


def test_a_terminal_keeps_its_bar_and_plain_lines(monkeypatch, capsys):
    import neutrain.trainer.progress as progress

    written = []
    monkeypatch.setattr(progress, "tqdm", lambda **kw: SimpleNamespace(write=written.append, update=lambda n: None,
                                                                        close=lambda: None))
    callback = LabelledProgressCallback(bars=True)
    callback.on_train_begin(None, _state(0, 10), TrainerControl())
    callback.on_log(None, _state(5, 10), TrainerControl(), logs={"loss": 3.0})
    assert written == ["step 5/10  loss 3"]  # the bar shows the time


@pytest.mark.parametrize("measured", [False, True])
def test_the_memory_by_phase_table_needs_a_measured_phase(measured):
    # Before: on a CPU, a table of dashes beside the planner's GPU predictions.
    entry = {"phase": "train_step", "runs": 1, "predicted_reserved_gib": 0.40,
             **({"peak_allocated_gib": 0.3, "peak_reserved_gib": 0.35, "device_used_gib": 1.1} if measured else {})}
    lines = phase_lines({"phase_memory": {"train_step": entry, "save": {"phase": "save", "predicted_reserved_gib": 0.2}}})
    assert bool(lines) == measured
    assert "memory by phase" not in format_summary({"output_dir": "o", "wall_time_s": 1.0,
                                                    "phase_memory": {"save": {"predicted_reserved_gib": 0.2}}})
