"""Checkpoint trust: nothing in a checkpoint runs, every byte is checksummed,
missing optimizer state is refused, and a damaged file is one line naming it (exit 2), at resume and export.

Each mode's checkpoint is produced once (module-scoped, 2 steps); planted files are then checked with the
in-process verifier, and one real resume per mode runs with a planted pickle. The two-process modes
(replicated, FSDP2, ZeRO-3; gloo on CPU): ``tests/integration/test_distributed_checkpoint_trust.py``.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch

from neutrain.distributed.resume import verify_resume
from neutrain.storage.manifest import MANIFEST, check_file, verify_checkpoint
from neutrain.cli import main
from neutrain.errors import CheckpointError
from tests.helpers import free_port, write_recipe
from tests.integration.test_distributed import MODES as DISTRIBUTED
from tests.integration.test_launch import _run

NO_EVAL = {"eval": {"perplexity": False}, "export": {"format": "none"}}
SINGLE = {
    "single": {"train": {}, "memory": {"weights": "dense"}},
    "compressed": {"train": {"optimizer": "lomo", "learning_rate": 1e-2}, "memory": {"weights": "neuzip-lossless"}},
    "lora": {"train": {}, "memory": {"weights": "neuzip-lossless", "adapter": "lora", "lora_r": 4}},
}
# The file each mode's end-to-end resume finds a pickle in (FSDP2's and ZeRO-3's optimizer shards ran it).
PLANT_AT_RESUME = {"single": "optimizer.pt", "compressed": "scheduler.pt", "lora": "rng_state.pth",
                   "replicated": "rng_state_1.pth", "fsdp2": "optimizer.rank1-of-2.safetensors",
                   "deepspeed": "optimizer.rank0-of-2.safetensors"}
# Here: the single-process modes. A replicated, FSDP2 or ZeRO-3 checkpoint costs a two-process launch: the same
# tests run on them in tests/integration/test_distributed_checkpoint_trust.py.
ALL_MODES = list(SINGLE)


class _Payload:
    """Unpickling this creates ``marker``: what a planted checkpoint file would do on a careless load."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def _recipe(directory: Path, mode: str, **train):
    spec = SINGLE.get(mode) or DISTRIBUTED[mode]
    section = {"max_steps": 2, "save_steps": 2, "logging_steps": 1, "save_total_limit": 3, **spec["train"], **train}
    if mode in DISTRIBUTED:
        section["micro_batch_size"] = 2
    return write_recipe(directory, train=section, memory=spec["memory"], **NO_EVAL)


def _command(recipe: Path, mode: str, *overrides: str) -> list:
    if mode in SINGLE:
        return [sys.executable, "-m", "neutrain", recipe, *overrides]
    entry = "tests.unit.distributed.accelerate_cpu_fsdp" if mode == "fsdp2" else "neutrain"
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
            "-m", entry, recipe, *overrides]


@pytest.fixture(scope="module")
def checkpoint_of(tmp_path_factory, request):
    """``checkpoint_of(mode)``: the recipe and step-2 checkpoint of a 2-step run of ``mode`` (made once; the
    replicated one is the session's, tests/integration/conftest.py)."""
    made: dict[str, tuple[Path, Path]] = {}

    def get(mode: str) -> tuple[Path, Path]:
        if mode == "replicated" and mode not in made:
            recipe, res, directory = request.getfixturevalue("replicated_run")
            assert res.returncode == 0, res.stderr[-3000:]
            made[mode] = recipe, directory / "out" / "checkpoint-2"
        if mode not in made:
            directory = tmp_path_factory.mktemp(mode)
            recipe = _recipe(directory, mode)
            if mode in SINGLE:  # in-process: no interpreter start-up
                assert main(["train", str(recipe)]) == 0
            else:
                res = _run(_command(recipe, mode))
                assert res.returncode == 0, res.stderr[-3000:]
            made[mode] = recipe, directory / "out" / "checkpoint-2"
        return made[mode]

    return get


