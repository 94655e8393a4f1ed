"""Decode steps on NeuZip weights through ``zgemv``: each matrix read once, 12 bits a weight, decoded in registers.

A NeuZip model's decode step otherwise decodes every matrix to bf16 (the Huffman stream, serial per lane) and
reads that bf16 again in the product: about 0.35x the dense engine's speed. :func:`attach_zgemv` converts each
compressed bf16 linear of the model, once, to the zgemv layout (:mod:`neutrain.compress.zgemv`, through the
exact bf16: the same numbers) and :func:`zgemv_decoding` makes the calls inside it with at most 8 rows of input
and no autograd (decode steps, speculative verification) run :func:`neutrain.kernels.zgemv.zgemv`; prefill and
training keep the compressed path. Both kinds of matrices are covered:

* a fused group of compressed projections (Q/K/V, gate/up: :mod:`neutrain.decode.fused_projections`) gets one
  layout of its concatenated rows, so a step runs the group's one product on it;
* any other :class:`~neutrain.nn.CompressedLinear` (``o_proj``, ``down_proj``, a compressed ``lm_head``) becomes
  a :class:`ZgemvLinear` (its class swapped, as the fusion does; the module keeps its parameters, state dict
  and training path).

A weight updated after the conversion (its ``version`` moved) is not read stale: those calls take the
compressed path until :func:`attach_zgemv` runs again (a CUDA graph captured before the update replays the
path it captured: make a new engine after training steps). Memory: the layouts sit beside the NeuZip payloads,
about 12 more bits a weight while attached; :func:`detach_zgemv` frees them.

Serving mode, ``attach_zgemv(model, release=True)`` (``DecodeEngine(..., zgemv="replace")``): the layout
*replaces* each covered weight's NeuZip payload, which is freed (:mod:`neutrain.decode.zgemv_release`), so the
model holds about 12 bits a weight instead of 10.9 + 12. Prefill and other calls the kernel does not take
decode the weight to bf16 from the layout into the compressed path's own decode buffers; saving rebuilds
each payload exactly for the save; :func:`detach_zgemv` (and anything that needs a payload itself, such as an
optimizer's write) restores the payloads, bit for bit.

``table`` gives a configuration per weight shape, ``{(N, K): (block_n, block_k, split, num_warps, prmt)}``
(``benchmarks/decode/zgemv.py`` measures them: its keys ``zgemv_n64_k256_s8_w4_p1`` read in this order); a shape not
in it gets :func:`default_config`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from neutrain.compress.zgemv import ZgemvWeight
from neutrain.decode import zgemv_release
from neutrain.kernels import interpreting
from neutrain.decode.fused_projections import _CompressedGroup, activated
from neutrain.nn import CompressedLinear, CompressedWeight

MAX_ROWS = 8  # the kernel's (neutrain.kernels.zgemv.MAX_ROWS), read here without importing Triton


def default_config(n: int, k: int, sms: int = 132) -> tuple[int, int, int, int, bool]:
    """``(block_n, block_k, split, num_warps, prmt)``: 64 x 256 tiles, split along K until the grid has about
    two programs an SM (a short, wide matrix like Llama-3-8B's 4096 x 14336 ``down_proj`` otherwise leaves SMs
    idle), lanes placed by byte permutes.

    Example:
        >>> default_config(4096, 14336), default_config(128256, 4096)
        ((64, 256, 8, 4, True), (64, 256, 1, 4, True))
    """
    blocks = -(-n // 64)
    split = 1
    while split < 8 and blocks * split < 2 * sms and k // (split * 2) >= 1024:
        split *= 2
    return 64, 256, split, 4, True


class _Attached:
    """A matrix's zgemv layout, the configuration it runs with and the weight versions it was built from."""

    def __init__(self, weights: list, zw: ZgemvWeight, config: tuple, keep: set[int] | None = None):
        self.weights, self.zw, self.config = weights, zw, config
        self.versions = [w.version for w in weights]
        self.active = False
        # The weights whose payloads it replaces (serving mode: ``keep``, the ids of weights that keep theirs, given).
        self.released = [] if keep is None else zgemv_release.release(weights, zw, keep)

    def usable(self, x: torch.Tensor) -> bool:
        # a CPU runs the kernel only in Triton's interpreter (the tests); elsewhere it takes the compressed path
        return (self.active and not torch.is_grad_enabled() and x.shape[-1] == self.zw.shape[1]
                and (x.device.type == "cuda" or interpreting())
                and x.numel() // max(1, x.shape[-1]) <= MAX_ROWS and x.device == self.zw.device
                and [w.version for w in self.weights] == self.versions)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        from neutrain.kernels.zgemv import zgemv  # lazy: Triton only where a kernel runs

        block_n, block_k, split, num_warps, prmt = self.config
        y = zgemv(x, self.zw, block_n=block_n, block_k=block_k, split=split, num_warps=num_warps, prmt=bool(prmt))
        return y if bias is None else y + bias.to(y.dtype)


