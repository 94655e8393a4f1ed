"""Decode or re-encode many compressed tensors in one kernel launch each.

Small matrices (a Llama-3-8B k/v projection has 4M weights, 16K coding lanes) fill a
fraction of a GPU, and each launch pays its start and its tail. :func:`decode_many`
and :func:`encode_many` run every tile of a list of tensors (for instance a decoder
layer's seven matrices) in one grouped launch (:mod:`neutrain.kernels.codec_many`),
producing the same bytes as the per-tensor calls. Tensors that cannot join a group
(CPU, lossy, other dtypes) take the per-tensor path; groups form per device and tile
geometry.

Neither function reads anything back to the host. The launch table (the tensors'
addresses) is built once per combination of buffers, copied to the device without
blocking from pinned memory, and cached.

Example:
    >>> import torch
    >>> from neutrain.compress import compress
    >>> ws = [torch.randn(64, 32).bfloat16(), torch.randn(16, 32).bfloat16()]
    >>> cts = [compress(w) for w in ws]
    >>> outs = decode_many(cts)
    >>> all(torch.equal(o, w) for o, w in zip(outs, ws))
    True
    >>> encode_many(cts, [w * 2 for w in ws])
    >>> torch.equal(cts[1].decompress(), ws[1] * 2)
    True
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from neutrain.compress import stream as kstream
from neutrain.compress.tensor import CompressedTensor, _use_kernel

_TABLES: OrderedDict = OrderedDict()
_MAX_TABLES = 256
_SENTINEL = 1 << 62


def _groupable(ct: CompressedTensor, backend: str) -> bool:
    return ct.layout.lossless and ct.numel > 0 and _use_kernel(ct.layout, ct.elems, ct.device, backend)


def _groups(cts: list[CompressedTensor], backend: str) -> tuple[dict, list[int]]:
    """Indices of groupable tensors by (device, tile geometry), and the rest."""
    groups: dict = {}
    single = []
    for i, ct in enumerate(cts):
        if _groupable(ct, backend):
            key = (ct.device, ct.steps, ct.lanes, ct.elems)
            groups.setdefault(key, []).append(i)
        else:
            single.append(i)
    return groups, single


def _table(cts: list[CompressedTensor], data: list[torch.Tensor]) -> torch.Tensor:
    """The launch table (see :mod:`neutrain.kernels.codec_many`), cached by its content."""
    from neutrain.kernels import codec_many as km  # lazy: Triton, GPU path only

    width = 1
    while width < len(cts) + 1:
        width *= 2
    rows = [[0] * width for _ in range(km.ROWS)]
    first = 0
    for col, (ct, d) in enumerate(zip(cts, data)):
        rows[km.ROW_STARTS][col] = first
        first += ct.tiles
        values = {km.ROW_NUMEL: ct.numel, km.ROW_DATA: d.data_ptr(), km.ROW_ENC: ct.enc_table.data_ptr(),
                  km.ROW_STREAM: ct.stream.data_ptr(), km.ROW_LANE_WORDS: ct.lane_words.data_ptr(),
                  km.ROW_TILE_BASE: ct.tile_base.data_ptr(), km.ROW_TAILS: ct.tails.data_ptr(),
                  km.ROW_LUT: ct.lut.data_ptr(),
                  km.ROW_CAPACITY: ct.stream.numel(), km.ROW_STATUS: ct.status.tensor.data_ptr()}
        for row, value in values.items():
            rows[row][col] = value
    rows[km.ROW_STARTS][len(cts)] = first
    for col in range(len(cts) + 1, width):
        rows[km.ROW_STARTS][col] = _SENTINEL
    device = cts[0].device
    key = (device, tuple(map(tuple, rows)))
    cached = _TABLES.get(key)
    if cached is None:
        # The key holds every address: a reallocated stream or another output makes a new table.
        host = torch.tensor(rows, dtype=torch.int64)
        if device.type == "cuda":
            host = host.pin_memory()
        cached = (host.to(device, non_blocking=True), host)  # the pinned source must outlive the copy
        _TABLES[key] = cached
        if len(_TABLES) > _MAX_TABLES:
            _TABLES.popitem(last=False)
    else:
        _TABLES.move_to_end(key)
    return cached[0]


def decode_many(cts: list[CompressedTensor], outs: list[torch.Tensor] | None = None, *,
                backend: str = "auto") -> list[torch.Tensor]:
    """Decode every tensor of ``cts`` (into ``outs``, contiguous and shaped like each, when given).

    Returns the outputs, each bit-identical to ``ct.decompress()``. ``backend="triton"``
    forces the grouped kernels (on CPU: Triton's interpreter, for tests).
    """
    from neutrain.kernels import codec_many as km  # lazy: Triton, GPU path only

    outs = list(outs) if outs is not None else [torch.empty(ct.shape, dtype=ct.dtype, device=ct.device) for ct in cts]
    if len(outs) != len(cts):
        raise ValueError(f"decode_many got {len(cts)} tensors but {len(outs)} outputs")
    groups, single = _groups(cts, backend)
    for i in single:  # a forced "triton" applies to groupable tensors only
        cts[i].decompress(out=outs[i], backend="auto" if backend == "triton" else backend)
    for (_, steps, lanes, elems), members in groups.items():
        for i in members:  # the checks of decompress(out=...)
            ct, out = cts[i], outs[i]
            if out.shape != ct.shape or out.dtype != ct.dtype or out.device != ct.device or not out.is_contiguous():
                raise ValueError(f"out {i} must be contiguous {ct.dtype} {tuple(ct.shape)} on {ct.device}")
        members_cts = [cts[i] for i in members]
        table = _table(members_cts, [outs[i] for i in members])
        km.decode_group(table, sum(ct.tiles for ct in members_cts), steps, lanes, elems,
                        all(ct.numel % elems == 0 for ct in members_cts),
                        aligned=all(outs[i].data_ptr() % 8 == 0 for i in members))
    return outs


def encode_many(cts: list[CompressedTensor], xs: list[torch.Tensor], *, backend: str = "auto") -> None:
    """Re-encode ``cts`` from ``xs`` without host synchronisation: ``ct.recompress_(x, sync=False)`` for each.

    Tensors whose code is due for a rebuild take the synchronous per-tensor path; see
    :mod:`neutrain.compress.stream` for the capacity and overflow rules.
    """
    from neutrain.kernels import codec_many as km  # lazy: Triton, GPU path only

    if len(xs) != len(cts):
        raise ValueError(f"encode_many got {len(cts)} tensors but {len(xs)} inputs")
    groups, single = _groups(cts, backend)
    for i in single:
        cts[i].recompress_(xs[i], sync=False, backend="auto" if backend == "triton" else backend)
    for (device, steps, lanes, elems), members in groups.items():
        ready, inputs = [], []
        for i in members:
            ct, x = cts[i], xs[i].detach()
            if x.shape != ct.shape or x.dtype != ct.dtype or x.device != ct.device:
                raise ValueError(f"expected a {ct.dtype} tensor of shape {tuple(ct.shape)} on {ct.device}, "
                                 f"got {x.dtype} {tuple(x.shape)} on {x.device}")
            if kstream.prepare_sync_free(ct):
                ready.append(ct)
                inputs.append(x.contiguous())
            else:
                ct.recompress_(x, sync=True, backend=backend)
        if not ready:
            continue
        tiles = sum(ct.tiles for ct in ready)
        counts = torch.empty(tiles * lanes, dtype=torch.uint8, device=device)
        scratch = torch.empty(2, tiles, dtype=torch.int64, device=device)
        table = _table(ready, inputs)
        km.count_group(table, counts, scratch, steps, lanes, elems)
        cum = torch.cumsum(scratch, dim=1)
        km.pack_group(table, counts, cum, steps, lanes, elems, all(ct.numel % elems == 0 for ct in ready))
        kstream.publish_many([ct.status for ct in ready])
