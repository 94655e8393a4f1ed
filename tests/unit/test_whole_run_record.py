"""The 70B whole run's record (benchmarks/offload/offload_recipe.py --whole-run): what it reads, and when its target holds.

The target card_24gb_70b_whole_run_ok holds only when every command exited 0, the resumed and the uninterrupted
checkpoint-5 list the same tensors with the same sha256, and the budgeted and unbounded greedy texts are the same.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from benchmarks.offload import offload_recipe
from benchmarks.memory._whole_run import llama_bf16_gib

FIT = ("memory: neuzip-lossless, offloading activations and 77 of 80 decoder layers' weights: on the GPU it needs "
       "141.2 GiB (phase 'train_step'), the budget is 22.00 GiB; predicted peak 20.25 GiB reserved in phase "
       "'train_step', 105.12 GiB of host memory, 281.68 GiB over PCIe a step; predicted 620 tok/s")
COMMANDS = ("train", "resume", "straight", "compare", "export", "generate_budget", "generate_unbounded")


def _run(path: Path, steps: list[int]) -> Path:
    path.mkdir(parents=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 2.0, "tokens_per_second": 620.0}) + "\n"
                                                for s in steps))
    phases = {"train_step": {"phase": "train_step", "runs": len(steps), "peak_allocated_gib": 19.5,
                             "peak_reserved_gib": 21.9, "device_used_gib": 22.6, "predicted_reserved_gib": 20.25},
              "save": {"phase": "save", "runs": 1, "peak_allocated_gib": 3.0, "peak_reserved_gib": 4.0,
                       "device_used_gib": 5.1, "predicted_reserved_gib": 4.2}}
    (path / "summary.json").write_text(json.dumps({"phase_memory": phases, "peak_rss_gib": 97.4,
                                                   "memory_fit": {"host_gib": 88.3, "predicted_reserved_gib": 20.25}}))
    return path


def _manifest(path: Path, tensors: dict[str, str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"format": "neutrain-manifest-1", "files": {
        "model.safetensors": {"size": 1, "sha256": "f" * 64, "tensors": tensors}, "trainer_state.json": {"size": 2}}}))
    return path


def _main(monkeypatch, *args: str) -> int:
    monkeypatch.setattr(sys, "argv", ["offload_recipe.py", *args])
    return offload_recipe.main()


@pytest.fixture()
def whole_run(tmp_path, monkeypatch, capsys):
    """A state folder as gpu_70b_recipe.sh leaves it after a run where everything went right; returns a function
    that records it (exit code, the 70b_recipe_22gib part, its target)."""
    state = tmp_path / "state"
    state.mkdir()
    (state / "70b_stages.txt").write_text("".join(f"{c}_s=100\n{c}_rc=0\n" for c in COMMANDS))
    for run in ("train", "resume", "straight"):
        (state / f"70b_{run}.log").write_text(f"loading\n{FIT}\nstep 1\n")
    (state / "samples.csv").write_text("train,1,22600,100000000000,99000000\ntrain,3,23000,110000000000,101000000\n"
                                       "generate_budget,9,21000,20000000000,abc\nbroken line\n")
    (state / "70b_generate_budget.log").write_text(
        "generate: 16 new tokens in 40.00 s (0.4 tok/s, prefill included)\ngenerate: peak GPU memory 18.10 GiB "
        "allocated, 20.50 reserved, 21.30 in use on the device at the end; predicted 20.90 reserved\n")
    for kind in ("budget", "unbounded"):
        (state / f"generate_{kind}.txt").write_text("    return fibonacci(n - 1)\n")
    (state / "export_hf.txt").write_text("not run: disk holds 30 GiB, needs 131.4 GiB")
    sums = {"model.layers.0.mlp.weight.stream": "a" * 64, "model.norm.weight": "b" * 64}
    first = _manifest(tmp_path / "resumed" / "neutrain_manifest.json", sums)
    second = _manifest(tmp_path / "straight-ckpt" / "neutrain_manifest.json", sums)
    runs = [_run(tmp_path / "train", [1, 2, 3, 4]), _run(tmp_path / "resume", [5]), _run(tmp_path / "straight", [1, 2, 3, 4, 5])]
    export = tmp_path / "export"
    export.mkdir()
    (export / "config.json").write_text("{}")
    (export / "model.safetensors").write_bytes(b"\0" * 64)
    for name, value in {"OUT": str(tmp_path / "out"), "NEUTRAIN_GIT_COMMIT": "0" * 40, "NEUTRAIN_GIT_DIRTY": "0"}.items():
        monkeypatch.setenv(name, value)
    (tmp_path / "out").mkdir()
    (tmp_path / "results").mkdir()

    def record() -> tuple[int, dict, dict]:
        capsys.readouterr()
        compared = _main(monkeypatch, "--compare-manifests", str(first), str(second))
        (state / "manifests.json").write_text(capsys.readouterr().out)
        assert compared == (0 if json.loads((state / "manifests.json").read_text())["match"] else 1)
        rc = _main(monkeypatch, "--whole-run", str(state), "--train", str(runs[0]), "--resume", str(runs[1]),
                   "--straight", str(runs[2]), "--budget", "22", "--steps", "4", "--export", str(export),
                   "--results-dir", str(tmp_path / "results"))
        out = json.loads((tmp_path / "out" / "offload.json").read_text())
        return rc, out["results"]["70b_recipe_22gib"], out["targets"]["card_24gb_70b_whole_run_ok"]

    return state, second, record


def test_a_whole_run_where_everything_went_right_meets_the_target_and_records_each_phase(whole_run):
    _, _, record = whole_run
    rc, result, target = record()
    assert rc == 0 and target["value"] is True and target["goal"] is True, result
    assert result["checkpoint_5_manifests"] == {"match": True, "tensors": 2, "differ_count": 0, "differ": []}
    assert result["stages"]["export"] == {"seconds": 100.0, "exit_code": 0} and result["total_seconds"] == 700.0
    train = result["runs"]["train"]
    assert train["fit"]["predicted_reserved_gib"] == 20.25 and train["fit"]["predicted_host_gib"] == 105.12
    assert train["phases"]["train_step"]["peak_reserved_gib"] == 21.9
    assert train["phases"]["train_step"]["predicted_reserved_gib"] == 20.25
    assert train["peak_rss_gib"] == 97.4 and train["predicted_pinned_host_gib"] == 88.3
    assert result["samples"]["train"] == {"device_used_gib": 22.46, "host_used_gib": 102.45, "process_peak_rss_gib": 96.32}
    assert "process_peak_rss_gib" not in result["samples"]["generate_budget"]  # a torn sample is left out
    assert result["generate"]["same"] and result["generate"]["budget_peak"]["predicted_reserved_gib"] == 20.9
    assert result["export_hf"].startswith("not run: disk holds 30 GiB")


def test_checkpoints_that_differ_in_one_tensor_fail_the_target(whole_run):
    state, second, record = whole_run
    manifest = json.loads(second.read_text())
    manifest["files"]["model.safetensors"]["tensors"]["model.norm.weight"] = "c" * 64
    second.write_text(json.dumps(manifest))
    rc, result, target = record()
    assert rc == 1 and target["value"] is False
    assert result["checkpoint_5_manifests"]["differ"] == ["model.safetensors/model.norm.weight"]


@pytest.mark.parametrize("broken", ["text", "exit code", "missing stage"])
def test_other_texts_a_failed_command_or_a_stage_not_run_fail_the_target(whole_run, broken):
    state, _, record = whole_run
    stages = state / "70b_stages.txt"
    if broken == "text":
        (state / "generate_unbounded.txt").write_text("    return n\n")
    elif broken == "exit code":
        stages.write_text(stages.read_text() + "generate_budget_rc=1\n")  # the last line of a stage wins
    else:
        stages.write_text(stages.read_text().replace("straight_rc=0\n", ""))
    rc, result, target = record()
    assert rc == 1 and target["value"] is False
    expected = {"text": [], "exit code": ["generate_budget"], "missing stage": ["straight"]}[broken]
    assert result["failed_commands"] == expected


def test_the_dense_export_size_is_the_llama_70bs_bf16_bytes():
    config = {"hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80, "vocab_size": 128256,
              "num_attention_heads": 64, "num_key_value_heads": 8, "tie_word_embeddings": False}
    assert llama_bf16_gib(config) == pytest.approx(131.4, abs=0.1)  # 70.55 B parameters


def test_the_host_memory_target_and_the_pcie4_projection_come_from_the_training_run(whole_run, tmp_path):
    _, _, record = whole_run
    summary_path = tmp_path / "train" / "summary.json"
    summary = json.loads(summary_path.read_text())
    summary.update(steps=4, tokens_per_second=400.0, host_memory={
        "peak_rss_gib": 90.5, "host_pinned_peak_gib": 4.0, "weight_store_pinned_gib": 88.4,
        "link_h2d_gib": 4 * 180.0, "link_d2h_gib": 4 * 100.0, "activation_file_written_gib": 4 * 12.75,
        "activation_file_read_gib": 4 * 12.75})
    summary_path.write_text(json.dumps(summary))
    record()
    out = json.loads((tmp_path / "out" / "offload.json").read_text())
    host = out["targets"]["card_24gb_70b_host_gib"]
    assert host["value"] == 94.5 and host["goal"] == "<= 100" and host["met"] is True
    assert host["host_used_above_idle_gib"] == pytest.approx((110e9 - 100e9) / 2**30, abs=0.01)  # over the first sample
    projection = out["results"]["70b_recipe_22gib"]["pcie4_projection"]
    assert projection["h2d_gib_per_step"] == 180.0 and projection["d2h_gib_per_step"] == 100.0
    floor = 180 * 2**30 / 25e9  # the busier direction over 25 GB/s
    assert projection["link_floor_s"] == round(floor, 3) and projection["measured_step_s"] == round(16384 / 400, 3)
    assert projection["tokens_per_s"] == 400.0 and projection["activation_file_gib_per_step"] == 12.75
    # Without the summary's figures the sampled VmHWM of the train stage stands for the host's.
    summary.pop("host_memory")
    summary_path.write_text(json.dumps(summary))
    record()
    host = json.loads((tmp_path / "out" / "offload.json").read_text())["targets"]["card_24gb_70b_host_gib"]
    assert host["value"] == 96.32 and host["source"].startswith("samples.csv")


def test_the_training_alone_on_a_smaller_host_records_its_host_memory_beside_the_whole_run(whole_run, tmp_path,
                                                                                           monkeypatch):
    state, _, record = whole_run
    record()  # the whole run's part and target, as a full run left them
    (state / "70b_stages.txt").write_text("train_s=300\ntrain_rc=0\n")  # then STAGES=train at HOST_LIMIT_GIB=100
    summary_path = tmp_path / "train" / "summary.json"
    summary = json.loads(summary_path.read_text())
    summary.update(steps=4, tokens_per_second=400.0, host_memory={
        "peak_rss_gib": 93.0, "host_pinned_peak_gib": 3.6, "link_h2d_gib": 700.0, "link_d2h_gib": 400.0})
    summary_path.write_text(json.dumps(summary))
    rc = _main(monkeypatch, "--whole-run", str(state), "--train", str(tmp_path / "train"), "--budget", "22",
               "--steps", "4", "--host-only", "--results-dir", str(tmp_path / "results"))
    out = json.loads((tmp_path / "out" / "offload.json").read_text())
    assert rc == 0 and out["targets"]["card_24gb_70b_host_gib"]["value"] == 96.6
    assert out["targets"]["card_24gb_70b_whole_run_ok"]["value"] is True  # the full run's, kept
    assert set(out["results"]) >= {"70b_recipe_22gib", "70b_recipe_22gib_host"}
    assert out["results"]["70b_recipe_22gib_host"]["pcie4_projection"]["h2d_gib_per_step"] == 175.0
