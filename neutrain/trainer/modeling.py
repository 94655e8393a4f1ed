"""Building the model and tokenizer a recipe's ``model`` section describes.

The model comes from a local Hugging Face directory or a hub id (read from the
local cache only, never downloaded at run time), a GGUF file, or is built from a
config with random weights (``init: random``) for shape-only runs and for the
default recipe, which has no weights at hand. Which of these the section names is
decided once (:func:`recipe_format`, a :class:`~neutrain.nn.formats.ModelFormat`
that answers for its format); the section is resolved once into a
:class:`~neutrain.nn.model_spec.ModelSpec` (:func:`resolve_model`: source, config,
dtypes, attention, placement), and the format builds it, dense, compressed or
compressed with its layers in host memory, through one path.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from neutrain.errors import RecipeError
from neutrain.files import read_json_object
from neutrain.nn.convert import parameter_count
from neutrain.nn.formats import ModelFormat, ModelRef, load_named_tokenizer, resolve_format
from neutrain.nn.model_spec import ModelSpec, Placement
from neutrain.storage.manifest import foreign_files
from neutrain.storage.run_lock import RunDirectoryError
# Where callers have always found them (the planner imports them from model_config, without torch):
from neutrain.memory import config_only, gguf_call, gguf_errors, gguf_source, recipe_config  # noqa: F401

if TYPE_CHECKING:  # annotations only: the classes are not needed at run time
    from neutrain.config.sections import DataSection, ModelSection

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, use_cpu: bool = False) -> torch.dtype:
    """The compute dtype ``model.dtype`` names; ``auto`` is bf16 on a GPU, and on a CPU bf16 only where
    it has native bf16 units (AMX or AVX512-BF16), else fp32: emulated bf16 products are ~6x slower
    than fp32 ones. NeuZip keeps storing bf16 under fp32 compute and upcasts it exactly.

    Example:
        >>> resolve_dtype("float32")
        torch.float32
    """
    if name == "auto":
        if torch.cuda.is_available() and not use_cpu:
            return torch.bfloat16
        from neutrain.compat.cpu_features import native_bf16_feature

        return torch.bfloat16 if native_bf16_feature() else torch.float32
    return _DTYPES[name]


def auto_dtype_line(use_cpu: bool = False) -> str:
    """The one line a run prints for ``model.dtype: auto``: what it computes in, and why.

    Example:
        >>> auto_dtype_line().startswith("model.dtype auto:")
        True
    """
    if torch.cuda.is_available() and not use_cpu:
        return "model.dtype auto: bfloat16 on the GPU"
    from neutrain.compat.cpu_features import native_bf16_feature

    feature = native_bf16_feature()
    if feature:
        return f"model.dtype auto: bfloat16 on this CPU (it has {feature}: native bf16 products)"
    return ("model.dtype auto: float32 on this CPU (no AMX or AVX512-BF16: bf16 products would be emulated); "
            "NeuZip weights stay bf16 and are upcast exactly")


def recipe_format(model_cfg: ModelSection, tokenizer=None, seed: int = 42) -> ModelFormat:
    """The format of the model a recipe's ``model`` section names (:mod:`neutrain.nn.formats`): the one place
    the recipe's keys choose it. ``tokenizer`` sizes the config random weights are built for; ``seed`` is theirs.

    Example:
        >>> from neutrain.config import load_recipe
        >>> recipe_format(load_recipe("default").model).name
        'random weights'
    """
    return resolve_format(ModelRef(model_cfg.base_model, model_cfg.gguf_file, model_cfg.init == "random",
                                   seed, functools.partial(recipe_config, model_cfg, tokenizer)))


def build_tokenizer(model_cfg: ModelSection, data_cfg: DataSection, output_dir: str, cache_dir: str):
    """Load or build the tokenizer, and save it under ``<output_dir>/tokenizer``.

    A tokenizer already saved there is reused, so a resumed run sees exactly the
    vocabulary it started with.
    """
    from transformers import AutoTokenizer

    from neutrain.data import byte_tokenizer, iter_training_texts, train_bpe_tokenizer
    from neutrain.data.chat import set_chat_template

    saved = Path(output_dir) / "tokenizer"
    name = model_cfg.tokenizer or model_cfg.base_model
    spec = _tokenizer_spec(model_cfg, data_cfg, name)
    stale = False
    if name in ("byte", "train-bpe"):
        from neutrain.storage.run_dir import claim  # lazy: `neutrain --help` stays instant

        claim(saved)  # the run's own: one it did not write is neither reused nor replaced
    if name in ("byte", "train-bpe") and (saved / "tokenizer.json").exists():
        stale = _stale_tokenizer(saved, spec, output_dir)
        if not stale:
            return AutoTokenizer.from_pretrained(str(saved))
    if model_cfg.tokenizer is None:  # the model's own (a GGUF file's: the vocabulary and template it carries)
        tok = recipe_format(model_cfg).load_tokenizer(model_cfg.trust_remote_code)
    elif name == "byte":
        tok = byte_tokenizer()
    elif name == "train-bpe":
        tok = train_bpe_tokenizer(iter_training_texts(data_cfg, cache_dir), vocab_size=model_cfg.tokenizer_vocab_size)
    else:
        tok = load_named_tokenizer(name, model_cfg.trust_remote_code)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    set_chat_template(tok, data_cfg.chat_template)  # saved with checkpoints and the export
    if name in ("byte", "train-bpe"):
        tmp = saved.with_name(f"tokenizer.tmp{os.getpid()}")
        tok.save_pretrained(str(tmp))
        (tmp / TOKENIZER_SPEC).write_text(json.dumps(spec, default=str), encoding="utf-8")
        from neutrain.storage.durable import fsync_tree  # lazy: `neutrain --help` stays instant

        fsync_tree(tmp)  # on the disk before the rename: after a power cut it must not read back empty
        if stale:  # built for another recipe, and no checkpoint uses it (else _stale_tokenizer refused)
            shutil.rmtree(saved)
        if not saved.exists():
            os.replace(tmp, saved)
        else:  # another process saved it first
            shutil.rmtree(tmp, ignore_errors=True)
    return tok


TOKENIZER_SPEC = "neutrain_tokenizer.json"  # beside a saved tokenizer: the recipe keys it was built from


def _tokenizer_spec(model_cfg: ModelSection, data_cfg: DataSection, name: str | None) -> dict[str, Any]:
    """The recipe keys a saved byte / train-bpe tokenizer depends on (a trained vocabulary: on its data too)."""
    spec = {"model.tokenizer": name, "data.chat_template": data_cfg.chat_template}
    if name == "train-bpe":
        spec.update({"model.tokenizer_vocab_size": model_cfg.tokenizer_vocab_size, "data.datasets": data_cfg.datasets})
    return json.loads(json.dumps(spec, default=str))  # as read back from the file


def _stale_tokenizer(saved: Path, spec: dict[str, Any], output_dir: str) -> bool:
    """Whether the tokenizer saved in ``saved`` was built for other recipe keys than ``spec`` (then rebuilt).

    Why: it used to be reused whatever the recipe asked, so the export
    carried the old vocabulary while ``recipe.yaml`` said another. A stale tokenizer that
    checkpoints in ``output_dir`` were trained with is refused instead: rebuilding it would
    leave them without theirs. One saved before the spec file existed is reused, as it was.
    """
    from neutrain.storage.run_lock import previous_checkpoints

    path = saved / TOKENIZER_SPEC
    if not os.path.lexists(path):
        return False
    try:
        old = read_json_object(path, f"tokenizer spec '{path}'", RecipeError)
    except RecipeError:  # broken: the tokenizer is taken as built for other keys
        old = {}
    key = next((k for k in spec if not isinstance(old, dict) or old.get(k) != spec[k]), None)
    if key is None:
        return False
    before = old.get(key) if isinstance(old, dict) else None
    found = previous_checkpoints(output_dir)
    if found:
        raise RecipeError(f"{key}: {saved} was built with {key}={before!r} and checkpoints in {output_dir} "
                          f"({found[-1]}) were trained with it; this recipe has {key}={spec[key]!r}. Resume with "
                          f"the run's own {key}, or start a new run in another train.output_dir")
    # The rebuilt tokenizer replaces the whole folder: a file of the user's in it would go with the old one.
    foreign = foreign_files(saved)
    if foreign:
        raise RunDirectoryError(f"{key}: {saved} was built with {key}={before!r} and is rebuilt for this recipe "
                                f"({key}={spec[key]!r}), which would delete '{foreign[0]}' in it, not written by "
                                f"the run: move it out of {saved}")
    logger.warning("%s was built with %s=%r, this recipe has %r: rebuilt", saved, key, before, spec[key])
    return True


def export_dtype(model_cfg: ModelSection, weights: str, use_cpu: bool, requested: str = "auto") -> str:
    """The dtype an export of this run is written in: ``requested``, or for ``auto`` the base model's.

    Why: a CPU run computes in fp32 (``model.dtype: auto``), and its export used to be fp32, twice the
    size of the bf16 checkpoint it started from. ``auto`` now means: the base checkpoint's own dtype
    (its config.json, or a GGUF file's tensor type); for a random init, the dtype NeuZip stores the
    weights in (bf16 under fp32 compute: the export is then bit-identical to the trained weights);
    otherwise the trained weights' dtype.

    Example:
        >>> from neutrain.config.sections import ModelSection
        >>> export_dtype(ModelSection(init="random"), "neuzip-lossless", use_cpu=True)
        'bfloat16'
        >>> export_dtype(ModelSection(init="random", dtype="float32"), "dense", use_cpu=True)
        'auto'
    """
    if requested != "auto":
        return requested
    try:
        stored = recipe_format(model_cfg).stored_dtype()  # None: random weights, stored by no file
    except (OSError, ValueError):  # the export still works: in the trained dtype
        return "auto"
    if stored is not None:
        return {v: k for k, v in _DTYPES.items()}.get(stored, "auto")
    if weights != "dense" and model_cfg.dtype == "auto":  # NeuZip stores bf16 under auto, whatever it computes in
        return "bfloat16"
    return "auto"


def resolve_model(model_cfg: ModelSection, tokenizer, use_cpu: bool = False, seed: int = 42, weights: str = "dense",
                  offload_weights: bool = False, offload_layers: int | None = None,
                  fmt: ModelFormat | None = None, offload_slots: int | None = None) -> ModelSpec:
    """The model a recipe's ``model`` section describes, resolved once: where its tensors come from, its
    transformers config, compute and storage dtypes, the attention backend and the placement.

    With ``dtype: auto`` on a CPU without native bf16, NeuZip weights are stored bf16 (what NeuZip
    compresses well) and computed in fp32 (bf16 matrix products are emulated and several times slower
    there). ``offload_weights`` (``memory.offload_weights``) keeps the compressed decoder layers in host
    memory, each moved there as soon as it is built; ``offload_layers`` (``memory.offload_layers``) of them
    only, spread evenly, when set, through ``offload_slots`` (``memory.offload_slots``) device slots when set.
    ``fmt``: the section's format as :func:`recipe_format` chose it, else chosen here.

    Example:
        >>> from neutrain.config import load_recipe
        >>> from neutrain.data import byte_tokenizer
        >>> spec = resolve_model(load_recipe("default").model, byte_tokenizer(), use_cpu=True, weights="neuzip-lossless")
        >>> type(spec.source).__name__, spec.placement.weights, spec.attention
        ('RandomInit', 'neuzip-lossless', 'sdpa')
    """
    dtype = resolve_dtype(model_cfg.dtype, use_cpu)
    if model_cfg.dtype == "auto":
        logger.info(auto_dtype_line(use_cpu))
    trust = model_cfg.trust_remote_code
    fmt = fmt or recipe_format(model_cfg, tokenizer, seed)
    try:
        config = fmt.read_config(trust)
    except OSError as exc:
        raise RecipeError(f"model.base_model: cannot load the config of '{model_cfg.base_model}' from a local "
                          f"path or the hub cache ({str(exc).splitlines()[0]})") from None
    # A compressed model is built on the training device; a dense one on the host, as transformers builds
    # it, for the Trainer (or a distributed mode's sharding) to place.
    cuda = torch.cuda.is_available() and not use_cpu and weights != "dense"
    storage = torch.bfloat16 if weights != "dense" and model_cfg.dtype == "auto" and dtype == torch.float32 else None
    offload = offload_weights and weights != "dense"
    placement = Placement(weights, offload=offload, layers=offload_layers if offload else None,
                          slots=offload_slots if offload else None, device="cuda" if cuda else "cpu")
    return ModelSpec(fmt.source(), config, dtype, storage, _attention(model_cfg.attn_implementation, config, use_cpu),
                     placement, trust_remote_code=trust)


def _attention(requested: str, config, use_cpu: bool) -> str:
    """The attention backend for ``model.attn_implementation``: what the architecture supports, on this device."""
    from neutrain.nn.architecture import auto_attention, check_attention

    attn = requested
    if attn == "auto":  # what the architecture supports; SageAttention where measured faster, per call
        attn = auto_attention(config, cuda=torch.cuda.is_available() and not use_cpu)
    if attn == "neutrain_sage" and auto_attention(config, cuda=True) != "neutrain_sage":
        attn = auto_attention(config, cuda=False)  # sdpa, or eager where the architecture has none
        logger.warning("model.attn_implementation: this architecture takes no registered attention function; "
                       "using %s", attn)
    if attn == "neutrain_sage" and (use_cpu or not torch.cuda.is_available()):
        # The INT8/FP8 kernels need a CUDA GPU; on CPU the quantized torch reference would only
        # be slower than SDPA, so a recipe that asks for SageAttention trains with SDPA there.
        attn = auto_attention(config, cuda=False)  # sdpa, or eager where the architecture has none
        logger.warning("model.attn_implementation: neutrain_sage needs a CUDA GPU; using %s on CPU", attn)
    check_attention(config, attn)
    if attn == "neutrain_sage":
        from neutrain.attention import register

        attn = register()
    elif attn == "neutrain_sdpa":
        from neutrain.attention.packed import register as register_packed

        attn = register_packed()
    return attn


def build_model(model_cfg: ModelSection, tokenizer, use_cpu: bool = False, seed: int = 42, weights: str = "dense",
                offload_weights: bool = False, offload_layers: int | None = None, offload_slots: int | None = None):
    """Build the causal LM described by ``model_cfg``, dense or NeuZip-compressed (``weights``), tensor by
    tensor (:func:`resolve_model`, then :func:`neutrain.nn.load.build`).

    Example:
        >>> from neutrain.config import load_recipe
        >>> from neutrain.data import byte_tokenizer
        >>> model = build_model(load_recipe("default").model, byte_tokenizer(), use_cpu=True)
        >>> type(model).__name__
        'LlamaForCausalLM'
    """
    base = model_cfg.base_model
    if base and Path(base).is_dir():
        from neutrain.storage.manifest import verify_if_neutrain  # lazy: `neutrain --help` stays instant

        verify_if_neutrain(base)  # a neutrain checkpoint or export as the base: its checksums, before a tensor is read
    fmt = recipe_format(model_cfg, tokenizer, seed)
    spec = resolve_model(model_cfg, tokenizer, use_cpu, seed, weights, offload_weights, offload_layers, fmt,
                         offload_slots)
    try:
        model, report = fmt.build(spec)
    except OSError as exc:
        raise RecipeError(f"model.base_model: cannot load '{model_cfg.base_model}' from a local path or the hub "
                          f"cache ({str(exc).splitlines()[0]})") from None
    if spec.placement.compressed:
        logger.info("compressed model: %s", report)
    n = parameter_count(model)
    logger.info("model: %s, %s parameters, %s, attention %s", type(model).__name__,
                f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M", spec.dtype, spec.attention)
    return model
