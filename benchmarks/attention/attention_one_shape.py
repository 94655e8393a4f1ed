"""One attention forward at one shape with one method: the process Nsight Compute profiles.

Methods: ``gluon`` (the warp-specialized Sage forward, its default GluonConfig: what dispatch launches),
``triton`` (the Triton Sage forward, the dispatch table's config for this card or the default), and
``cudnn`` (torch SDPA forced onto cuDNN, bf16). Sage's inputs are quantized before the kernel runs, so
a kernel filter (``ncu -k regex:...``) on the forward sees only the attention kernel. The forward runs
``--repeat`` times (the first launch is the profiled one with ``--launch-count 1``; later ones give a
plain timing when no profiler is attached).

    PYTHONPATH=. python benchmarks/attention/attention_one_shape.py --method gluon --b 4 --h 32 --n 16384 --d 128
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from neutrain.attention import dispatch  # noqa: E402
from neutrain.attention.quant import TILE, quantize_attention_inputs  # noqa: E402
from neutrain.config.knobs import knob  # noqa: E402

#: The kernel-name filters that pick each method's forward kernel out of everything the process launches.
KERNEL_FILTERS = {"gluon": "sage_fwd_gluon", "triton": "_sage_fwd_kernel", "cudnn": "cudnn|sdpa|fprop|fmha|flash"}


def forward(method: str, b: int, h: int, n: int, d: int, causal: bool):
    """A zero-argument callable running the method's forward on fresh random bf16 inputs."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    if method == "cudnn":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def run():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

        return run
    config = dispatch.kernel_config(torch.cuda.get_device_name(0), d) or {"k_tile_scale": True}
    # The PV form every Sage call uses (plain unless NEUTRAIN_SAGE_V_RESIDUAL=1): the profile is of what runs.
    qi = quantize_attention_inputs(q, k, v, d ** -0.5, k_group=TILE if config.get("k_tile_scale") else 16,
                                   v_residual=bool(knob("NEUTRAIN_SAGE_V_RESIDUAL")))
    if method == "gluon":
        from neutrain.kernels.sage_attention_gluon import sage_attention_forward_gluon

        return lambda: sage_attention_forward_gluon(qi, causal)
    from neutrain.kernels.sage_attention import ForwardConfig, sage_attention_forward

    launch = ForwardConfig(config["block_m"], config["num_warps"], config["num_stages"],
                           bool(config.get("pipeline"))) if "block_m" in config else None
    return lambda: sage_attention_forward(qi, causal, config=launch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", choices=sorted(KERNEL_FILTERS), required=True)
    parser.add_argument("--b", type=int, default=4)
    parser.add_argument("--h", type=int, default=32)
    parser.add_argument("--n", type=int, default=16384)
    parser.add_argument("--d", type=int, default=128)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--print-filter", action="store_true", help="print the method's kernel-name regex and exit")
    args = parser.parse_args()
    if args.print_filter:
        print(KERNEL_FILTERS[args.method])
        return
    run = forward(args.method, args.b, args.h, args.n, args.d, args.causal)
    torch.cuda.synchronize()
    for i in range(args.repeat):
        t = time.perf_counter()
        run()
        torch.cuda.synchronize()
        print(f"{args.method} B={args.b} H={args.h} N={args.n} d={args.d} causal={args.causal} "
              f"call {i}: {1e3 * (time.perf_counter() - t):.2f} ms", flush=True)


if __name__ == "__main__":
    main()