def _copy(checkpoint: Path, tmp_path: Path) -> Path:
    target = tmp_path / checkpoint.name
    shutil.copytree(checkpoint, target)
    return target


def _plant(checkpoint: Path, rel: str, marker: Path) -> None:
    """Replace ``rel`` with a pickle that creates ``marker``, and forge the manifest to match (as an attacker would)."""
    path = checkpoint / rel
    if path.suffix in (".pt", ".pth", ".bin"):
        torch.save({"state": _Payload(marker)}, path)
    else:
        path.write_bytes(pickle.dumps(_Payload(marker)))
    manifest = checkpoint / MANIFEST
    if rel != MANIFEST and manifest.exists():
        raw = json.loads(manifest.read_text())
        raw["files"][rel] = {"size": path.stat().st_size, "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
        manifest.write_text(json.dumps(raw))


def _world(mode: str) -> tuple[str | None, int]:
    return (None, 1) if mode in SINGLE else (mode, 2)


def _flip(path: Path, tensor: str) -> None:
    """Flip one byte in the middle of ``tensor``'s data in a safetensors file."""
    raw = bytearray(path.read_bytes())
    start = 8 + int.from_bytes(raw[:8], "little")
    begin, end = json.loads(raw[8:start])[tensor]["data_offsets"]
    raw[start + (begin + end) // 2] ^= 0x10
    path.write_bytes(bytes(raw))


def _one_error_line(err: str, *needles: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("neutrain: error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


# ---- 1. no code runs from a checkpoint ---------------------------------------------------------------------


@pytest.mark.parametrize("mode", ALL_MODES)
def test_every_file_of_a_checkpoint_refuses_a_planted_pickle(mode, checkpoint_of, tmp_path):
    _, checkpoint = checkpoint_of(mode)
    files = sorted(p.relative_to(checkpoint).as_posix() for p in checkpoint.rglob("*") if p.is_file())
    assert MANIFEST in files
    mode_name, world = _world(mode)
    for rank in range(world):
        verify_resume(checkpoint, mode_name, rank, world)  # the untouched checkpoint holds no pickle at all
    marker, copy = tmp_path / "marker", _copy(checkpoint, tmp_path)
    for rel in files:
        saved = {name: (copy / name).read_bytes() for name in {rel, MANIFEST}}
        _plant(copy, rel, marker)
        with pytest.raises(CheckpointError, match=re.escape(rel.rpartition("/")[2])):
            verify_resume(copy, mode_name, 0, world)
        assert not marker.exists(), f"a pickle planted in {rel} ran"
        for name, content in saved.items():
            (copy / name).write_bytes(content)


def test_sharded_optimizer_state_is_never_unpickled(tmp_path):
    """FSDP2's and ZeRO-3's per-rank optimizer files were loaded with weights_only=False: a planted pickle ran.
    They are safetensors now (the rest of the state as JSON): a pickle in their place is not even read as one."""
    from neutrain.distributed.fsdp import load_optimizer_shard, optimizer_shard_file

    marker = tmp_path / "marker"
    torch.save({"state": _Payload(marker)}, optimizer_shard_file(str(tmp_path), 0, 2))
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    with pytest.raises(CheckpointError, match="not a neutrain optimizer state file"):
        load_optimizer_shard(optimizer, str(tmp_path), 0, 2)
    assert not marker.exists()


@pytest.mark.parametrize("mode", ALL_MODES)
def test_resume_from_a_planted_pickle_exits_2_and_runs_nothing(mode, checkpoint_of, tmp_path, capsys):
    recipe, checkpoint = checkpoint_of(mode)
    copy = _copy(checkpoint, tmp_path)
    marker = tmp_path / "marker"
    _plant(copy, PLANT_AT_RESUME[mode], marker)
    overrides = (f"train.output_dir={tmp_path / 'resumed'}", "train.max_steps=4", f"train.resume_from_checkpoint={copy}")
    if mode in SINGLE:  # the CLI in this process: the same path as `neutrain train`, without a start-up
        assert main(["train", str(recipe), *overrides]) == 2 and not marker.exists()
        _one_error_line(capsys.readouterr().err, PLANT_AT_RESUME[mode], "refused")
        return
    res = _run(_command(recipe, mode, *overrides))
    assert res.returncode != 0 and not marker.exists(), res.stderr[-3000:]
    # Every rank checks every file and stops with the same line, but torchrun tears the group down as soon
    # as the first rank exits: on a loaded machine the other rank may be killed before it prints (a loaded CI
    # machine saw 1 line instead of 2). So: at least one line, and every line names the planted file.
    errors = [line for line in res.stderr.splitlines() if line.startswith("neutrain: error: ")]
    assert 1 <= len(errors) <= 2 and all(PLANT_AT_RESUME[mode] in line for line in errors), res.stderr[-3000:]


def test_training_args_are_json_and_an_old_pickle_is_refused(checkpoint_of, tmp_path):
    _, checkpoint = checkpoint_of("single")
    assert not (checkpoint / "training_args.bin").exists()
    assert json.loads((checkpoint / "training_args.json").read_text())["max_steps"] == 2
    old = tmp_path / "training_args.bin"
    torch.save({"x": torch.zeros(1)}, old)  # even a harmless one: nothing reads it, and it may be anything
    with pytest.raises(CheckpointError, match="training_args.bin.*delete it"):
        check_file(old)


# ---- 5. every byte checksummed; 9. a corrupt compressed weight is named ------------------------------------


def _tensor_names(path: Path) -> list[str]:
    raw = path.read_bytes()
    return [k for k in json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")]) if k != "__metadata__"]


@pytest.mark.parametrize("mode,file,tensor", [("single", "model.safetensors", "model.norm.weight"),
                                               ("lora", "adapter_model.safetensors", "lora_B")])
def test_a_flipped_byte_in_a_dense_tensor_is_named(mode, file, tensor, checkpoint_of, tmp_path):
    _, checkpoint = checkpoint_of(mode)
    copy = _copy(checkpoint, tmp_path)
    name = next(n for n in _tensor_names(copy / file) if tensor in n)
    _flip(copy / file, name)
    check_file(copy / file)  # still a well-formed safetensors file: only the checksum can tell
    with pytest.raises(CheckpointError, match=rf"{re.escape(file)}' fails its sha256 checksum in tensor '{re.escape(name)}'"):
        verify_checkpoint(copy)


def test_a_flipped_byte_is_refused_at_resume_export_and_eval_and_old_checkpoints_warn(checkpoint_of, tmp_path, capsys, caplog):
    recipe, checkpoint = checkpoint_of("single")
    copy = _copy(checkpoint, tmp_path)
    _flip(copy / "model.safetensors", "model.layers.0.input_layernorm.weight")
    out = tmp_path / "resumed"
    assert main(["train", str(recipe), f"train.output_dir={out}", "train.max_steps=4",
                 f"train.resume_from_checkpoint={copy}"]) == 2
    _one_error_line(capsys.readouterr().err, "model.safetensors", "model.layers.0.input_layernorm.weight")
    assert main(["export", str(copy), "--output", str(tmp_path / "export")]) == 2
    _one_error_line(capsys.readouterr().err, "model.safetensors", "model.layers.0.input_layernorm.weight")
    assert not (tmp_path / "export").exists()
    assert main(["eval", str(copy), f"train.output_dir={tmp_path / 'eval'}", "--recipe", str(recipe)]) == 2
    _one_error_line(capsys.readouterr().err, "model.safetensors", "model.layers.0.input_layernorm.weight")
    # A checkpoint from before manifests: loads, with one warning.
    old = _as_written_before_manifests(_copy(checkpoint, tmp_path / "old"))
    with caplog.at_level("WARNING", logger="neutrain"):
        assert main(["export", str(old), "--output", str(tmp_path / "old-export")]) == 0
    warnings = [r.getMessage() for r in caplog.records if MANIFEST in r.getMessage()]
    assert len(warnings) == 1 and "not checksummed" in warnings[0]
    # Exports carry a manifest too: a flipped byte in one is named when it is loaded.
    export = tmp_path / "old-export"
    assert (export / MANIFEST).exists()
    _flip(export / "model.safetensors", "lm_head.weight")
    from neutrain.export import load_checkpoint_model

    with pytest.raises(CheckpointError, match="tensor 'lm_head.weight'"):
        load_checkpoint_model(export)


def _as_written_before_manifests(checkpoint: Path) -> Path:
    """``checkpoint`` as a neutrain from before manifests wrote it: no manifest, none of the files (or the
    trainer_state.json mark) that came with them."""
    from neutrain.storage.manifest import MANIFEST_MARK, WRITTEN_WITH_MANIFEST

    for name in (MANIFEST, *WRITTEN_WITH_MANIFEST):
        (checkpoint / name).unlink(missing_ok=True)
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    state["stateful_callbacks"].pop(MANIFEST_MARK)
    (checkpoint / "trainer_state.json").write_text(json.dumps(state))
    return checkpoint


@pytest.mark.parametrize("also_deleted", [(), ("neutrain_run.json", "training_args.json")], ids=["manifest", "manifest-and-its-companions"])
def test_a_checkpoint_of_this_version_without_its_manifest_is_refused_as_damaged(checkpoint_of, tmp_path, capsys,
                                                                                also_deleted):
    """Deleting the manifest switched the checksums off: a flipped weight resumed after a warning blaming
    "an older neutrain". A checkpoint this version wrote is refused without it, whatever else was deleted."""
    recipe, checkpoint = checkpoint_of("single")
    copy = _copy(checkpoint, tmp_path)
    _flip(copy / "model.safetensors", "model.layers.0.input_layernorm.weight")
    for name in (MANIFEST, *also_deleted):
        (copy / name).unlink(missing_ok=True)
    out = tmp_path / "resumed"
    for command in (["train", str(recipe), f"train.output_dir={out}", "train.max_steps=4",
                     f"train.resume_from_checkpoint={copy}"],
                    ["export", str(copy), "--output", str(tmp_path / "export")]):
        assert main(command) == 2, command
        line = _one_error_line(capsys.readouterr().err, f"checkpoint '{copy}' has no {MANIFEST}, yet it was written by "
                                                        "a neutrain that writes one")
        assert "older" not in line
    assert not (out / "checkpoint-4").exists() and not (tmp_path / "export").exists()
    # An export is checked the same way: its neutrain_export.json says it had a manifest.
    export = tmp_path / "an-export"
    assert main(["export", str(checkpoint), "--output", str(export)]) == 0
    (export / MANIFEST).unlink()
    assert main(["generate", str(export), "--prompt", "x", "--max-new-tokens", "1", "--device", "cpu"]) == 2
    _one_error_line(capsys.readouterr().err, "neutrain_export.json")


def test_a_corrupt_compressed_weight_names_the_file_and_the_tensor(checkpoint_of, tmp_path):
    from neutrain.export import load_checkpoint_model

    _, checkpoint = checkpoint_of("compressed")
    copy = _copy(checkpoint, tmp_path)
    blob = next(n for n in _tensor_names(copy / "model.safetensors") if n.endswith("mlp.up_proj.weight.stream"))
    _flip(copy / "model.safetensors", blob)
    with pytest.raises(CheckpointError, match=rf"model\.safetensors' fails its sha256 checksum in tensor '{re.escape(blob)}'"):
        load_checkpoint_model(copy)
    _as_written_before_manifests(copy)  # as an older neutrain wrote it: the codec's own checksum catches it
    with pytest.raises(CheckpointError) as err:
        load_checkpoint_model(copy)
    message = str(err.value)
    assert "model.safetensors" in message and blob.removesuffix(".stream") in message and "checksum mismatch" in message


# ---- 4. missing optimizer state is refused unless the reset is chosen -------------------------------------


def test_missing_optimizer_or_scheduler_is_refused_unless_reset_is_chosen(checkpoint_of, tmp_path, capsys, caplog):
    recipe, checkpoint = checkpoint_of("single")
    for missing in ("optimizer.pt", "scheduler.pt"):
        copy = _copy(checkpoint, tmp_path / missing)
        (copy / missing).unlink()
        assert main(["train", str(recipe), f"train.output_dir={tmp_path / 'refused'}", "train.max_steps=3",
                     f"train.resume_from_checkpoint={copy}"]) == 2
        _one_error_line(capsys.readouterr().err, missing, "train.resume_reset_optimizer")
    with caplog.at_level("WARNING", logger="neutrain"):
        assert main(["train", str(recipe), f"train.output_dir={tmp_path / 'reset'}", "train.max_steps=3",
                     f"train.resume_from_checkpoint={copy}", "train.resume_reset_optimizer=true"]) == 0
    assert any("resume_reset_optimizer" in r.getMessage() for r in caplog.records)
    assert json.loads((tmp_path / "reset" / "summary.json").read_text())["steps"] == 3


@pytest.mark.parametrize("mode,missing", [("fsdp2", "optimizer.rank1-of-2.safetensors"), ("fsdp2", "scheduler.pt"),
                                          ("fsdp2", "model.rank1-of-2.safetensors"),
                                          ("deepspeed", "optimizer.rank1-of-2.safetensors"),
                                          ("deepspeed", "zero3_partitions.rank1-of-2.safetensors")])
def test_a_missing_per_rank_shard_is_refused(mode, missing, tmp_path):
    """Laid out as FSDP2/ZeRO-3 write them (the real ones: test_every_file_of_a_checkpoint_refuses_a_planted_pickle)."""
    from neutrain.distributed import resume_files

    for rank in range(2):
        for name in (n for group in resume_files(mode, rank, 2) for n in group):
            (tmp_path / name).write_bytes(b"")
    (tmp_path / "trainer_state.json").write_text("{}")
    (tmp_path / missing).unlink()
    with pytest.raises(CheckpointError, match=re.escape(missing)):
        verify_resume(tmp_path, mode, 1, 2)
    if not missing.startswith(("model", "zero3")):  # weights are never optional
        with pytest.raises(CheckpointError, match="is empty or truncated|corrupt or truncated"):
            verify_resume(tmp_path, mode, 1, 2, reset_optimizer=True)  # the rest is still checked


# ---- 11. a damaged file is one line naming it, exit 2, at resume and export --------------------------------

DAMAGE = {
    "truncated model.safetensors": ("model.safetensors", lambda p: p.write_bytes(p.read_bytes()[:-100])),
    "empty model.safetensors": ("model.safetensors", lambda p: p.write_bytes(b"")),
    "missing trainer_state.json": ("trainer_state.json", lambda p: p.unlink()),
    "truncated trainer_state.json": ("trainer_state.json", lambda p: p.write_text(p.read_text()[:40])),
    "truncated optimizer.pt": ("optimizer.pt", lambda p: p.write_bytes(p.read_bytes()[:1000])),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_file_is_one_line_at_resume_and_export(damage, checkpoint_of, tmp_path, capsys):
    recipe, checkpoint = checkpoint_of("single")
    file, spoil = DAMAGE[damage]
    for manifest in (True, False):
        copy = _copy(checkpoint, tmp_path / f"manifest-{manifest}")
        if not manifest:
            _as_written_before_manifests(copy)  # the file's own format check, as for an older checkpoint
        spoil(copy / file)
        assert main(["train", str(recipe), f"train.output_dir={tmp_path / 'resumed'}", "train.max_steps=3",
                     f"train.resume_from_checkpoint={copy}"]) == 2
        _one_error_line(capsys.readouterr().err, file)
        if file != "trainer_state.json" or manifest:  # an export needs no trainer state unless the manifest lists it
            assert main(["export", str(copy), "--output", str(tmp_path / "export")]) == 2
            _one_error_line(capsys.readouterr().err, file)
