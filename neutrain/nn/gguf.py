"""GGUF checkpoints (llama.cpp's format): loaded dequantized, then compressed, with their tokenizer.

The file is a tensor source (:class:`GGUFFile`) of the one build path (:func:`neutrain.nn.load.build`):
llama.cpp's tensor names are mapped to transformers', llama.cpp's Q/K row permutation is undone and
Q8_0/Q4_K/... blocks are dequantized as transformers' own GGUF loader does, one tensor at a time, each
placed (and, for a compressed model, compressed) before the next is read: neither the dequantized file
nor the dense model is ever held whole. A dense model trains and exports with ``save_pretrained`` as
ordinary safetensors. The file's vocabulary, special tokens and chat template become the tokenizer
(:func:`load_gguf_tokenizer`).

Example:
    >>> model = load_gguf_model("models", "smollm2-135m-instruct-q8_0.gguf", torch.bfloat16)  # doctest: +SKIP
    >>> tokenizer = load_gguf_tokenizer("models", "smollm2-135m-instruct-q8_0.gguf")  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch

from neutrain.errors import CheckpointError
from neutrain.nn.load import build
from neutrain.nn.model_spec import ModelSpec, Placement


class GGUFLoadError(ValueError):
    """A GGUF file that cannot be loaded (missing ``gguf`` package, unsupported architecture, bad file)."""


def split_source(base_model: str | None, gguf_file: str) -> tuple[str, str]:
    """``(directory or hub id, file name)`` as ``from_pretrained(..., gguf_file=...)`` takes them.

    A ``gguf_file`` that is a path (no ``base_model``) is split into its directory and name; with a
    ``base_model`` the file is looked up inside it (a local directory or a hub id in the local cache).

    Example:
        >>> split_source(None, "models/tiny.gguf")
        ('models', 'tiny.gguf')
        >>> split_source("org/repo-GGUF", "tiny-Q8_0.gguf")
        ('org/repo-GGUF', 'tiny-Q8_0.gguf')
    """
    if base_model:
        return base_model, gguf_file
    path = Path(gguf_file)
    return str(path.parent), path.name


@contextlib.contextmanager
def _named_errors(what: str, source: str, name: str):
    """transformers' and gguf's loading errors as one :class:`GGUFLoadError` line naming the file."""
    try:
        yield
    except (GGUFLoadError, CheckpointError):
        raise  # named already (by the source, inside the build, the header check or the build's checks of its values)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise GGUFLoadError(f"cannot {what} '{os.path.join(source, name)}' ({first})") from None


def gguf_index(source: str, name: str):
    """The parsed header of GGUF file ``name`` in ``source``, shared by every reader of it in this process
    (:func:`neutrain.storage.gguf_header.read_gguf`): a header that lies is refused before it is trusted."""
    from neutrain.errors import CheckpointError
    from neutrain.storage.gguf_header import read_gguf

    try:
        return read_gguf(resolve_gguf_path(source, name))
    except CheckpointError as exc:
        raise GGUFLoadError(str(exc)) from None


def _require_gguf_package() -> None:
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise GGUFLoadError("reading GGUF files needs the 'gguf' package: pip install gguf") from None


def resolve_gguf_path(source: str, name: str) -> str:
    """The local path of GGUF file ``name`` in directory ``source`` (or in the hub cache of repo ``source``)."""
    local = Path(source) / name
    if local.is_file():
        return str(local)
    from huggingface_hub import hf_hub_download

    return hf_hub_download(source, name)  # the local cache only under HF_HUB_OFFLINE


class GGUFFile:
    """A GGUF file as a tensor source (see :mod:`neutrain.nn.sources` for the interface).

    Each tensor is read from the memory-mapped file, dequantized and handed over before the next is
    read (:func:`neutrain.compat.gguf_tensors.gguf_tensors`), named and laid out as transformers
    loads the file (Q/K rows un-permuted, MoE experts merged): the weights are bit-identical to
    transformers' whole-file load, and peak host memory is the model being built plus one dequantized
    tensor.

    Args:
        source: the directory (or hub id in the local cache) holding the file.
        name: the file's name in it.
    """

    def __init__(self, source: str, name: str):
        self.source, self.name = source, name

    @property
    def label(self) -> str:
        return f"GGUF file '{os.path.join(self.source, self.name)}'"

    def read_config(self, trust_remote_code: bool = False):
        """The transformers config the file describes."""
        return gguf_config(self.source, self.name, trust_remote_code)

    def keys(self) -> list[str] | None:
        return None  # named as the model's parameters already

    def tensor_count(self) -> int:
        """How many tensors the file holds (what a progress line counts to)."""
        with _named_errors("read", self.source, self.name):
            return len(gguf_index(self.source, self.name).tensors)

    def tensors(self, model, device, dtype: torch.dtype):
        from neutrain.compat.gguf_tensors import gguf_tensors

        _require_gguf_package()
        with _named_errors("load", self.source, self.name):
            yield from gguf_tensors(gguf_index(self.source, self.name), model, dtype)

    def generation_config(self):
        return None


def load_gguf_model(source: str, name: str, dtype: torch.dtype, attn_implementation: str | None = None,
                    trust_remote_code: bool = False):
    """The dense causal LM a GGUF file holds, dequantized to ``dtype`` on the CPU (eval mode).

    Built tensor by tensor from the file (:class:`GGUFFile`), so the dequantized file is never held
    beside the model; the weights are those of transformers' ``from_pretrained(..., gguf_file=...)``.

    Raises:
        GGUFLoadError: the ``gguf`` package is missing, or the file cannot be read.
    """
    model, _ = load_gguf_compressed(source, name, "dense", dtype, attn_implementation=attn_implementation,
                                    trust_remote_code=trust_remote_code)
    return model.eval()


def load_gguf_compressed(source: str, name: str, weights: str, dtype: torch.dtype, *,
                         storage_dtype: torch.dtype | None = None, attn_implementation: str | None = None,
                         device: str | torch.device = "cpu", trust_remote_code: bool = False, progress: bool = True):
    """The causal LM a GGUF file holds, built on ``device`` tensor by tensor in the form ``weights`` says.

    Each tensor is read from the memory-mapped file, dequantized, and compressed before the next is
    read (:class:`GGUFFile` into :func:`neutrain.nn.load.build`), so peak host memory is the
    compressed model plus one dequantized tensor, not the dense model. ``storage_dtype`` as for
    :func:`neutrain.nn.formats.load_compressed` (bf16 storage under fp32 compute on CPU).

    Returns:
        ``(model, report)`` as :func:`neutrain.nn.formats.load_compressed`.

    Example:
        >>> model, report = load_gguf_compressed("models", "smollm2-135m-instruct-q8_0.gguf",
        ...                                      "neuzip-lossless", torch.bfloat16)  # doctest: +SKIP
    """
    file = GGUFFile(source, name)
    spec = ModelSpec(file, file.read_config(trust_remote_code), dtype, storage_dtype, attn_implementation,
                     Placement(weights, device=device), trust_remote_code)
    return build_gguf(spec, progress=progress)


def build_gguf(spec: ModelSpec, progress: bool = True):
    """:func:`neutrain.nn.load.build` of a spec whose source is a :class:`GGUFFile`, any error while
    building (an architecture transformers cannot build, a bad tensor) one :class:`GGUFLoadError` naming the file."""
    with _named_errors("load", spec.source.source, spec.source.name):
        return build(spec, progress=progress)


def load_gguf_tokenizer(source: str, name: str):
    """The tokenizer a GGUF file carries (vocabulary, merges, special tokens, chat template).

    The special tokens are set from the file's own ids (see :func:`neutrain.compat.gguf_special_tokens`).
    """
    from transformers import AutoTokenizer

    from neutrain.compat import gguf_special_tokens
    from neutrain.compat.gguf_reader import reading_from

    _require_gguf_package()
    with _named_errors("load the tokenizer of", source, name):
        index = gguf_index(source, name)
        with reading_from(index):  # transformers' readers answer from the header parsed once
            tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=name)
        ids = gguf_special_tokens(index.metadata)
    vocab = len(tokenizer)
    tokenizer.add_special_tokens({k: tokenizer.convert_ids_to_tokens(v) for k, v in ids.items() if 0 <= v < vocab})
    return tokenizer


def gguf_config(source: str, name: str, trust_remote_code: bool = False):
    """The transformers config a GGUF file describes (no weights read)."""
    from transformers import AutoConfig

    from neutrain.compat.gguf_reader import reading_from

    _require_gguf_package()
    with _named_errors("read the config of", source, name):
        with reading_from(gguf_index(source, name)):  # transformers' readers answer from the header parsed once
            return AutoConfig.from_pretrained(source, gguf_file=name, trust_remote_code=trust_remote_code)


def gguf_dtype(path: str) -> torch.dtype:
    """The dtype a GGUF file's matrices are stored in: F32, F16, BF16, or bf16 for quantized blocks.

    Why: the export of a fine-tuned GGUF keeps its base's dtype (a quantized file has none of its
    own; bf16 is what it dequantizes into without loss of its ~8-bit precision).

    Example:
        >>> gguf_dtype("models/tiny-f16.gguf")  # doctest: +SKIP
        torch.float16
    """
    from gguf import GGMLQuantizationType

    from neutrain.storage.gguf_header import read_gguf

    plain = {GGMLQuantizationType.F32: torch.float32, GGMLQuantizationType.F16: torch.float16,
             GGMLQuantizationType.BF16: torch.bfloat16}
    types = {t.ggml_type for t in read_gguf(path).tensors if len(t.dims) >= 2}
    dtypes = {plain.get(t, torch.bfloat16) for t in types}
    return dtypes.pop() if len(dtypes) == 1 else torch.bfloat16
