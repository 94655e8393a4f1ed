"""Which Sage route the fidelity study runs on its device, and the environment that makes every Sage call take it.

On the CPU: the quantized reference forward and torch's exact CPU backward fed Sage's O and LSE (the
counterpart of the cuDNN route). On a GPU: Sage forced onto every supported call (the dispatch table may
pick SDPA at the study's lengths, and the study is about Sage's numbers, not its speed), on the forward
kernel and backward route the table's train entries name for this GPU, with the kernel settings the
attention registration would pass.
"""

from __future__ import annotations

import os
from collections import Counter

import torch

CPU_ROUTE = ("forward: sage_attention reference (INT8 Q/K smoothed K, FP8 P and V + V residual); "
             "backward: exact torch CPU kernel fed Sage's O, LSE and smoothed K "
             "(NEUTRAIN_SAGE_BACKWARD=cpu; the GPU's is cuDNN's)")
HEAD_DIM = 64  # SmolLM2-135M's


def gpu_route(device_name: str, head_dim: int, entries: tuple[dict, ...] | None = None) -> dict:
    """The Sage forward kernel and backward route a GPU training step would run: what the dispatch table's
    train entries for this GPU name (this head dim's first, else any head dim's; the most frequent pair,
    whichever backend won), or the table's own defaults (triton, triton) where it has no train entry.

    Example:
        >>> e = ({"device": "G", "head_dim": 128, "mode": "train", "kernel": "gluon", "backward": "cudnn"},)
        >>> gpu_route("G", 64, e)["kernel"], gpu_route("G", 64, e)["backward"], gpu_route("H", 64, e)["kernel"]
        ('gluon', 'cudnn', 'triton')
    """
    from neutrain.attention import dispatch

    if entries is None:
        entries = dispatch.load_table(str(dispatch.table_path()))
    train = [e for e in entries if e.get("device") == device_name and e.get("mode") == "train"]
    same_dim = [e for e in train if e.get("head_dim") == head_dim]
    chosen = same_dim or train
    if not chosen:
        return {"kernel": "triton", "backward": "triton", "source": f"no train entry for {device_name}: defaults"}
    (kernel, backward), n = Counter((e.get("kernel", "triton"), e.get("backward", "triton"))
                                    for e in chosen).most_common(1)[0]
    return {"kernel": kernel, "backward": backward,
            "source": f"{n} of {len(chosen)} train entries for {device_name}, "
                      f"{'d=' + str(head_dim) if same_dim else 'any head dim'}"}


def set_route(device: str, kernel: str | None = None, backward: str | None = None) -> dict:
    """Point every Sage call at the route this device's study runs (the environment the attention reads)."""
    from neutrain.attention import dispatch

    if device == "cpu":
        os.environ["NEUTRAIN_SAGE_BACKWARD"] = "cpu"  # the exact backward route, fed Sage's O and LSE
        return {"kernel": "reference", "backward": "cpu", "source": "the CPU counterpart of the cuDNN route",
                "description": CPU_ROUTE}
    if not torch.cuda.is_available():
        raise SystemExit("the GPU study needs a CUDA device")
    name = torch.cuda.get_device_name(0)
    route = gpu_route(name, HEAD_DIM)
    route["kernel"], route["backward"] = kernel or route["kernel"], backward or route["backward"]
    os.environ.update(NEUTRAIN_SAGE_DISPATCH="always", NEUTRAIN_SAGE_KERNEL=route["kernel"],
                      NEUTRAIN_SAGE_BACKWARD=route["backward"])
    route["config"] = dispatch.kernel_config(name, HEAD_DIM)  # what the registration passes the kernel
    route["description"] = (f"{name}: forward Sage {route['kernel']} kernel (NEUTRAIN_SAGE_DISPATCH=always), backward "
                            f"{route['backward']} ({route['source']}); held-out evaluation on the same forward")
    return route
