"""``compress_model``: turn a causal LM's weights into compressed modules, in place.

Every ``nn.Linear`` (attention and MLP projections, the lm_head) becomes a
:class:`CompressedLinear`, the input embedding a :class:`CompressedEmbedding`
(keeping a scaled embedding's ``embed_scale``, :mod:`neutrain.nn.architecture`) and
every MoE expert stack a compressed 3-D weight (:mod:`neutrain.nn.experts`);
norms, biases and routers stay dense. A tied embedding/lm_head pair becomes one
:class:`CompressedWeight` shared by both modules. Each dense weight is dropped as
soon as it is encoded, so no dense copy survives and the peak during conversion
is the dense model plus one compressed tensor.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from neutrain.nn.architecture import check_linear, embedding_scale
from neutrain.nn.buffers import DECODE_BUFFERS
from neutrain.nn.build_progress import build_progress
from neutrain.nn.groups import form_groups
from neutrain.nn.embedding import CompressedEmbedding
from neutrain.nn.experts import compress_expert_stack, expert_stacks
from neutrain.nn.linear import CompressedLinear
from neutrain.nn.weight import CompressedWeight
from neutrain.optim.fused import COMPRESSED_KEY_ATTR

WEIGHT_MODES = ("neuzip-lossless", "dense")


@dataclasses.dataclass
class CompressionReport:
    """Bytes held by a model's tensors before and after :func:`compress_model`.

    ``bytes_before``/``bytes_after`` count every parameter and buffer of the
    model (compressed tensors by their codec bytes, shared tensors once);
    ``weight_bytes_before``/``weight_bytes_after`` only the converted weights.
    """

    weights: str
    converted: int
    bytes_before: int
    bytes_after: int
    weight_bytes_before: int
    weight_bytes_after: int

    @property
    def ratio(self) -> float:
        return self.bytes_after / max(1, self.bytes_before)

    @property
    def bits_per_weight(self) -> float:
        """Codec bits per converted weight element (16 means no saving for bf16)."""
        return 16.0 * self.weight_bytes_after / max(1, self.weight_bytes_before) if self.converted else 16.0

    def __str__(self) -> str:
        return (f"{self.weights}: {self.converted} weights converted, model {byte_size(self.bytes_before)} -> "
                f"{byte_size(self.bytes_after)} ({100 * self.ratio:.1f} %)")


def byte_size(n: int) -> str:
    """``n`` bytes in the unit that shows it: GiB from 1 GiB up, else MiB (a tiny model read "0.000 GiB").

    Example:
        >>> byte_size(3 << 30), byte_size(5_300_000), byte_size(2048)
        ('3.00 GiB', '5.05 MiB', '0.002 MiB')
    """
    if n >= 1 << 30:
        return f"{n / (1 << 30):.2f} GiB"
    mib = n / (1 << 20)
    return f"{mib:.2f} MiB" if mib >= 0.1 else f"{mib:.3f} MiB"


def model_nbytes(model: torch.nn.Module) -> int:
    """Bytes of every distinct parameter, buffer and compressed weight of ``model``."""
    seen: set[int] = set()
    total = 0
    for tensor in list(model.parameters()) + list(model.buffers()):
        if tensor.numel() and tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            total += tensor.numel() * tensor.element_size()
    for weight in compressed_weights(model):
        total += weight.nbytes
    return total


def parameter_count(model: torch.nn.Module) -> int:
    """Elements of every distinct parameter of ``model``, a compressed weight counted by its shape (its
    ``Parameter`` is an empty key: counting those, the 70B recipe's log read "1.3M parameters").

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 4, bias=False).bfloat16())
        >>> before = parameter_count(model)
        >>> _ = compress_model(model, progress=False)
        >>> before, parameter_count(model)
        (32, 32)
    """
    dense = sum(p.numel() for p in model.parameters() if not getattr(p, COMPRESSED_KEY_ATTR, False))
    return dense + sum(weight.numel for weight in compressed_weights(model))


def compressed_weights(model: torch.nn.Module) -> list[CompressedWeight]:
    """The distinct compressed weights of ``model`` (a tied pair counts once)."""
    found: dict[int, CompressedWeight] = {}
    for module in model.modules():
        weight = getattr(module, "compressed", None)
        if isinstance(weight, CompressedWeight):
            found.setdefault(id(weight), weight)
        for weight in module.__dict__.get("compressed_params", {}).values():  # MoE expert stacks
            found.setdefault(id(weight), weight)
    return list(found.values())


def default_targets(model: torch.nn.Module) -> list[str]:
    """Names of the modules :func:`compress_model` converts by default."""
    targets = [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        module = getattr(model, getter, lambda: None)()
        if module is not None:
            name = next((n for n, m in model.named_modules() if m is module), None)
            if name is not None and name not in targets and isinstance(module, (torch.nn.Embedding, torch.nn.Linear)):
                targets.append(name)
    return targets


def compress_model(
    model: torch.nn.Module,
    weights: str = "neuzip-lossless",
    *,
    mantissa_bits: int | None = None,
    targets: Callable[[str, torch.nn.Module], bool] | None = None,
    progress: bool = True,
    codec_options: dict | None = None,
    storage_dtype: torch.dtype | None = None,
) -> CompressionReport:
    """Convert ``model``'s linear and embedding weights to compressed modules, in place.

    Args:
        model: a transformers causal LM (or any module with ``nn.Linear``/``nn.Embedding``).
        weights: ``"neuzip-lossless"`` (trainable, bit-exact) or ``"dense"`` (no change).
        mantissa_bits: lossy mode for frozen weights (trainable weights must stay lossless:
            a lossy weight would round small updates away).
        targets: optional filter ``(name, module) -> bool`` over the default targets.
        progress: show a tqdm bar (also silenced by ``DISABLE_TQDM=1``).
        codec_options: extra keyword arguments for ``neutrain.compress.compress``.
        storage_dtype: store the weights in this dtype (e.g. bf16 for an fp32 model on CPU,
            which then computes in fp32 on upcast weights); default: each weight's own dtype.

    Returns:
        A :class:`CompressionReport`.

    Example:
        >>> from transformers import LlamaConfig, AutoModelForCausalLM
        >>> cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        ...                   num_attention_heads=2, num_key_value_heads=1, vocab_size=64)
        >>> model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        >>> report = compress_model(model, progress=False)
        >>> report.converted, type(model.lm_head).__name__
        (9, 'CompressedLinear')
    """
    if weights not in WEIGHT_MODES:
        raise ValueError(f"weights must be one of {WEIGHT_MODES}, not {weights!r}")
    before = model_nbytes(model)
    if weights == "dense":
        return CompressionReport(weights, 0, before, before, 0, 0)
    from neutrain.compress import compress

    names = [n for n in default_targets(model) if targets is None or targets(n, model.get_submodule(n))]
    shared: dict[int, CompressedWeight] = {}
    weight_before = weight_after = 0
    for name in build_progress(names, "compressing weights", len(names), progress):
        module = model.get_submodule(name)
        dense = module.weight
        if mantissa_bits is not None and dense.requires_grad:
            raise ValueError(f"{name}: lossy compression (mantissa_bits={mantissa_bits}) is for frozen weights only")
        compressed = shared.get(id(dense))
        if compressed is None:
            stored = dense.detach().to(storage_dtype or dense.dtype)
            ct = compress(stored, mantissa_bits, name=f"{name}.weight", **(codec_options or {}))
            compressed = CompressedWeight(ct, requires_grad=dense.requires_grad, name=f"{name}.weight",
                                          compute_dtype=dense.dtype)
            shared[id(dense)] = compressed
            weight_before += stored.numel() * stored.element_size()
            del stored
            weight_after += compressed.nbytes
        replacement = build_module(module, compressed, name, dense)
        model.set_submodule(name, replacement)
        module._parameters["weight"] = None  # drop our reference to the dense weight now
        del dense, module
    for module_name, pname in expert_stacks(model):
        module = model.get_submodule(module_name)
        if targets is not None and not targets(f"{module_name}.{pname}", module):
            continue
        dense = module._parameters[pname]
        name = f"{module_name}.{pname}"
        if mantissa_bits is not None and dense.requires_grad:
            raise ValueError(f"{name}: lossy compression (mantissa_bits={mantissa_bits}) is for frozen weights only")
        stored = dense.detach().to(storage_dtype or dense.dtype)
        ct = compress(stored, mantissa_bits, name=name, **(codec_options or {}))
        compressed = CompressedWeight(ct, requires_grad=dense.requires_grad, name=name, compute_dtype=dense.dtype)
        weight_before += stored.numel() * stored.element_size()
        weight_after += compressed.nbytes
        compress_expert_stack(module, pname, compressed)
        shared[id(dense)] = compressed
        del stored, dense
    mark_large_weights(model)
    return CompressionReport(weights, len(shared), before, model_nbytes(model), weight_before, weight_after)


def mark_large_weights(model: torch.nn.Module) -> None:
    """Flag embedding and lm_head weights: they use the large decode buffer and are never prefetched;
    then hand the building's transients back to the device and reserve the decode buffers at their
    final sizes (see :mod:`neutrain.nn.buffers`)."""
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        module = getattr(model, getter, lambda: None)()
        weight = getattr(module, "compressed", None)
        if isinstance(weight, CompressedWeight):
            weight.large = True
    weights = compressed_weights(model)
    if any(w.device.type == "cuda" for w in weights) and torch.cuda.is_initialized():
        # Compressing left holes between the compressed buffers where each dense matrix and its
        # encoder scratch were (2 GiB for a Llama-3 vocabulary matrix's int32 symbols). Cached, they
        # stayed reserved for the whole run: measured on an H100 (Llama-3-8B, expandable segments),
        # 14.06 GiB reserved for 11.49 GiB allocated after warm-up (benchmarks/memory/step_anatomy.py).
        torch.cuda.empty_cache()
    # Grouped layers decode into their own buffers (neutrain.nn.groups): the layer slots are for the rest.
    form_groups(model, compressed_weights, lambda device: DECODE_BUFFERS.keep_budget(device) > 0)
    DECODE_BUFFERS.reserve([w for w in weights if w.group is None])


def build_module(dense_module: torch.nn.Module, compressed: CompressedWeight, name: str = "",
                 values: torch.Tensor | None = None) -> torch.nn.Module:
    """The compressed counterpart of an ``nn.Linear`` or ``nn.Embedding`` (subclasses are checked).

    ``values``: the weight's dense values, to check an embedding subclass's forward on real rows
    (default: decoded from ``compressed``).
    """
    if isinstance(dense_module, torch.nn.Embedding):
        if values is None and type(dense_module).forward is not torch.nn.Embedding.forward:
            values = compressed.ct.decompress_rows(torch.arange(min(64, compressed.shape[0]), device=compressed.device))
        scale = embedding_scale(name, dense_module, values) if values is not None else None
        return CompressedEmbedding(compressed, padding_idx=dense_module.padding_idx, scale=scale)
    if isinstance(dense_module, torch.nn.Linear):
        check_linear(name, dense_module)
        return CompressedLinear(compressed, bias=dense_module.bias)
    raise TypeError(f"cannot compress a {type(dense_module).__name__}")


def decompressed_state_dict(model: torch.nn.Module, device: str | torch.device | None = None) -> dict[str, torch.Tensor]:
    """The model's state dict with every compressed weight decoded under its dense name.

    Values are exactly the bytes the model computes with (lossless weights are
    bit-identical to the trained bf16 weights; bf16 storage under fp32 compute gives
    them upcast to fp32, as the modules use them). Decodes one weight at a time.
    ``device="cpu"`` moves each decoded weight to the host before the next is decoded,
    so the model's device holds one dense matrix at a time, never the dense model
    (a dense export must fit where the compressed model did); by default the values stay where the model is.

    Example:
        >>> lin = torch.nn.Sequential(torch.nn.Linear(4, 4, bias=False).bfloat16())
        >>> w = lin[0].weight.detach().clone()
        >>> _ = compress_model(lin, progress=False)
        >>> torch.equal(decompressed_state_dict(lin)["0.weight"], w)
        True
    """
    out: dict[str, torch.Tensor] = {}

    def put(key: str, value: torch.Tensor) -> None:
        out[key] = value if device is None else value.to(device)

    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        if isinstance(module, (CompressedLinear, CompressedEmbedding)):
            put(prefix + "weight", module.compressed.dense().to(module.compressed.compute_dtype))
            if getattr(module, "bias", None) is not None:
                put(prefix + "bias", module.bias.detach())
            continue
        for pname, weight in module.__dict__.get("compressed_params", {}).items():  # MoE expert stacks
            put(prefix + pname, weight.dense().to(weight.compute_dtype))
        for pname, p in module.named_parameters(recurse=False):
            if not getattr(p, COMPRESSED_KEY_ATTR, False):
                put(prefix + pname, p.detach())
        for bname, b in module.named_buffers(recurse=False):
            if bname not in module._non_persistent_buffers_set:
                put(prefix + bname, b.detach())
    return out
