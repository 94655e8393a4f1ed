"""``train.overwrite_output_dir`` leaves nothing of the previous run to be taken for the new one's.

It removed checkpoints and metrics but kept ``export/``, ``draft/``, ``distill/`` and ``eval/``, so
``neutrain generate RUN/export`` served the previous model after a new run that exported nothing (or
failed before its export); and it deleted such names as "of the previous run" when the user had put
them there. It now deletes what the previous run listed as written (its ``.neutrain-run``), and
nothing else. In-process: a run with an export and an evaluation, then a new run over it.
"""

from __future__ import annotations

from neutrain.cli import main as neutrain
from tests.helpers import one_error_line, write_recipe


def test_overwrite_removes_every_output_of_the_previous_run_and_nothing_else(tmp_path, capsys):
    recipe = write_recipe(tmp_path, train={"max_steps": 2, "save_steps": 2}, eval={"perplexity": True},
                          export={"format": "hf"})
    out = tmp_path / "out"
    assert neutrain(["train", str(recipe)]) == 0
    assert neutrain(["eval", str(recipe)]) == 0  # its eval/ is listed as the run's too
    (out / "notes").mkdir()  # the user's own, put into the run directory after the run
    (out / "notes" / "todo.txt").write_text("compare with the baseline")
    (out / "distill").mkdir()  # written by the user, not by a distillation: kept
    (out / "distill" / "mine.txt").write_text("mine")
    (out / "base").mkdir()  # not a neutrain export: the user's, kept
    (out / "base" / "weights.bin").write_bytes(b"mine")
    old = {name for name in ("export", "eval", "summary.json", "checkpoint-2") if (out / name).exists()}
    assert old == {"export", "eval", "summary.json", "checkpoint-2"}
    assert neutrain(["train", str(recipe), "train.overwrite_output_dir=true", "train.learning_rate=1e-3",
                     "export.format=none", "eval.perplexity=false"]) == 0
    assert not [name for name in old if name not in ("summary.json", "checkpoint-2") and (out / name).exists()]
    assert (out / "notes" / "todo.txt").read_text() == "compare with the baseline"
    assert (out / "distill" / "mine.txt").read_text() == "mine"
    assert (out / "base" / "weights.bin").read_bytes() == b"mine"
    capsys.readouterr()
    assert neutrain(["generate", str(out / "export"), "--prompt", "x", "--max-new-tokens", "1"]) == 2
    assert "export" in one_error_line(capsys.readouterr().err)
