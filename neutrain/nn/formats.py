"""Where a model comes from, decided once: one :class:`ModelFormat` per format, answering everything about it.

A recipe's ``model`` section or a command's folder names a model (:class:`ModelRef`); :func:`resolve_format`
asks each registered format whether the reference names it (:meth:`ModelFormat.matches`) and returns the
first that does, bound to the reference. Everything downstream asks that object, never which format it is:
its transformers config, its tokenizer, the dtype its weights are stored in, the tensor source the build
(:func:`neutrain.nn.load.build`) reads, whether its files hold NeuZip blobs already, whether a run resumes
from it, and the model a reader of the folder gets.

Why: the choice used to be made again by each consumer (the trainer's model build, the export's loader, the
generate placement), each with its own ``if`` chain over random / GGUF / safetensors / checkpoint and its own
way to find the dtype. As vLLM's loader registry does, one object per format holds the answers, and random
weights are a format like the others.

Formats, first consulted first: random weights (``model.init: random``), a GGUF file (``model.gguf_file``), a
compressed run's ``checkpoint-N`` (its marker file), a NeuZip export (its config's ``quantization_config``)
and, for anything else, a Hugging Face safetensors folder or hub id. A new format is a :class:`ModelFormat`
subclass and one :func:`register_format` call; it is consulted before the ones registered earlier.

Example:
    >>> from neutrain.nn.sources import RandomInit
    >>> fmt = resolve_format(ModelRef(random=True, seed=3))
    >>> fmt.name, fmt.source(), fmt.stored_dtype(), fmt.encoded
    ('random weights', RandomInit(seed=3), None, False)
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Callable, ClassVar

import torch

from neutrain.errors import CheckpointError, RecipeError, one_line
from neutrain.files import MAX_FOLDER_TEXT_BYTES, read_json_object
from neutrain.nn.checkpoint import MARKER
from neutrain.nn.load import build
from neutrain.nn.model_spec import ModelSpec, Placement
from neutrain.nn.sources import (NEUZIP_QUANT_METHOD, NeutrainCheckpoint, NeuZipExport, RandomInit,
                                 SafetensorsFolder, TensorSource)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclasses.dataclass(frozen=True)
class ModelRef:
    """A model as a recipe or a command names it, before anything is read.

    Args:
        path: a local folder or a hub id in the local cache (``model.base_model``); with ``gguf_file``, the
            folder or hub repo holding the file.
        gguf_file: a GGUF file (``model.gguf_file``), a path or a name inside ``path``.
        random: random weights (``model.init: random``) of the config ``recipe_config`` makes.
        seed: the random weights' seed (the same weights on every process, resume and placement).
        recipe_config: makes the transformers config random weights are built for (the recipe's).
    """

    path: str | None = None
    gguf_file: str | None = None
    random: bool = False
    seed: int = 0
    recipe_config: Callable[[], Any] | None = None


class ModelFormat:
    """One format of model, bound to the :class:`ModelRef` that names it; subclasses answer for theirs.

    Class attributes: ``name`` (in words, for lines and errors), ``encoded`` (its files hold NeuZip blobs:
    their bytes are the compressed form), ``resumable`` (a compressed run's checkpoint: a run resumes from
    its blobs as they are) and ``exportable`` (a saved model a reader loads, :meth:`load_model`).
    """

    name: ClassVar[str] = "model"
    encoded: ClassVar[bool] = False
    resumable: ClassVar[bool] = False
    exportable: ClassVar[bool] = False

    def __init__(self, ref: ModelRef):
        self.ref = ref
        self._config = None

    @classmethod
    def matches(cls, ref: ModelRef) -> bool:
        """Whether ``ref`` names a model of this format (reads at most a marker or a config file)."""
        raise NotImplementedError

    @property
    def label(self) -> str:
        """The model in one line's words."""
        return f"{self.name} '{self.ref.path}'"

    def source(self) -> TensorSource:
        """The tensor source :func:`neutrain.nn.load.build` reads the weights from."""
        raise NotImplementedError

    def _read_config(self, trust_remote_code: bool):
        return self.source().read_config(trust_remote_code)

    def read_config(self, trust_remote_code: bool = False):
        """The transformers config of the model, read once."""
        if self._config is None:
            self._config = self._read_config(trust_remote_code)
        return self._config

    def load_tokenizer(self, trust_remote_code: bool = False):
        """The tokenizer the model comes with (a recipe with no ``model.tokenizer`` trains with it)."""
        return load_named_tokenizer(str(self.ref.path), trust_remote_code)

    def stored_dtype(self) -> torch.dtype | None:
        """The dtype the weights are stored in: the one the config names, else the first floating tensor's;
        None where no file holds them (random weights)."""
        dtype = config_dtype(self.read_config())
        return dtype or self.source().stored_dtype()

    def build(self, spec, progress: bool = True):
        """:func:`neutrain.nn.load.build` of ``spec`` (its source is :meth:`source`)."""
        return build(spec, progress=progress)

    def load_model(self, dtype: torch.dtype | None = None):
        """The model as a reader of the saved folder gets it, on the CPU in eval mode: in ``dtype``, or None
        for :meth:`stored_dtype`."""
        raise CheckpointError(f"{self.label}: not a saved model to load")


_FORMATS: list[type[ModelFormat]] = []


def register_format(fmt: type[ModelFormat]) -> type[ModelFormat]:
    """Consult ``fmt`` before every format registered so far (the catch-all folder format stays last)."""
    if fmt not in _FORMATS:
        _FORMATS.insert(0, fmt)
    return fmt


def unregister_format(fmt: type[ModelFormat]) -> None:
    """Stop consulting ``fmt``."""
    _FORMATS.remove(fmt)


def resolve_format(ref: ModelRef) -> ModelFormat:
    """The format ``ref`` names, bound to it: the first registered format that :meth:`~ModelFormat.matches`."""
    for fmt in _FORMATS:
        if fmt.matches(ref):
            return fmt(ref)
    raise RecipeError("model.base_model: names no model (a folder, a hub id, a GGUF file or init: random)")


def folder_format(path: str | os.PathLike) -> ModelFormat:
    """The format of the saved model ``path`` (a folder or a hub id), by its files."""
    return resolve_format(ModelRef(path=str(path)))


def config_dtype(config) -> torch.dtype | None:
    """The dtype ``config`` names (``dtype``, or the older ``torch_dtype``), when float32, bfloat16 or float16."""
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    dtype = _DTYPES.get(dtype) if isinstance(dtype, str) else dtype
    return dtype if dtype in _DTYPES.values() else None


def load_named_tokenizer(name: str, trust_remote_code: bool = False):
    """The tokenizer of a local folder or a hub id in the local cache, or one line naming ``model.tokenizer``."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)
    except Exception as exc:
        # The library's own error names neither the file nor where in it ("(JSONDecodeError)", "(KeyError)"): a
        # folder's JSON files are read again through the guarded reader, which names the file, line and column,
        # and otherwise the library's message is kept, on one line. Only on failure: a good tokenizer is parsed once.
        _check_tokenizer_files(name)
        shown = one_line(exc)
        shown = shown if len(shown) <= 200 else shown[:197] + "..."
        raise RecipeError(f"model.tokenizer: cannot load tokenizer '{name}' from a local path or the hub cache "
                          f"({type(exc).__name__}: {shown})") from None


_TOKENIZER_JSON = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json")
"""The JSON files a tokenizer folder's loader reads; each must hold an object."""


def _check_tokenizer_files(name: str) -> None:
    folder = Path(name).expanduser()
    if not folder.is_dir():
        return
    for file in _TOKENIZER_JSON:
        path = folder / file
        if path.is_file():
            read_json_object(path, f"model.tokenizer: file '{path}'", RecipeError, limit=MAX_FOLDER_TEXT_BYTES)


def load_compressed(
    path_or_id: str | os.PathLike,
    weights: str = "neuzip-lossless",
    device: str | torch.device = "cuda",
    *,
    dtype: torch.dtype = torch.bfloat16,
    progress: bool = True,
    codec_options: dict | None = None,
    config_overrides: dict | None = None,
    storage_dtype: torch.dtype | None = None,
):
    """Load a Hugging Face causal LM checkpoint into compressed modules on ``device``.

    Args:
        path_or_id: a local directory with ``config.json`` and ``*.safetensors`` (one or many shards), or
            a hub id already in the local cache (no download is attempted when offline).
        weights: ``"neuzip-lossless"`` or ``"dense"``.
        device: where the model lives.
        dtype: dtype of floating weights (bf16 for training).
        progress: show a tqdm bar.
        codec_options: extra arguments for ``neutrain.compress.compress``.
        config_overrides: attributes set on the config before building (e.g. ``attn_implementation``).
        storage_dtype: dtype of the compressed weights when it differs from ``dtype``, which
            then is the compute dtype (bf16 storage with fp32 compute is the CPU setting).

    Returns:
        ``(model, report)``: the model (train mode) and a :class:`CompressionReport`
        (``bytes_before`` is the dense size the checkpoint would take).

    Example:
        >>> model, report = load_compressed("path/to/llama", device="cuda")  # doctest: +SKIP
    """
    source = folder_format(path_or_id).source()  # a Hugging Face folder, a NeuZip export or a checkpoint: its own
    config = source.read_config()
    for key, value in (config_overrides or {}).items():
        setattr(config, key, value)
    spec = ModelSpec(source, config, dtype, storage_dtype, placement=Placement(weights, device=device),
                     codec_options=codec_options)
    return build(spec, progress=progress)


class SafetensorsWeights(ModelFormat):
    """A Hugging Face folder of safetensors shards, or a hub id in the local cache: any other named path."""

    name = "model"
    exportable = True
    source_class: ClassVar[type[SafetensorsFolder]] = SafetensorsFolder

    @classmethod
    def matches(cls, ref: ModelRef) -> bool:
        return ref.path is not None and not ref.random and not ref.gguf_file

    def source(self) -> SafetensorsFolder:
        if not hasattr(self, "_source"):
            self._source = self.source_class(self.ref.path)
        return self._source

    def load_model(self, dtype: torch.dtype | None = None):
        config = self.read_config()
        model, _ = self.build(ModelSpec(self.source(), config, dtype or self.stored_dtype() or torch.float32),
                              progress=False)
        return model.eval()


class NeuZipExportWeights(SafetensorsWeights):
    """A NeuZip export (``neutrain export --format neuzip``): told by its config's ``quantization_config``."""

    name = "NeuZip export"
    encoded = True
    source_class = NeuZipExport

    @classmethod
    def matches(cls, ref: ModelRef) -> bool:
        if not SafetensorsWeights.matches(ref):
            return False
        path = Path(ref.path) / "config.json"
        # Missing: a hub id, or a folder whose config's lack read_config names. Present, it is read here, so a
        # FIFO or a broken file is one line naming it. NaN parses: values are checked where the model is built.
        config = read_json_object(path, f"checkpoint file '{path}'", CheckpointError, allow_nan=True) \
            if os.path.lexists(path) else {}
        quant = config.get("quantization_config")
        return isinstance(quant, dict) and quant.get("quant_method") == NEUZIP_QUANT_METHOD

    def load_model(self, dtype: torch.dtype | None = None):
        from transformers import AutoModelForCausalLM

        # As any user of the export loads it: transformers and neutrain's quantizer. device_map: on the CPU, as
        # load_model promises; the quantizer's own default is the current GPU.
        return AutoModelForCausalLM.from_pretrained(str(self.ref.path), dtype=dtype or "auto", device_map="cpu").eval()


class CheckpointWeights(SafetensorsWeights):
    """A compressed run's ``checkpoint-N``: told by its marker file, rebuilt from its blobs as they are."""

    name = "checkpoint"
    encoded = True
    resumable = True
    source_class = NeutrainCheckpoint

    @classmethod
    def matches(cls, ref: ModelRef) -> bool:
        return SafetensorsWeights.matches(ref) and (Path(ref.path) / MARKER).exists()

    def load_model(self, dtype: torch.dtype | None = None):
        """The compressed model in the weights mode it trained with, its blobs never encoded again (``dtype``
        does not apply: the blobs hold the dtype they were trained in)."""
        config = self.read_config()
        spec = ModelSpec(self.source(), config, config_dtype(config) or torch.bfloat16,
                         placement=Placement(self.source().weights))
        model, _ = self.build(spec, progress=False)
        return model.eval()


class GGUFWeights(ModelFormat):
    """A GGUF file (``model.gguf_file``), dequantized as it is read; it carries its tokenizer."""

    name = "GGUF file"

    @classmethod
    def matches(cls, ref: ModelRef) -> bool:
        return bool(ref.gguf_file) and not ref.random

    @property
    def label(self) -> str:
        return self.source().label

    def source(self):
        from neutrain.nn import gguf

        return gguf.GGUFFile(*gguf.split_source(self.ref.path, self.ref.gguf_file))

    def _read_config(self, trust_remote_code: bool):
        return self._recipe_errors(self.source().read_config, trust_remote_code)

    def load_tokenizer(self, trust_remote_code: bool = False):
        from neutrain.nn import gguf

        return self._recipe_errors(gguf.load_gguf_tokenizer, *gguf.split_source(self.ref.path, self.ref.gguf_file))

    def stored_dtype(self) -> torch.dtype | None:
        from neutrain.nn import gguf

        file = self.source()
        return gguf.gguf_dtype(gguf.resolve_gguf_path(file.source, file.name))

    def build(self, spec, progress: bool = True):
        from neutrain.nn import gguf

        return self._recipe_errors(gguf.build_gguf, spec, progress)

    @staticmethod
    def _recipe_errors(function, *args):
        """``function(*args)``, a file it cannot read one :class:`RecipeError` naming ``model.gguf_file``."""
        from neutrain.nn.gguf import GGUFLoadError

        try:
            return function(*args)
        except GGUFLoadError as exc:
            raise RecipeError(f"model.gguf_file: {exc}") from None


class RandomWeights(ModelFormat):
    """Random weights (``model.init: random``) of the recipe's config: shape-only runs and the default recipe.

    Its tokenizer is the named model's (``model.base_model`` or ``model.gguf_file``), where the recipe names one.
    """

    name = "random weights"

    @classmethod
    def matches(cls, ref: ModelRef) -> bool:
        return ref.random

    @property
    def label(self) -> str:
        return self.name

    def source(self) -> RandomInit:
        return RandomInit(self.ref.seed)

    def _read_config(self, trust_remote_code: bool):
        if self.ref.recipe_config is None:
            raise RecipeError("model.config: random weights need a config (model.config or model.base_model)")
        return self.ref.recipe_config()

    def load_tokenizer(self, trust_remote_code: bool = False):
        named = dataclasses.replace(self.ref, random=False)
        if named.path is None and not named.gguf_file:
            raise RecipeError("model.tokenizer: random weights name no model to take a tokenizer from; set "
                              "model.tokenizer (byte, train-bpe, or a tokenizer's folder or hub id)")
        return resolve_format(named).load_tokenizer(trust_remote_code)

    def stored_dtype(self) -> torch.dtype | None:
        return None


for _fmt in (SafetensorsWeights, NeuZipExportWeights, CheckpointWeights, GGUFWeights, RandomWeights):
    register_format(_fmt)
