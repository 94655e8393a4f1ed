"""Comparing two checkpoints of a compressed run: which stored tensors differ, and whether their values do.

A checkpoint's manifest holds a sha256 per tensor, so two checkpoints compare without reading their bytes;
for the compressed weights that differ, decoding both tells a difference of values from one of encoding
only (the same weights under another code). Used by ``cards.py`` and ``offload/resume_offload_gpu.py``.
"""

from __future__ import annotations

import json
from pathlib import Path


def checkpoint_tensors(ckpt: Path) -> dict[str, str]:
    """{file/tensor: sha256} of a checkpoint's safetensors files, from its manifest."""
    manifest = json.loads((ckpt / "neutrain_manifest.json").read_text())
    return {f"{f}/{t}": h for f, e in manifest["files"].items() if f.endswith(".safetensors")
            for t, h in e.get("tensors", {}).items()}


def decoded_differences(a: Path, b: Path, names: list[str]) -> dict[str, dict]:
    """{weight: {"values_differing": n, "numel": N}} for compressed weights among ``names``."""
    import torch
    from safetensors import safe_open

    from neutrain.compress import CompressedTensor

    DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
    out = {}
    weights = sorted({n.split("/", 1)[1].rpartition(".weight.")[0] + ".weight" for n in names if ".weight." in n})
    with safe_open(str(a / "model.safetensors"), "pt") as fa, safe_open(str(b / "model.safetensors"), "pt") as fb:
        for w in weights:
            ta = {k[len(w) + 1:]: fa.get_tensor(k) for k in fa.keys() if k.startswith(w + ".")}
            tb = {k[len(w) + 1:]: fb.get_tensor(k) for k in fb.keys() if k.startswith(w + ".")}
            da = CompressedTensor.from_state_dict(ta, name=w, device=DEVICE).decompress()
            db = CompressedTensor.from_state_dict(tb, name=w, device=DEVICE).decompress()
            differ = (da.view(torch.int16) != db.view(torch.int16))
            out[w] = {"values_differing": int(differ.sum()), "numel": da.numel(),
                      "rows_differing": int(differ.view(da.shape[0], -1).any(dim=1).sum()),
                      "stream_bytes": [int(ta["stream"].numel()), int(tb["stream"].numel())]}
    return out
