"""Build a causal LM straight into compressed form, one tensor at a time.

``load_compressed`` reads a Hugging Face checkpoint (safetensors); ``init_compressed``
draws a random initialisation (shape-only runs and benchmarks). Checkpoint keys are
renamed and merged as transformers' own loader does (:mod:`neutrain.nn.checkpoint_keys`:
per-expert MoE checkpoints become the model's fused 3-D expert stacks, which are
compressed whole, :mod:`neutrain.nn.experts`). Both build the
model skeleton with parameters on the meta device (buffers such as rotary
frequencies are real), then materialise each tensor on the target device: a
target weight is encoded immediately and its dense tensor dropped, so peak
memory is the compressed model plus one dense tensor, never the dense model.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator

import torch

from neutrain.errors import CheckpointError
from neutrain.nn.convert import (
    WEIGHT_MODES,
    CompressionReport,
    _progress,
    build_module,
    default_targets,
    mark_large_weights,
    model_nbytes,
)
from neutrain.nn.experts import compress_expert_stack, expert_stacks
from neutrain.nn.weight import CompressedWeight


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
        path_or_id: a local directory with ``config.json`` and ``*.safetensors``, or
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
    from safetensors import safe_open

    directory = _resolve(path_or_id)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(directory)
    for key, value in (config_overrides or {}).items():
        setattr(config, key, value)
    files = _safetensors_files(directory)
    keys: list[str] = []
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            keys.extend(handle.keys())

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for file in files:
            with safe_open(str(file), framework="pt", device=str(torch.device(device))) as handle:
                for name in handle.keys():
                    yield name, handle.get_tensor(name)

    return _build(config, weights, device, dtype, tensors(), progress, codec_options, storage_dtype=storage_dtype,
                  source_keys=keys)


def init_compressed(
    config,
    weights: str = "neuzip-lossless",
    device: str | torch.device = "cuda",
    *,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    progress: bool = True,
    codec_options: dict | None = None,
    storage_dtype: torch.dtype | None = None,
):
    """A randomly initialised causal LM built tensor by tensor into compressed form.

    Matrices are drawn from ``N(0, config.initializer_range)`` (transformers'
    default for Llama-style models), norm weights are ones and biases zeros.
    ``storage_dtype`` as for :func:`load_compressed`.

    Returns:
        ``(model, report)`` as :func:`load_compressed`.
    """
    skeleton = _skeleton(config, dtype)
    std = float(getattr(config, "initializer_range", 0.02))
    generator = torch.Generator(device=torch.device(device)).manual_seed(seed)

    tied_head = _tied_head_weight_name(skeleton, config)

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for name, param in list(skeleton.named_parameters()):  # _build swaps modules meanwhile
            if name == tied_head:
                continue  # shared with the embedding after loading
            if param.dim() >= 2:
                yield name, random_normal(param.shape, std, dtype, device, generator)
            elif name.endswith("bias"):
                yield name, torch.zeros(param.shape, dtype=dtype, device=device)
            else:
                yield name, torch.ones(param.shape, dtype=dtype, device=device)

    return _build(config, weights, device, dtype, tensors(), progress, codec_options, model=skeleton,
                  storage_dtype=storage_dtype)


_INIT_BLOCK_ELEMENTS = 1 << 22
"""Elements (in whole rows) of a host matrix drawn at once: 16 MiB of fp32 scratch, whatever the matrix's size."""