class ZgemvLinear(CompressedLinear):
    """A :class:`~neutrain.nn.CompressedLinear` with a zgemv layout attached: inside :func:`zgemv_decoding`,
    without autograd and on at most 8 rows, its product runs ``zgemv``; elsewhere it is the layer it was."""

    _neutrain_zgemv: _Attached

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        attached = self._neutrain_zgemv
        if attached.usable(x):
            return attached(x, self.bias)
        return super().forward(x)


def _bf16(weights: list) -> bool:
    return all(w.dtype == torch.bfloat16 and w.device.type != "meta" for w in weights)


def attach_zgemv(model: torch.nn.Module, table: dict | None = None, *, release: bool = False) -> int:
    """Convert the model's compressed bf16 linears (fused groups as one matrix each, see the module docstring)
    to the zgemv layout; returns how many matrices are attached. Calling it again rebuilds them all (after
    training, say). Fuse first (:func:`~neutrain.decode.fused_projections.fuse_projections`) for one product per
    group; unfused projections are attached one by one. ``release``: the serving mode, each layout replacing
    its weights' NeuZip payloads (see the module docstring; :func:`zgemv_payload_bytes` counts what they hold)."""
    detach_zgemv(model)
    table = table or {}
    attached = []
    keep = None  # serving mode: a weight an embedding also reads (tied) keeps its payload (lookups decode few tiles)
    if release:
        keep = {id(m.compressed) for m in model.modules()
                if isinstance(getattr(m, "compressed", None), CompressedWeight) and not isinstance(m, CompressedLinear)}
    with torch.no_grad():
        for group in getattr(model, "_neutrain_fused_groups", None) or []:
            weights = [m.compressed for m in group.members]
            if isinstance(group, _CompressedGroup) and _bf16(weights):
                dense = torch.cat([w.dense() for w in weights])
                group.zgemv = _Attached(weights, ZgemvWeight.from_bf16(dense),
                                        tuple(table.get(tuple(dense.shape), default_config(*dense.shape))), keep)
                del dense  # freed before the next matrix: attaching never holds more than one dense copy
                attached.append(group.zgemv)
        for module in model.modules():
            if type(module) is CompressedLinear and _bf16([module.compressed]):
                dense = module.compressed.dense()
                module._neutrain_zgemv = _Attached([module.compressed], ZgemvWeight.from_bf16(dense),
                                                   tuple(table.get(tuple(dense.shape), default_config(*dense.shape))),
                                                   keep)
                del dense
                module.__class__ = ZgemvLinear
                attached.append(module._neutrain_zgemv)
    model._neutrain_zgemv = attached
    return len(attached)


def detach_zgemv(model: torch.nn.Module) -> int:
    """Restore the payloads released in serving mode (exact, each checked by its checksum), free the model's zgemv
    layouts and give its layers back their plain classes; returns how many layouts there were."""
    attached = getattr(model, "_neutrain_zgemv", None) or []
    for item in attached:  # first: a payload is rebuilt from its layout
        zgemv_release.restore(item.released)
        item.released = []
    for module in model.modules():
        if isinstance(module, ZgemvLinear):
            module.__class__ = CompressedLinear
            del module._neutrain_zgemv
    for group in getattr(model, "_neutrain_fused_groups", None) or []:
        if isinstance(group, _CompressedGroup):
            group.zgemv = None
    model.__dict__.pop("_neutrain_zgemv", None)
    return len(attached)


@contextlib.contextmanager
def zgemv_decoding(model: torch.nn.Module) -> Iterator[None]:
    """Within this context the model's attached matrices run ``zgemv`` on decode-sized inputs (a no-op for a
    model without any). The decode engine wraps its model calls in this; a CUDA graph captured inside keeps it."""
    with activated(getattr(model, "_neutrain_zgemv", None) or []):
        yield


def zgemv_payload_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Device bytes of the weights of the model's compressed linears: ``payload`` (their NeuZip tensors, or the
    code tables a released one keeps), ``zgemv`` (the attached layouts) and ``released`` (how many weights are
    served by a layout alone). The benchmark's memory row and the tests read it."""
    weights = {id(m.compressed): m.compressed for m in model.modules() if isinstance(m, CompressedLinear)}
    attached = getattr(model, "_neutrain_zgemv", None) or []
    return {"payload": zgemv_release.payload_bytes(list(weights.values())),
            "zgemv": sum(a.zw.nbytes() for a in attached),
            "released": sum(w.released for w in weights.values())}
