"""What a user sees on a run: announced phases, labelled bars, numbers as numbers, no noise, a PNG, a sample.

One tiny run through ``python -m neutrain`` (as a user launches it), with max_steps below
logging_steps, which used to leave no loss line and no PNG.
"""

import os
import subprocess
import sys
from pathlib import Path

from neutrain.trainer.callbacks import read_metrics
from tests.helpers import write_recipe

REPO = Path(__file__).resolve().parents[2]


def test_a_run_announces_its_phases_prints_numbers_and_ends_with_a_sample(tmp_path):
    recipe = write_recipe(tmp_path, train={"max_steps": 3, "logging_steps": 5, "save_steps": 3},
                          eval={"sample_prompt": "def ", "sample_tokens": 8})
    env = {k: v for k, v in os.environ.items() if k not in ("DISABLE_TQDM", "DS_ACCELERATOR")}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, "-m", "neutrain", "train", str(recipe)], env=env, capture_output=True,
                         text=True, timeout=600, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    out, err = res.stdout, res.stderr
    for phase in ("== training: 3 steps ==", "== held-out evaluation ==", "== export: hf ==", "== sample =="):
        assert phase in out, f"phase not announced: {phase}\n{out}"
    assert out.index("== training") < out.index("== held-out") < out.index("== export") < out.index("== sample")
    # The last step is logged although logging_steps (5) > max_steps (3); numbers print as numbers.
    assert "step 3/3  loss " in out
    assert "{'loss'" not in out + err and "'train_runtime'" not in out + err
    # stderr is a pipe here, as in a log file or CI: no progress bar, so no carriage-return redraws;
    # the log lines still say how training goes. (On a terminal the bars say what they count.)
    assert "\r" not in out + err and "training: 100%" not in err and "tokenising" not in err
    # Warnings a user cannot act on are gone.
    for noise in ("pin_memory", "Setting accelerator to CPU", "Generating train split", "right-padding"):
        assert noise not in out + err, noise
    # The summary says what its losses are (means over logging windows), and ends with the sample: the
    # prompt and its continuation, sent raw because the model was trained on raw text.
    summary = out[out.index("=== neutrain run summary ==="):]
    assert "(mean of steps 1-3) -> " in summary and "(mean of steps 1-3), 3 steps" in summary
    assert "continuation of eval.sample_prompt, sent raw" in summary
    sample = summary.split("sample          ", 1)[1].splitlines()[1:]
    assert sample and sample[0].startswith("    def ")
    # The PNG exists and its data hold train loss, learning rate and the held-out loss.
    run = tmp_path / "out"
    assert (run / "training_curves.png").stat().st_size > 1000
    records = read_metrics(run / "metrics.jsonl")
    assert any(r.get("step") == 3 and "loss" in r and "learning_rate" in r for r in records)
    assert any("eval_loss" in r for r in records)
