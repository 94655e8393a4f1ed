"""The sections of what runs after training: evaluation, export and draft distillation (as
:mod:`neutrain.config.sections` declares the others)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, field_validator

from neutrain.config.numbers import SHARD_SIZE, FlagError
from neutrain.errors import RecipeError
from neutrain.config.fields import COUNT_CEILING, ROWS_MAX, Count, Number, Section, Switch, Text


class EvalSection(Section):
    """The recipe's ``eval`` section."""

    section: ClassVar[str] = "eval"

    perplexity: Switch = True
    """Report held-out loss and perplexity after training."""

    micro_batch_size: Count | None = Field(None, ge=1, le=ROWS_MAX)
    """Rows per device when evaluating (default: train.micro_batch_size)."""

    max_eval_samples: Count | None = Field(None, ge=1, le=COUNT_CEILING)
    """Evaluate on at most this many held-out rows."""

    long_context_tasks: list[Text] = Field(default_factory=list)
    """RULER-style tasks to run after training (names from neutrain.eval.tasks.TASKS, checked before training)."""

    context_len: Count = Field(512, ge=16, le=1 << 20)
    """Token length of generated long-context prompts."""

    num_samples: Count = Field(4, ge=1, le=1 << 16)
    """Samples per long-context task."""

    kv_caches: list[Text] = Field(default_factory=lambda: ["full"])
    """KV caches to evaluate with: full, minicache, shadowkv."""

    sample_prompt: Text | None = None
    """After training, generate from this prompt and print the sample at the end (none: no sample)."""

    sample_tokens: Count = Field(64, ge=1, le=1 << 20)
    """New tokens in the printed sample."""

    sample_temperature: Number = Field(0.8, ge=0.0, le=100.0)
    """Sampling temperature of the printed sample (0: greedy)."""

class ExportSection(Section):
    """The recipe's ``export`` section."""

    section: ClassVar[str] = "export"

    format: Literal["hf", "neuzip", "neuzip-lossy-0", "neuzip-lossy-1", "neuzip-lossy-3", "none"] = "hf"
    """Export after training: hf (dense safetensors), neuzip, neuzip-lossy-k, or none."""

    output_dir: Text | None = None
    """Export directory (default: <train.output_dir>/export)."""

    max_shard_size: Text = Field("5GB", pattern=r"^\s*([0-9]+(\.[0-9]*)?|\.[0-9]+)\s*[KkMmGgTt][Bb]\s*$")
    """Largest safetensors shard: a number and KB, MB, GB or TB, e.g. '500MB' or '5GB' (1KB to 1000TB)."""

    @field_validator("max_shard_size", mode="after")
    @classmethod
    def _shard_size(cls, text: str) -> str:
        """In range, as ``neutrain export --max-shard-size`` (:data:`neutrain.config.numbers.SHARD_SIZE`)."""
        try:
            return SHARD_SIZE.parse("export.max_shard_size", text)
        except FlagError as exc:
            raise RecipeError(str(exc)) from None

    dtype: Literal["auto", "bfloat16", "float32", "float16"] = "auto"
    """Dtype of exported dense weights. auto: the base checkpoint's dtype (config.json, or a GGUF file's tensor
    type), so a CPU run (fp32 compute) of a bf16 model exports bf16; with random init, the stored weights' dtype
    (bf16 for NeuZip under dtype auto, which keeps them bit-exact). float32 keeps fp32-trained weights
    unrounded."""

def export_dtype_refusal(fmt: str, dtype: str, format_name: str = "export.format",
                         dtype_name: str = "export.dtype") -> str | None:
    """The one-line refusal of an export ``dtype`` that format ``fmt`` would not write, else None.

    Why: a NeuZip export keeps the weights' own dtype (it compresses what the model holds), so ``export.format:
    neuzip`` with ``export.dtype: float16`` (or ``neutrain export --format neuzip --dtype float16``) wrote
    float32 weights after the whole run, and the command line printed "dtype float16". The recipe's keys and
    the command's flags are held to this one rule (``format_name``, ``dtype_name``: what the user typed).

    Example:
        >>> export_dtype_refusal("hf", "float16") is None, export_dtype_refusal("neuzip", "auto") is None
        (True, True)
        >>> print(export_dtype_refusal("neuzip-lossy-1", "float16", "--format", "--dtype"))
        --dtype: float16 would be ignored by --format neuzip-lossy-1 (a NeuZip export keeps the weights' own dtype); use --format hf to write float16 weights, or --dtype auto
    """
    if dtype == "auto" or not fmt.startswith("neuzip"):
        return None
    return (f"{dtype_name}: {dtype} would be ignored by {format_name} {fmt} (a NeuZip export keeps the weights' own "
            f"dtype); use {format_name} hf to write {dtype} weights, or {dtype_name} auto")


class DistillSection(Section):
    """The recipe's ``distill`` section."""

    section: ClassVar[str] = "distill"

    enabled: Switch = False
    """After training, distil a small draft from the trained model and decode speculatively with it."""

    target: Text | None = None
    """For `neutrain distill`: the target model directory (default: <train.output_dir>/export)."""

    draft_config: dict | None = None
    """Draft model config overrides (default: the target's config with a quarter of its layers); checked with
    model.config before training when the recipe has one."""

    divergence: Literal["fkl", "rkl", "tvd", "jsd"] = "fkl"
    """Distillation loss: fkl, rkl, tvd or jsd."""

    max_steps: Count = Field(20, ge=1, le=COUNT_CEILING)
    """Draft training steps."""

    learning_rate: Number = Field(0.002, gt=0.0, le=10.0)
    """Draft learning rate (AdamW)."""

    on_policy_every: Count = Field(4, ge=0, le=COUNT_CEILING)
    """Every n-th step trains on a tail sampled from the draft itself (0: never)."""

    num_drafts: Count = Field(2, ge=1, le=16)
    """Drafts verified per target call (K)."""

    draft_len: Count = Field(4, ge=1, le=64)
    """Tokens per draft (gamma)."""

    scheme: Literal["sd", "specinfer", "spectr", "importance"] = "importance"
    """Verification: sd (K=1), specinfer, spectr or importance."""

    temperature: Number = Field(1.0, ge=0.0, le=100.0)
    """Sampling temperature of the speculative decode (0: greedy)."""

    max_new_tokens: Count = Field(32, ge=1, le=1 << 20)
    """Tokens generated in the speculative decoding demo."""