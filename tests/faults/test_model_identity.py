"""Every model a command loads is the one it claims to be: bases checked against their manifests, a LoRA adapter
merged only onto its own base, a resume refused when a model-defining key changes, and no file a manifest
does not list.

Before: ``model.base_model`` naming a neutrain export with a flipped byte trained; ``neutrain export LORA_CKPT
--base OTHER`` merged onto any model (another vocabulary even) and recorded no base; a dense fp32 run resumed
with ``model.dtype=bfloat16`` rounded its weights without a word; a checkpoint whose manifest entry for
``model.safetensors`` was deleted, with a bit flipped in that file, resumed with exit 0.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from neutrain.cli import main as neutrain
from neutrain.storage.manifest import MANIFEST
from tests.helpers import TINY_LLAMA, finished_run, one_error_line, write_recipe


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A finished dense fp32 run (checkpoint-2) with an hf export."""
    return finished_run(tmp_path_factory.mktemp("model"), train={"max_steps": 2, "save_steps": 2},
                        eval={"perplexity": False}, export={"format": "hf"})


@pytest.fixture(scope="module")
def lora(tmp_path_factory) -> Path:
    """A finished LoRA run on a random base, which it wrote to <out>/base."""
    return finished_run(tmp_path_factory.mktemp("lora"), train={"max_steps": 2, "save_steps": 2},
                        eval={"perplexity": False}, export={"format": "none"},
                        memory={"weights": "dense", "adapter": "lora", "lora_r": 4})


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x01  # in the last tensor's bytes
    path.write_bytes(bytes(data))


def _unlist(directory: Path, name: str) -> None:
    manifest = json.loads((directory / MANIFEST).read_text())
    del manifest["files"][name]
    (directory / MANIFEST).write_text(json.dumps(manifest))


DAMAGE = {  # what is done to a copy of a neutrain model -> the words that name it
    "intact": (lambda d: None, None),
    "a-flipped-byte": (lambda d: _flip(d / "model.safetensors"), "fails its sha256 checksum"),
    "an-unlisted-file": (lambda d: (d / "extra.json").write_text("{}"), "is not listed in"),
    "an-entry-deleted-and-a-bit-flipped": (lambda d: (_unlist(d, "model.safetensors"), _flip(d / "model.safetensors")),
                                           "is not listed in"),
}


BASE_CASES = [("export", "intact"), *((source, damage) for source in ("export", "checkpoint-2") for damage in DAMAGE
                                     if damage != "intact")]


@pytest.mark.parametrize("source,damage", BASE_CASES, ids=[f"{d}-{s}" for s, d in BASE_CASES])
def test_a_base_model_that_is_a_neutrain_model_is_checked_against_its_manifest(run, tmp_path, capsys, source, damage):
    base = tmp_path / "base"
    shutil.copytree(run / source, base)
    do, words = DAMAGE[damage]
    do(base)
    if source == "checkpoint-2":  # a checkpoint has its tokenizer beside it, in the run directory
        shutil.copytree(run / "tokenizer", tmp_path / "tokenizer")
    recipe = write_recipe(tmp_path, train={"max_steps": 1, "save_steps": 1}, eval={"perplexity": False},
                          export={"format": "none"},
                          model={"init": "pretrained", "base_model": str(base), "config": None,
                                 "tokenizer": str(base if source == "export" else tmp_path / "tokenizer")})
    code = neutrain(["train", str(recipe)])
    if words is None:
        assert code == 0, capsys.readouterr().err
        return
    assert code == 2
    line = one_error_line(capsys.readouterr().err)
    assert str(base) in line and words in line, line
    assert not (tmp_path / "out" / "checkpoint-1").exists()


def _other_vocabulary(directory: Path) -> Path:
    """A model of the same shape with another vocabulary and tokenizer (what a wrong --base looks like)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from neutrain.data import byte_tokenizer

    config = LlamaConfig(**{k: v for k, v in TINY_LLAMA.items() if k != "model_type"}, vocab_size=300)
    LlamaForCausalLM(config).save_pretrained(directory)
    byte_tokenizer().save_pretrained(directory)
    return directory


BASES = {  # --base given to `neutrain export <adapter checkpoint>` -> refused?
    "its-own-implicit": (lambda lora, run, tmp: None, False),
    "its-own-explicit": (lambda lora, run, tmp: lora / "base", False),
    "a-copy-of-its-own": (lambda lora, run, tmp: shutil.copytree(lora / "base", tmp / "copy"), False),
    "another-model-of-the-same-shape": (lambda lora, run, tmp: run / "export", True),
    "another-vocabulary": (lambda lora, run, tmp: _other_vocabulary(tmp / "vocab300"), True),
}


@pytest.mark.parametrize("forced", [False, True], ids=["plain", "force-base"])
@pytest.mark.parametrize("case", BASES)
def test_a_lora_adapter_is_merged_only_onto_its_own_base_unless_forced(lora, run, tmp_path, capsys, case, forced):
    make, other = BASES[case]
    base = make(lora, run, tmp_path)
    out = tmp_path / "merged"
    argv = ["export", str(lora / "checkpoint-2"), "--output", str(out)]
    argv += ["--base", str(base)] if base is not None else []
    argv += ["--force-base"] if forced else []
    code = neutrain(argv)
    err = capsys.readouterr().err
    if other and not forced:
        assert code == 2
        line = one_error_line(err)
        assert f"--base '{base}' is not the base adapter checkpoint" in line and "--force-base" in line, line
        assert not out.exists()
        return
    if code != 0 and case == "another-vocabulary":  # forced onto a model its adapters do not fit: refused by shape
        assert one_error_line(err)
        return
    assert code == 0, err
    recorded = json.loads((out / "neutrain_export.json").read_text())["base"]
    assert recorded["path"] == str(base or lora / "base") and recorded["fingerprint"].startswith(("manifest:", "sampled:"))


def test_a_dense_fp32_run_resumed_in_bfloat16_is_refused(run, capsys):
    recipe = run.parent / "tiny.yaml"
    assert neutrain(["train", str(recipe), "train.max_steps=3", "train.resume_from_checkpoint=true",
                     "model.dtype=bfloat16", "export.format=none"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "model.dtype=float32" in line and "model.dtype=bfloat16" in line, line
    assert not (run / "checkpoint-3").exists()


COMMANDS = {  # how each command meets a damaged checkpoint or export copy
    "resume": lambda copy, run: ["train", str(run.parent / "tiny.yaml"), f"train.output_dir={copy.parent / 'new'}",
                                 f"train.resume_from_checkpoint={copy}", "train.max_steps=3", "export.format=none"],
    "export": lambda copy, run: ["export", str(copy), "--output", str(copy.parent / "exported")],
    "eval": lambda copy, run: ["eval", str(copy), f"train.output_dir={copy.parent / 'evals'}", "--recipe",
                               str(run.parent / "tiny.yaml")],
    "generate": lambda copy, run: ["generate", str(copy), "--prompt", "x", "--max-new-tokens", "1"],
}


@pytest.mark.parametrize("damage", ["an-unlisted-file", "an-entry-deleted-and-a-bit-flipped"])
@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_refuses_a_file_its_manifest_does_not_list(run, tmp_path, capsys, command, damage):
    source = "export" if command == "generate" else "checkpoint-2"
    copy = tmp_path / "copy" / source
    shutil.copytree(run / source, copy)
    if source == "checkpoint-2":
        shutil.copytree(run / "tokenizer", copy.parent / "tokenizer")
    DAMAGE[damage][0](copy)
    assert neutrain(COMMANDS[command](copy, run)) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "is not listed in neutrain_manifest.json" in line, line