def random_normal(shape, std: float, dtype: torch.dtype, device, generator: torch.Generator) -> torch.Tensor:
    """``N(0, std)`` values of ``shape`` in ``dtype``: the bits of a whole fp32 draw rounded to ``dtype``,
    with scratch far below the fp32 matrix (a 1.96 GiB fp32 tensor for Llama-3-8B's embedding once ran a
    12 GB card out of memory while the model was built, issue 27).

    On CUDA, ``normal_`` draws straight in ``dtype``: each element's Philox number depends only on its
    index and the numel, and is rounded from fp32 to ``dtype`` as ``.to(dtype)`` rounds, so no fp32 copy
    is needed. On the CPU, ``normal_`` in bf16 would draw differently, so fp32 rows are drawn in blocks
    of a multiple of 16 elements (the CPU kernel pairs values in groups of 16, and its uniforms come in
    index order), each rounded into the result: the same bits as one fp32 draw of the whole matrix.

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> random_normal((4, 32), 0.02, torch.bfloat16, "cpu", g).dtype
        torch.bfloat16
    """
    device = torch.device(device)
    if device.type == "cuda" or dtype == torch.float32:
        return torch.empty(shape, dtype=dtype, device=device).normal_(0.0, std, generator=generator)
    out = torch.empty(shape, dtype=dtype, device=device)
    if out.numel() == 0:
        return out
    rows = out.view(-1, shape[-1])
    step = max(16, _INIT_BLOCK_ELEMENTS // max(1, shape[-1]) // 16 * 16)
    if shape[-1] < 16 or rows.shape[0] <= step:
        return out.copy_(torch.empty(shape, dtype=torch.float32, device=device).normal_(0.0, std, generator=generator))
    for start in range(0, rows.shape[0], step):
        block = rows[start:start + step]
        block.copy_(torch.empty(block.shape, dtype=torch.float32, device=device).normal_(0.0, std, generator=generator))
    return out


_AFTER_TENSOR = []  # callbacks (model, name or None at the end), set by after_each_tensor()


@contextlib.contextmanager
def after_each_tensor(callback):
    """Call ``callback(model, name)`` after each tensor a build places (``name`` None once all are placed).

    How :func:`neutrain.nn.weight_offload.streaming_offload` moves each decoder layer to host memory as
    soon as it is built, so a model whose compressed weights exceed the device's memory can be built.
    """
    _AFTER_TENSOR.append(callback)
    try:
        yield
    finally:
        _AFTER_TENSOR.remove(callback)


def _skeleton(config, dtype: torch.dtype):
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def _build(config, weights, device, dtype, tensors, progress, codec_options, model=None, storage_dtype=None,
           source_keys=None):
    if weights not in WEIGHT_MODES:
        raise ValueError(f"weights must be one of {WEIGHT_MODES}, not {weights!r}")
    from neutrain.compress import compress
    from neutrain.nn.checkpoint_keys import CheckpointKeys

    device = torch.device(device)
    model = model if model is not None else _skeleton(config, dtype)
    for module in model.modules():
        for name, buffer in list(module._buffers.items()):
            if buffer is not None:
                module._buffers[name] = buffer.to(device)
    targets = set(default_targets(model)) if weights != "dense" else set()
    stacks = set(expert_stacks(model)) if weights != "dense" else set()
    param_names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    keys = CheckpointKeys(model, source_keys)
    dense_bytes = compressed_bytes = converted = 0
    for source_name, source in _progress(tensors, progress, "loading weights"):
        for name, tensor in keys.feed(source_name, source):
            name = _match_name(name, param_names)
            if name is None:
                continue
            module_name, _, pname = name.rpartition(".")
            module = model.get_submodule(module_name)
            meta = module._parameters[pname]
            if tuple(tensor.shape) != tuple(meta.shape):
                raise CheckpointError(f"checkpoint tensor {name} has shape {tuple(tensor.shape)}; the model's "
                                      f"config needs {tuple(meta.shape)}")
            stack = (module_name, pname) in stacks
            target = stack or (module_name in targets and pname == "weight")
            cast = storage_dtype if target and storage_dtype is not None else meta.dtype
            tensor = tensor.to(device=device, dtype=cast if meta.is_floating_point() else tensor.dtype)
            dense_bytes += tensor.numel() * tensor.element_size()
            if target:
                ct = compress(tensor, name=name, **(codec_options or {}))
                compressed = CompressedWeight(ct, name=name, compute_dtype=meta.dtype)
                if stack:
                    compress_expert_stack(module, pname, compressed)
                else:
                    model.set_submodule(module_name, build_module(module, compressed, module_name, tensor))
                compressed_bytes += compressed.nbytes
                converted += 1
            else:
                module._parameters[pname] = torch.nn.Parameter(tensor, requires_grad=meta.requires_grad)
            del tensor
            for callback in _AFTER_TENSOR:
                callback(model, name)
        del source
    for callback in _AFTER_TENSOR:
        callback(model, None)
    _tie_if_configured(model, config)
    mark_large_weights(model)
    leftover = [n for n, p in model.named_parameters() if p.is_meta]
    if leftover:
        raise CheckpointError(f"checkpoint is missing {len(leftover)} tensor(s), e.g. {leftover[:5]}")
    model.train()
    report = CompressionReport(weights, converted, dense_bytes + _buffer_bytes(model), model_nbytes(model),
                               dense_bytes, compressed_bytes)
    return model, report


def _tie_if_configured(model, config) -> None:
    """Share the embedding with the lm_head when the config ties them and the checkpoint omits it."""
    if not getattr(config, "tie_word_embeddings", False):
        return
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    if head is None:
        return
    head_weight = getattr(head, "compressed", None)
    if head_weight is None and not head.weight.is_meta:
        return  # checkpoint carried its own lm_head
    name = next(n for n, m in model.named_modules() if m is head)
    if isinstance(getattr(embedding, "compressed", None), CompressedWeight):
        if head_weight is None:
            model.set_submodule(name, build_module(head, embedding.compressed))
    else:
        head.weight = embedding.weight


def _tied_head_weight_name(model, config) -> str | None:
    head = model.get_output_embeddings()
    if not getattr(config, "tie_word_embeddings", False) or head is None:
        return None
    return next(n for n, m in model.named_modules() if m is head) + ".weight"


def _match_name(name: str, param_names: set[str]) -> str | None:
    if name in param_names:
        return name
    for candidate in (f"model.{name}", name.removeprefix("model.")):
        if candidate in param_names:
            return candidate
    return None


def _buffer_bytes(model) -> int:
    return sum(b.numel() * b.element_size() for b in model.buffers())


def _resolve(path_or_id) -> Path:
    path = Path(path_or_id)
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(str(path_or_id), allow_patterns=["*.json", "*.safetensors"]))


def _safetensors_files(directory: Path) -> list[Path]:
    if (directory / "model.safetensors.index.json").exists():
        from neutrain.storage.confine import indexed_files

        return indexed_files(directory)  # each shard confined to the directory
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {directory}")
    return files
